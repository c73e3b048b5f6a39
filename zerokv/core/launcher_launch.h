/* Part of launcher.c, compiled as its one translation unit: forms, the launch, and the table run
 * on one call. */

/* Read entry e (a bound.Entry) into f. 1 done, 0 an entry this executor cannot launch, -1 an
 * exception. */
static int read_form(PyObject *e, Form *f)
{
    PyObject *names[] = {s_t_lo, s_t_hi, s_block, s_grid, s_per_token, s_run_tail, s_run_spans, s_cap,
                         s_nbytes};
    int64_t v[9];
    int bad = 0;
    for (int i = 0; i < 9; i++) {
        PyObject *o = PyObject_GetAttr(e, names[i]);
        if (o == NULL)
            return not_taken_or_raise();
        v[i] = PyObject_IsTrue(o) == 0 ? 0 : as_i64(o, &bad); /* None or False: 0 */
        Py_DECREF(o);
    }
    f->t_lo = v[0], f->t_hi = v[1], f->block = v[2], f->grid = v[3], f->per_token = v[4];
    f->run_tail = v[5], f->run_spans = v[6], f->cap = v[7];
    if (bad || v[8] < 0 || v[8] > MAX_PARAM_BYTES || f->block < 1 ||
        (f->per_token && f->run_tail && !f->cap && f->run_spans < 1))
        return 0;
    f->nbytes = (int32_t)v[8];
    PyObject *handle = PyObject_GetAttr(e, s_handle);
    PyObject *context = handle ? PyObject_GetAttr(e, s_context) : NULL;
    if (context == NULL) {
        Py_XDECREF(handle);
        return not_taken_or_raise();
    }
    f->handle = PyLong_Check(handle) ? PyLong_AsVoidPtr(handle) : NULL;
    f->context = PyLong_Check(context) ? PyLong_AsVoidPtr(context) : NULL;
    Py_DECREF(handle);
    Py_DECREF(context);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    PyObject *bits = PyObject_GetAttr(e, s_const_bits);
    if (bits == NULL)
        return not_taken_or_raise();
    int ok = PyTuple_Check(bits) && PyTuple_GET_SIZE(bits) <= NREG - CONST_BASE;
    f->nconst = ok ? (int32_t)PyTuple_GET_SIZE(bits) : 0;
    for (int i = 0; ok && i < f->nconst; i++) {
        PyObject *o = PyTuple_GET_ITEM(bits, i);
        f->const_bits[i] = PyLong_Check(o) ? PyLong_AsUnsignedLongLongMask(o) : 0;
        ok = PyLong_Check(o) && !PyErr_Occurred();
    }
    Py_DECREF(bits);
    PyObject *pack = ok ? PyObject_GetAttr(e, s_pack) : NULL;
    if (pack == NULL) {
        PyErr_Clear();
        return 0;
    }
    ok = PyTuple_Check(pack) && PyTuple_GET_SIZE(pack) <= MAX_PARAMS;
    f->npack = ok ? (int32_t)PyTuple_GET_SIZE(pack) : 0;
    for (int i = 0; ok && i < f->npack; i++) {
        PyObject *p = PyTuple_GET_ITEM(pack, i);
        if (!PyTuple_Check(p) || PyTuple_GET_SIZE(p) != 3) {
            ok = 0;
            break;
        }
        int64_t off = as_i64(PyTuple_GET_ITEM(p, 0), &bad), sz = as_i64(PyTuple_GET_ITEM(p, 1), &bad),
                src = as_i64(PyTuple_GET_ITEM(p, 2), &bad);
        int64_t bytes = sz & 0xff, f32 = (sz >> 8) & F32_PARAM;
        ok = !bad && off >= 0 && bytes >= 1 && bytes <= 8 && off + bytes <= f->nbytes && src >= 0 &&
             (src < CONST_BASE || src - CONST_BASE < f->nconst) && (!f32 || bytes == 4);
        f->pack[i] = (Pack){(int32_t)off, (int32_t)bytes, (int32_t)(f32 != 0), (int32_t)src};
    }
    Py_DECREF(pack);
    if (PyErr_Occurred())
        PyErr_Clear();
    f->packed = ok ? PyMem_Calloc(1, (size_t)f->nbytes + 1) : NULL;
    ok = ok && f->packed != NULL;
    f->nreg = 0;
    for (int i = 0; ok && i < f->npack; i++) { /* constants once; the registers' list */
        const Pack *p = &f->pack[i];
        if (p->src < CONST_BASE)
            f->reg[f->nreg++] = *p;
        else
            for (int j = 0; j < p->size; j++) /* little-endian, as the kernels read them */
                f->packed[p->offset + j] = (unsigned char)(f->const_bits[p->src - CONST_BASE] >> (8 * j));
    }
    if (ok && f->handle == NULL) { /* no loaded function: launches go through its Python launcher */
        f->consts = PyObject_GetAttr(e, s_consts);
        ok = f->consts != NULL && PyTuple_Check(f->consts) && PyTuple_GET_SIZE(f->consts) == f->nconst;
        if (!ok) {
            Py_CLEAR(f->consts);
            PyErr_Clear();
        }
    }
    return ok;
}

