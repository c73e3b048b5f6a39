/* Part of launcher.c, compiled as its one translation unit: the module's state and a bound call's
 * decoded records. */

/* ---- module state: where launches go, Python helpers ---------------------------------------- */

static PyObject *recorder;         /* fn(entry, grid, grid_y, params) or NULL */
static int counting;               /* launches counted, never made (set_recorder(None, False)) */
static long long launch_count;     /* launches since the last set_recorder */
static PyObject *writable_cheap;   /* generic_tensors.writable_cheap (bind()) */
static PyObject *torch_type_of;   /* tensors.torch_tensor_type (bind()): torch's tensor type */
static PyObject *inference_mode;   /* torch.is_inference_mode_enabled, once a signature needs it */
static PyObject *parameter_type;   /* torch.nn.Parameter: its subclasses read as torch's tensor type is */
static PyObject *unreadable;       /* the exceptions that make a call "not taken" */
static PyObject *s_requires_grad, *s_is_inference, *s_version, *s_c_state, *s_table, *s_torch_type,
    *s_device, *s_result, *s_allocators, *s_entry, *s_launcher, *s_expr;
static PyObject *s_consts, *s_stream, *s_direct;
static PyObject *s_handle, *s_context, *s_block, *s_grid, *s_per_token, *s_run_tail,
    *s_run_spans, *s_cap, *s_pack, *s_const_bits, *s_nbytes, *s_t_lo, *s_t_hi;

static const char STATE_CAPSULE[] = "zerokv.bound_call_state"; /* compared by address */

/* ---- a bound call's state: its records decoded once, and the forms met so far ------------- */

typedef struct {
    int32_t offset, size, f32, src;
} Pack;

typedef struct {
    PyObject *entry;  /* the Python Entry (owned); NULL: the slot is free */
    PyObject *consts; /* its constants as Python values (owned): a launch through its launcher */
    int64_t t_lo, t_hi;
    int64_t rest[MAX_KEY];
    void *handle, *context;
    int64_t block, grid, per_token, run_tail, run_spans, cap;
    int32_t npack, nbytes, nreg;
    Pack pack[MAX_PARAMS];         /* every parameter, in the kernel's order */
    Pack reg[MAX_PARAMS];          /* those read from registers at each launch */
    unsigned char *packed;         /* the parameter buffer with the constants written (owned) */
    uint64_t const_bits[NREG - CONST_BASE];
    int32_t nconst;
} Form;

typedef struct {
    int nrec;
    int64_t (*rec)[RECORD];
    int8_t tensor_of[MAX_RECORDS]; /* a TENSOR record's block */
    PyTypeObject *type;            /* the signature's tensor type (owned) */
    const DLPackExchangeAPI *api;
    PyObject *requires_grad, *is_inference, *version; /* its descriptors (owned), or NULL */
    int torch_rule;                /* torch's tensor type: writability decided here */
    PyTypeObject *also;            /* with torch's type: torch.nn.Parameter, its subclasses read as it (borrowed) */
    int mode_first;                /* the last call found inference mode on: ask it first */
    int64_t device;
    int nresult;
    int result[MAX_SLOTS];
    int next_form;
    Form forms[FORMS_KEPT];
} State;

static void state_release(State *st)
{
    for (int i = 0; i < FORMS_KEPT; i++)
        Py_XDECREF(st->forms[i].entry), Py_XDECREF(st->forms[i].consts), PyMem_Free(st->forms[i].packed);
    Py_XDECREF(st->type);
    Py_XDECREF(st->requires_grad);
    Py_XDECREF(st->is_inference);
    Py_XDECREF(st->version);
    PyMem_Free(st->rec);
    PyMem_Free(st);
}

static void state_free(PyObject *capsule)
{
    State *st = (State *)PyCapsule_GetPointer(capsule, STATE_CAPSULE);
    if (st == NULL)
        PyErr_Clear();
    else
        state_release(st);
}

/* A register a record may name: the constants' registers are written at launch only. */
static int reg_ok(int64_t i) { return i >= 0 && i < CONST_BASE; }

/* A record the executor can run without reading outside its registers, tensor blocks or slots;
 * anything else makes the whole table one this executor never takes. */
