/* Part of launcher.c, compiled as its one translation unit: outputs the call allocates, and the
 * call's result. */

/* An allocator whose `direct` attribute is (empty, dtype, device): empty(*shape, dtype=dtype,
 * device=device) called here, its pointer read through the exchange API (no Python frame, no
 * shape tuple, no data_ptr() call). 1 made (*x owned, *p), 0 no such allocator, -1 an exception
 * (empty raised: not taken, or raised, as from the allocator itself). */
static PyObject *dtype_device; /* ("dtype", "device"): empty's keyword names */

static int allocate_direct(const State *st, PyObject *fn, int rank, const int64_t *rec, const int64_t *r,
                           PyObject **x, int64_t *p)
{
    PyObject *direct = PyObject_GetAttr(fn, s_direct);
    if (direct == NULL) {
        PyErr_Clear();
        return 0;
    }
    if (!PyTuple_CheckExact(direct) || PyTuple_GET_SIZE(direct) != 3 || rank > 4) {
        Py_DECREF(direct);
        return 0;
    }
    PyObject *argv[6];
    int n = 0;
    for (; n < rank; n++)
        if ((argv[n] = PyLong_FromLongLong(r[rec[5 + n]])) == NULL)
            break;
    PyObject *made = NULL;
    if (n == rank) {
        argv[rank] = PyTuple_GET_ITEM(direct, 1), argv[rank + 1] = PyTuple_GET_ITEM(direct, 2);
        made = PyObject_Vectorcall(PyTuple_GET_ITEM(direct, 0), argv, (size_t)rank, dtype_device);
    }
    for (int i = 0; i < n; i++)
        Py_DECREF(argv[i]);
    Py_DECREF(direct);
    if (made == NULL)
        return -1;
    DLTensor t;
    if (Py_TYPE(made) != st->type || st->api->dltensor_from_py_object_no_sync(made, &t) != 0) {
        Py_DECREF(made); /* not the signature's tensor type: the full path sees the call */
        PyErr_SetString(PyExc_TypeError, "zerokv: an allocated output of another type");
        return -1;
    }
    *x = made;
    *p = (int64_t)((uintptr_t)t.data + t.byte_offset);
    return 1;
}

static int keep_made(const int64_t *rec, Call *c, int64_t *r, int base, int rank, PyObject *x, int64_t p);

/* OP_ALLOC: a new output from bc.allocators[rec[2]](shape, objs[0]) -> (tensor, pointer).
 * 1 done, 0 not taken, -1 an exception. */
static int allocate(PyObject *bc, const State *st, const int64_t *rec, Call *c, int64_t *r)
{
    if (c->nobjs < 1)
        return 0;
    int rank = (int)rec[4], base = TENSOR_BASE + (int)rec[3] * TENSOR_REGS;
    PyObject *allocators = PyObject_GetAttr(bc, s_allocators);
    if (allocators == NULL)
        return not_taken_or_raise();
    PyObject *fn = PySequence_GetItem(allocators, rec[2]);
    Py_DECREF(allocators);
    if (fn == NULL)
        return not_taken_or_raise();
    PyObject *x = NULL;
    int64_t p = 0;
    int direct = allocate_direct(st, fn, rank, rec, r, &x, &p);
    if (direct < 0) {
        Py_DECREF(fn);
        return not_taken_or_raise();
    }
    if (direct > 0) {
        Py_DECREF(fn);
        return keep_made(rec, c, r, base, rank, x, p);
    }
    PyObject *shape = PyTuple_New(rank);
    if (shape == NULL) {
        Py_DECREF(fn);
        return -1;
    }
    for (int i = 0; i < rank; i++) {
        PyObject *v = PyLong_FromLongLong(r[rec[5 + i]]);
        if (v == NULL) {
            Py_DECREF(fn);
            Py_DECREF(shape);
            return -1;
        }
        PyTuple_SET_ITEM(shape, i, v);
    }
    PyObject *args[2] = {shape, c->objs[0]};
    PyObject *got = PyObject_Vectorcall(fn, args, 2, NULL);
    Py_DECREF(fn);
    Py_DECREF(shape);
    if (got == NULL)
        return not_taken_or_raise();
    int bad = !PyTuple_Check(got) || PyTuple_GET_SIZE(got) != 2;
    p = bad ? 0 : as_i64(PyTuple_GET_ITEM(got, 1), &bad);
    if (bad) {
        Py_DECREF(got);
        return 0;
    }
    x = PyTuple_GET_ITEM(got, 0);
    Py_INCREF(x);
    Py_DECREF(got);
    return keep_made(rec, c, r, base, rank, x, p);
}

/* A new output x (owned, given to the call) at pointer p, contiguous, of the record's shape,
 * into tensor block `base`. 1 done, 0 not taken. */
static int keep_made(const int64_t *rec, Call *c, int64_t *r, int base, int rank, PyObject *x, int64_t p)
{
    if (!c->any_made) {
        memset(c->made, 0, sizeof(c->made));
        c->any_made = 1;
    }
    Py_XSETREF(c->made[rec[1]], x);
    r[base + T_PTR] = p;
    __int128 stride = 1;
    for (int i = rank - 1; i >= 0; i--) {
        int64_t n = r[rec[5 + i]];
        if (!fits(stride))
            return 0;
        r[base + T_SIZE + i] = n;
        r[base + T_STRIDE + i] = (int64_t)stride;
        stride *= n;
    }
    return 1;
}

/* The call's result: bc.result's objects, an allocated output in its slot's place. */
static PyObject *result_of(const State *st, Call *c)
{
    if (st->nresult == 0)
        Py_RETURN_TRUE;
    for (int i = 0; i < st->nresult; i++)
        if (made_at(c, st->result[i]) == NULL && st->result[i] >= c->nobjs)
            Py_RETURN_NONE; /* a result slot the call did not pass: the full path names it */
    PyObject *t = PyTuple_New(st->nresult);
    if (t == NULL)
        return NULL;
    for (int i = 0; i < st->nresult; i++) {
        int s = st->result[i];
        PyObject *v = made_at(c, s) != NULL ? c->made[s] : c->objs[s];
        Py_INCREF(v);
        PyTuple_SET_ITEM(t, i, v);
    }
    return t;
}