/* The form of (T, rest): one met before whose interval holds T, else bc.entry(T, rest), read
 * and kept. NULL with no exception: not taken; NULL with one: raised. */
static Form *form_of(PyObject *bc, State *st, int64_t T, const int64_t *rest, int nrest)
{
    for (int i = 0; i < FORMS_KEPT; i++) {
        Form *f = &st->forms[i];
        if (f->entry != NULL && f->t_lo <= T && T < f->t_hi &&
            memcmp(f->rest, rest, (size_t)nrest * sizeof(int64_t)) == 0)
            return f;
    }
    PyObject *key = PyTuple_New(nrest);
    if (key == NULL)
        return NULL;
    for (int i = 0; i < nrest; i++) {
        PyObject *v = PyLong_FromLongLong(rest[i]);
        if (v == NULL) {
            Py_DECREF(key);
            return NULL;
        }
        PyTuple_SET_ITEM(key, i, v);
    }
    PyObject *t = PyLong_FromLongLong(T);
    PyObject *e = t ? PyObject_CallMethodObjArgs(bc, s_entry, t, key, NULL) : NULL;
    Py_XDECREF(t);
    Py_DECREF(key);
    if (e == NULL)
        return NULL; /* as the Python executor: a form that cannot be resolved raises */
    Form *f = &st->forms[st->next_form];
    st->next_form = (st->next_form + 1) % FORMS_KEPT;
    Py_CLEAR(f->entry);
    Py_CLEAR(f->consts);
    PyMem_Free(f->packed);
    f->packed = NULL;
    int got = read_form(e, f);
    if (got <= 0) {
        Py_DECREF(e);
        return NULL;
    }
    memcpy(f->rest, rest, (size_t)nrest * sizeof(int64_t));
    f->entry = e;
    return f;
}

static PyObject *launch_error(PyObject *e, const char *what, int code)
{
    PyObject *launcher = PyObject_GetAttr(e, s_launcher);
    PyObject *expr = launcher ? PyObject_GetAttr(launcher, s_expr) : NULL;
    Py_XDECREF(launcher);
    PyErr_Clear();
    const char *name = NULL;
    if (cu.error_name == NULL || cu.error_name(code, &name) != 0)
        name = NULL;
    PyErr_Format(PyExc_RuntimeError, "zerokv: launching %S failed: %s %s (CUDA error %d)",
                 expr ? expr : Py_None, what, name ? name : "", code);
    Py_XDECREF(expr);
    return NULL;
}

/* A form without a loaded function (its launcher stands in for one: tests, tools): its
 * launcher's launch_values(grid, grid_y, bc.stream(device), values), as the Python executor
 * launches. 0 done, -1 an exception. */