static int record_ok(const int64_t *r, int *k)
{
    switch (r[0]) {
    case OP_TENSOR:
        if (*k >= N_TENSORS || r[1] < 0 || r[1] >= MAX_SLOTS || r[2] < 1 || r[2] > 4 || r[6] < 1 ||
            r[7] < 1 || r[12] < 1)
            return 0;
        for (int i = 0; i < r[2]; i++)
            if (r[8 + i] >= CONST_BASE)
                return 0;
        (*k)++;
        return 1;
    case OP_ABSENT:
        return 1;
    case OP_SCALAR:
        return r[1] >= 0 && r[1] < MAX_SLOTS && reg_ok(r[2]) && reg_ok(r[3]) && reg_ok(r[4]);
    case OP_EQ:
        return reg_ok(r[1]) && reg_ok(r[2]);
    case OP_RANGE:
    case OP_CHECK:
    case OP_DONE_IF_ZERO:
        return reg_ok(r[1]);
    case OP_APART:
        return r[1] >= 0 && r[1] < N_TENSORS;
    case OP_ARITH:
        return reg_ok(r[1]) && r[2] >= 0 && r[2] < A_COUNT && reg_ok(r[3]) && r[4] < CONST_BASE;
    case OP_DISTINCT:
        return r[1] >= 0 && r[1] < N_TENSORS && r[2] < 4;
    case OP_ALLOC:
        if (r[1] < 0 || r[1] >= MAX_SLOTS || r[2] < 0 || r[3] < 0 || r[3] >= N_TENSORS || r[4] < 1 ||
            r[4] > 4)
            return 0;
        for (int i = 0; i < r[4]; i++)
            if (!reg_ok(r[5 + i]))
                return 0;
        return 1;
    case OP_KEY:
        if (!reg_ok(r[1]) || r[2] < 0 || r[2] > MAX_KEY)
            return 0;
        for (int i = 0; i < r[2]; i++)
            if (!reg_ok(r[3 + i]))
                return 0;
        return 1;
    default:
        return 0;
    }
}

/* What the executor reads of a tensor type, once per type: its exchange API (its
 * __dlpack_c_exchange_api__ capsule; NULL: none this executor can use) and the descriptors of
 * requires_grad and is_inference, called without an attribute lookup (NULL: looked up by name). */
typedef struct {
    PyTypeObject *type;
    const DLPackExchangeAPI *api;
    PyObject *requires_grad, *is_inference, *version;
} TypeInfo;

static const TypeInfo *type_info(PyTypeObject *type)
{
    static TypeInfo seen[8];
    for (int i = 0; i < 8; i++)
        if (seen[i].type == type)
            return &seen[i];
    TypeInfo t = {type, NULL, NULL, NULL, NULL};
    PyObject *capsule = PyObject_GetAttrString((PyObject *)type, "__dlpack_c_exchange_api__");
    if (capsule != NULL && PyCapsule_IsValid(capsule, "dlpack_exchange_api"))
        t.api = (const DLPackExchangeAPI *)PyCapsule_GetPointer(capsule, "dlpack_exchange_api");
    Py_XDECREF(capsule);
    PyErr_Clear();
    if (t.api != NULL && (t.api->header.version.major != 1 || t.api->dltensor_from_py_object_no_sync == NULL ||
                          t.api->current_work_stream == NULL))
        t.api = NULL;
    PyObject *d = _PyType_Lookup(type, s_requires_grad); /* borrowed */
    if (d != NULL && Py_IS_TYPE(d, &PyGetSetDescr_Type))
        t.requires_grad = Py_NewRef(d);
    d = _PyType_Lookup(type, s_is_inference);
    if (d != NULL && Py_IS_TYPE(d, &PyMethodDescr_Type))
        t.is_inference = Py_NewRef(d);
    d = _PyType_Lookup(type, s_version);
    if (d != NULL && Py_IS_TYPE(d, &PyGetSetDescr_Type))
        t.version = Py_NewRef(d);
    for (int i = 0; i < 8; i++)
        if (seen[i].type == NULL) {
            Py_INCREF(type); /* a tensor type lives as long as the process */
            seen[i] = t;
            return &seen[i];
        }
    Py_XDECREF(t.requires_grad); /* more types than kept: looked up again next time */
    Py_XDECREF(t.is_inference);
    Py_XDECREF(t.version);
    static TypeInfo spare;
    spare = (TypeInfo){type, t.api, NULL, NULL, NULL};
    return &spare;
}