static int launch_in_python(PyObject *bc, const State *st, Form *f, const int64_t *r, int64_t grid,
                            int64_t grid_y)
{
    PyObject *values = PyTuple_New(f->npack), *stream = NULL, *launcher = NULL, *got = NULL;
    if (values == NULL)
        return -1;
    for (int i = 0; i < f->npack; i++) {
        int src = f->pack[i].src;
        PyObject *v = src >= CONST_BASE ? Py_NewRef(PyTuple_GET_ITEM(f->consts, src - CONST_BASE))
                                        : PyLong_FromLongLong(r[src]);
        if (v == NULL)
            goto done;
        PyTuple_SET_ITEM(values, i, v);
    }
    PyObject *device = PyLong_FromLongLong(st->device);
    stream = device ? PyObject_CallMethodOneArg(bc, s_stream, device) : NULL;
    Py_XDECREF(device);
    launcher = stream ? PyObject_GetAttr(f->entry, s_launcher) : NULL;
    if (launcher != NULL)
        got = PyObject_CallMethod(launcher, "launch_values", "LLOO", (long long)grid, (long long)grid_y,
                                  stream, values);
done:
    Py_DECREF(values);
    Py_XDECREF(stream);
    Py_XDECREF(launcher);
    if (got == NULL)
        return -1;
    Py_DECREF(got);
    return 0;
}

/* Pack the form's parameters from the registers and launch (or record, or count). 0 done, -1
 * an exception. */
static int launch(PyObject *bc, const State *st, Form *f, int64_t *r, int64_t T)
{
    int64_t grid, grid_y;
    if (f->per_token) {
        __int128 work = (__int128)T * f->per_token;
        if (!fits(work + f->block))
            work = INT64_MAX - f->block;
        grid = work >= 0 ? floordiv((int64_t)work + f->block - 1, f->block) : -floordiv(-(int64_t)work, f->block);
        if (f->cap)
            grid = grid < f->cap ? grid : f->cap;
        else if (f->run_tail) {
            int64_t over = floordiv(grid - f->run_tail, f->run_spans);
            grid -= (over > 0 ? over : 0) * (f->run_spans - 1);
        }
        grid_y = 1;
    } else {
        grid = f->grid, grid_y = T;
    }
    unsigned char buf[MAX_PARAM_BYTES];
    memcpy(buf, f->packed, (size_t)f->nbytes);
    for (int i = 0; i < f->nreg; i++) {
        const Pack *p = &f->reg[i];
        uint64_t v;
        if (p->f32) {
            float x = (float)(double)r[p->src];
            uint32_t u;
            memcpy(&u, &x, 4);
            v = u;
        } else
            v = (uint64_t)r[p->src];
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
        if (p->size == 8)
            memcpy(buf + p->offset, &v, 8);
        else if (p->size == 4) {
            uint32_t u = (uint32_t)v;
            memcpy(buf + p->offset, &u, 4);
        } else
#endif
            for (int j = 0; j < p->size; j++) /* little-endian, as the kernels read them */
                buf[p->offset + j] = (unsigned char)(v >> (8 * j));
    }
    if (recorder != NULL || counting) {
        launch_count++;
        if (recorder == NULL)
            return 0;
        PyObject *e = f->entry;
        Py_INCREF(e);
        PyObject *got = PyObject_CallFunction(recorder, "OLLy#", e, (long long)grid, (long long)grid_y,
                                              (const char *)buf, (Py_ssize_t)f->nbytes);
        Py_DECREF(e);
        if (got == NULL)
            return -1;
        Py_DECREF(got);
        return 0;
    }
    if (f->handle == NULL) {
        PyObject *e = Py_NewRef(f->entry); /* the slot may be reused while Python code runs */
        PyObject *consts = Py_NewRef(f->consts);
        Form copy = *f;
        int rc = launch_in_python(bc, st, &copy, r, grid, grid_y);
        Py_DECREF(consts);
        Py_DECREF(e);
        return rc;
    }
    if (load_driver() < 0)
        return -1;
    void *stream = NULL;
    if (st->device >= 0 && st->api->current_work_stream(kDLCUDA, (int32_t)st->device, &stream) != 0)
        return -1;
    if (grid < 1 || grid > UINT32_MAX || grid_y < 1 || grid_y > 65535 || f->block > 1024) {
        launch_error(f->entry, "a grid out of range", 1);
        return -1;
    }
    size_t size = (size_t)f->nbytes;
    void *extra[] = {(void *)1 /* BUFFER_POINTER */, buf, (void *)2 /* BUFFER_SIZE */, &size,
                     (void *)0 /* END */};
    void *current = NULL, *popped;
    int pushed = 0, rc;
    if (f->context != NULL && (cu.get_current(&current) != 0 || current != f->context)) {
        if ((rc = cu.push(f->context)) != 0) {
            launch_error(f->entry, "making the device's context current", rc);
            return -1;
        }
        pushed = 1;
    }
    launch_count++;
    rc = cu.launch(f->handle, (unsigned)grid, (unsigned)grid_y, 1, (unsigned)f->block, 1, 1, 0, stream,
                   NULL, extra);
    if (pushed)
        cu.pop(&popped);
    if (rc != 0) {
        launch_error(f->entry, "cuLaunchKernel", rc);
        return -1;
    }
    return 0;
}

/* The table on one call: result, None (not taken) or NULL (raised). */
/* The next record, or the call's end: each handler jumps straight to the next record's (one
 * jump per handler, whose targets the branch predictor learns for a table's sequence). */
#define NEXT(status)                                                                                \
    do {                                                                                            \
        if ((got = (status)) <= 0)                                                                  \
            return got < 0 ? NULL : Py_NewRef(Py_None);                                             \
        rec = st->rec[++i]; /* a table ends with its key, which returns */                          \
        goto *handler[rec[0]];                                                                      \
    } while (0)

static PyObject *execute(PyObject *bc, State *st, Call *c)
{
    static void *const handler[] = {
        [OP_TENSOR] = &&tensor, [OP_ABSENT] = &&absent, [OP_SCALAR] = &&scalar, [OP_EQ] = &&eq,
        [OP_RANGE] = &&range, [OP_CHECK] = &&check, [OP_APART] = &&apart, [OP_ARITH] = &&arith,
        [OP_DONE_IF_ZERO] = &&done_if_zero, [OP_KEY] = &&key, [OP_DISTINCT] = &&distinct,
        [OP_ALLOC] = &&alloc,
    };
    int64_t r[CONST_BASE]; /* the records' registers (the constants are read from the form) */
    memset(r, 0, sizeof(r));
    r[R_ONE] = 1;
    int i = 0, got;
    const int64_t *rec = st->rec[0];
    goto *handler[rec[0]];

tensor:
    NEXT(read_tensor(st, rec, st->tensor_of[i], c, r));
absent:
    got = 1;
    for (int j = 0; j < 64 && j < c->nobjs; j++)
        if ((uint64_t)rec[1] >> j & 1 && c->objs[j] != Py_None)
            got = 0;
    NEXT(got);
eq:
    NEXT(r[rec[1]] == r[rec[2]]);
range:
    NEXT(rec[2] <= r[rec[1]] && r[rec[1]] < rec[3]);
check:
    NEXT((r[rec[1]] != 0) == (rec[2] != 0));
arith:
    NEXT(arith(rec, r));
apart:
    NEXT(apart(r, rec[1], rec[2], rec[3]));
distinct: {
    int a = TENSOR_BASE + (int)rec[1] * TENSOR_REGS;
    int64_t inner = rec[2] >= 0 ? r[a + 1 + rec[2]] : 1;
    NEXT(distinct(r[a + 1], r[a + T_STRIDE], r[a + 2], r[a + T_STRIDE + 1], inner));
}
scalar: {
    if (rec[1] >= c->nscalars)
        return Py_NewRef(Py_None);
    long long x = 0;
    got = int_value(c->scalars[rec[1]], &x) && r[rec[3]] <= x && x <= r[rec[4]];
    if (got)
        r[rec[2]] = x;
    NEXT(got);
}
alloc:
    NEXT(allocate(bc, st, rec, c, r));
done_if_zero:
    if (r[rec[1]] == 0)
        return result_of(st, c);
    NEXT(1);
key: {
    int64_t rest[MAX_KEY];
    for (int j = 0; j < rec[2]; j++)
        rest[j] = r[rec[3 + j]];
    int64_t T = r[rec[1]];
    Form *f = form_of(bc, st, T, rest, (int)rec[2]);
    if (f == NULL)
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    for (int j = 0; j < st->nresult; j++) /* check the result can be made before launching */
        if (made_at(c, st->result[j]) == NULL && st->result[j] >= c->nobjs)
            return Py_NewRef(Py_None);
    if (launch(bc, st, f, r, T) < 0)
        return NULL;
    return result_of(st, c);
}
}
#undef NEXT