static int64_t as_i64(PyObject *v, int *bad)
{
    int overflow = 0;
    long long x = PyLong_Check(v) ? PyLong_AsLongLongAndOverflow(v, &overflow) : (*bad = 1, 0);
    if (overflow || (x == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        *bad = 1;
    }
    return x;
}

/* bc's slot at `offset` when bc is a BoundCall (its __slots__ read in place), else NULL. */
static PyTypeObject *bc_type;  /* bound.BoundCall (bind_entries()) */
static Py_ssize_t off_c_state = -1, off_c_ok = -1;

static PyObject *slot_of(PyObject *bc, Py_ssize_t offset)
{
    return offset >= 0 && Py_TYPE(bc) == bc_type ? *(PyObject **)((char *)bc + offset) : NULL;
}

/* bc's state, decoded on its first run; NULL with no exception: bc is not a table this executor
 * runs; NULL with an exception: a real failure (memory). Returns a new reference. */
static PyObject *state_of(PyObject *bc)
{
    PyObject *cached = slot_of(bc, off_c_state);
    if (cached != NULL && PyCapsule_CheckExact(cached) && PyCapsule_GetName(cached) == STATE_CAPSULE)
        return Py_NewRef(cached);
    cached = PyObject_GetAttr(bc, s_c_state);
    if (cached == NULL) {
        PyErr_Clear();
        return NULL;
    }
    if (PyCapsule_CheckExact(cached) && PyCapsule_IsValid(cached, STATE_CAPSULE))
        return cached;
    Py_DECREF(cached);

    PyObject *table = NULL, *type = NULL, *device = NULL, *result = NULL, *capsule = NULL;
    State *st = NULL;
    table = PyObject_GetAttr(bc, s_table);
    type = table ? PyObject_GetAttr(bc, s_torch_type) : NULL;
    device = type ? PyObject_GetAttr(bc, s_device) : NULL;
    result = device ? PyObject_GetAttr(bc, s_result) : NULL;
    if (result == NULL || !PyBytes_Check(table) || !PyType_Check(type) || !PyTuple_Check(result))
        goto not_runnable;
    Py_ssize_t nbytes = PyBytes_GET_SIZE(table);
    Py_ssize_t nrec = nbytes / (RECORD * 8);
    if (nbytes % (RECORD * 8) || nrec < 1 || nrec > MAX_RECORDS || PyTuple_GET_SIZE(result) > MAX_SLOTS)
        goto not_runnable;
    const TypeInfo *info = type_info((PyTypeObject *)type);
    if (info->api == NULL)
        goto not_runnable;
    st = (State *)PyMem_Calloc(1, sizeof(State));
    if (st == NULL)
        goto fail;
    st->rec = PyMem_Calloc((size_t)nrec, sizeof(*st->rec));
    if (st->rec == NULL)
        goto fail;
    const unsigned char *b = (const unsigned char *)PyBytes_AS_STRING(table);
    for (Py_ssize_t i = 0; i < nrec * RECORD; i++) { /* little-endian int64s, on any host */
        uint64_t v = 0;
        for (int j = 7; j >= 0; j--)
            v = v << 8 | b[i * 8 + j];
        st->rec[i / RECORD][i % RECORD] = (int64_t)v;
    }
    st->nrec = (int)nrec;
    int k = 0;
    for (int i = 0; i < st->nrec; i++) {
        st->tensor_of[i] = (int8_t)k;
        if (!record_ok(st->rec[i], &k) || (st->rec[i][0] == OP_KEY) != (i == st->nrec - 1))
            goto not_runnable; /* the table ends with its key, and only there */
    }
    int bad = 0;
    st->device = as_i64(device, &bad);
    st->nresult = (int)PyTuple_GET_SIZE(result);
    for (int i = 0; i < st->nresult; i++) {
        int64_t s = as_i64(PyTuple_GET_ITEM(result, i), &bad);
        if (s < 0 || s >= MAX_SLOTS)
            bad = 1;
        st->result[i] = (int)s;
    }
    if (bad)
        goto not_runnable;
    st->api = info->api;
    st->requires_grad = Py_XNewRef(info->requires_grad);
    st->is_inference = Py_XNewRef(info->is_inference);
    st->version = Py_XNewRef(info->version);
    st->type = (PyTypeObject *)type;
    type = NULL;
    if (torch_type_of != NULL) { /* torch's own tensors: their writability rule is made here */
        PyObject *tt = PyObject_CallNoArgs(torch_type_of);
        if (tt == (PyObject *)st->type && inference_mode == NULL) {
            PyObject *torch = PyImport_ImportModule("torch");
            inference_mode = torch ? PyObject_GetAttrString(torch, "is_inference_mode_enabled") : NULL;
            PyObject *nn = torch ? PyObject_GetAttrString(torch, "nn") : NULL;
            PyObject *param = nn ? PyObject_GetAttrString(nn, "Parameter") : NULL;
            if (param != NULL && PyType_Check(param) && PyType_IsSubtype((PyTypeObject *)param, st->type))
                parameter_type = Py_NewRef(param); /* kept for the process, as torch's type */
            Py_XDECREF(param);
            Py_XDECREF(nn);
            Py_XDECREF(torch);
        }
        st->torch_rule = tt == (PyObject *)st->type && inference_mode != NULL;
        st->also = st->torch_rule ? (PyTypeObject *)parameter_type : NULL;
        Py_XDECREF(tt);
        PyErr_Clear();
    }
    capsule = PyCapsule_New(st, STATE_CAPSULE, state_free);
    if (capsule == NULL || PyCapsule_SetContext(capsule, st) < 0) /* read back without a name check */
        goto fail;
    st = NULL;
    if (PyObject_SetAttr(bc, s_c_state, capsule) < 0)
        PyErr_Clear(); /* runs uncached */
    Py_DECREF(table);
    Py_DECREF(device);
    Py_DECREF(result);
    return capsule;

not_runnable:
    PyErr_Clear();
fail:
    if (st != NULL)
        state_release(st);
    Py_XDECREF(table);
    Py_XDECREF(type);
    Py_XDECREF(device);
    Py_XDECREF(result);
    return NULL;
}
