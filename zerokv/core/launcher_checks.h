/* Part of launcher.c, compiled as its one translation unit: one call's reads and checks: tensors,
 * outputs' writability, overlaps, arithmetic. */

/* ---- the call ------------------------------------------------------------------------------- */

typedef struct {
    PyObject *const *objs, *const *scalars; /* the call's arguments (borrowed from the caller) */
    Py_ssize_t nobjs, nscalars;
    int any_made;
    int inference_mode; /* torch.is_inference_mode_enabled(), once asked (-1: not yet) */
    PyObject *made[MAX_SLOTS]; /* allocated outputs (owned), zeroed at the first */
} Call;

static PyObject *made_at(const Call *c, int slot) { return c->any_made ? c->made[slot] : NULL; }

/* An exception raised by Python code the table called: the ones that mean "not taken" are
 * cleared (0), any other stays set (-1). */
static int not_taken_or_raise(void)
{
    if (PyErr_ExceptionMatches(unreadable)) {
        PyErr_Clear();
        return 0;
    }
    return -1;
}

/* x mod m for x >= 0, m >= 1 (alignments are powers of two: no division). */
static uint64_t mod_pos(uint64_t x, uint64_t m) { return (m & (m - 1)) == 0 ? x & (m - 1) : x % m; }

/* Python's floor division (the grid's arithmetic), for b > 0. */
static int64_t floordiv(int64_t a, int64_t b)
{
    if (a >= 0 && (b & (b - 1)) == 0) /* blocks are powers of two */
        return (int64_t)((uint64_t)a >> __builtin_ctzll((uint64_t)b));
    int64_t q = a / b;
    return (a % b != 0 && a < 0) ? q - 1 : q;
}

static int fits(__int128 v) { return v >= INT64_MIN && v <= INT64_MAX; }

/* A flag of tensor x through its type's descriptor (no attribute lookup): the requires_grad
 * getter, or the is_inference method; by name when the type has no such descriptor. 1, 0, or -1
 * with an exception. */
static int flag_of(PyObject *x, PyObject *descr, PyObject *name, int method)
{
    PyObject *v;
    if (descr == NULL)
        v = method ? PyObject_CallMethodNoArgs(x, name) : PyObject_GetAttr(x, name);
    else if (method)
        v = ((PyMethodDescrObject *)descr)->d_method->ml_flags == METH_NOARGS
                ? ((PyMethodDescrObject *)descr)->d_method->ml_meth(x, NULL)
                : PyObject_Vectorcall(descr, &x, 1, NULL);
    else
        v = ((PyGetSetDescrObject *)descr)->d_getset->get(x, ((PyGetSetDescrObject *)descr)->d_getset->closure);
    if (v == NULL)
        return -1;
    int flag = v == Py_True ? 1 : v == Py_False ? 0 : PyObject_IsTrue(v);
    Py_DECREF(v);
    return flag;
}

/* torch.is_inference_mode_enabled(), asked once per call (*mode: -1 until asked); the state
 * remembers the answer so that the next call asks it first (an engine's steps all run in
 * inference mode, where an output's is_inference need not be asked). 1, 0, or -1. */
static int inference_mode_of(State *st, int *mode)
{
    if (*mode < 0) {
        PyObject *v = PyObject_CallNoArgs(inference_mode);
        if (v == NULL)
            return -1;
        *mode = PyObject_IsTrue(v);
        Py_DECREF(v);
        if (*mode >= 0)
            st->mode_first = *mode;
    }
    return *mode;
}

/* Whether tensor x has a version counter (its _version getter through its descriptor): an
 * inference tensor has none and raises, so a tensor that has one is no inference tensor, known
 * without is_inference() (which releases and takes back the GIL). 0: not known (ask it). */
static int counts_versions(PyObject *x, PyObject *descr)
{
    PyGetSetDef *g = ((PyGetSetDescrObject *)descr)->d_getset;
    PyObject *v = g->get(x, g->closure);
    if (v == NULL) {
        PyErr_Clear();
        return 0;
    }
    Py_DECREF(v);
    return 1;
}

/* Whether an output may be written, as the Python executor decides (pyexec._writable): a tensor
 * that needs no grad and is no inference tensor, or one that generic_tensors.writable_cheap lets
 * through (for torch's tensor type, decided here the same way: it needs no grad, and is no
 * inference tensor unless inference mode is on). 1, 0, -1 with an exception, or -2: ask
 * writable_cheap. */
static int writable(State *st, PyObject *x, int *mode)
{
    int rg = flag_of(x, st->requires_grad, s_requires_grad, 0);
    if (rg != 0)
        return rg < 0 ? -1 : st->torch_rule ? 0 : -2;
    if (st->torch_rule && st->mode_first) {
        int m = inference_mode_of(st, mode);
        if (m != 0)
            return m;
    }
    if (st->version != NULL && counts_versions(x, st->version))
        return 1;
    int inf = flag_of(x, st->is_inference, s_is_inference, 1);
    if (inf <= 0)
        return inf < 0 ? -1 : 1;
    if (!st->torch_rule)
        return -2;
    return inference_mode_of(st, mode);
}

/* writable(), with writable_cheap asked where it must decide. */
static int output_ok(State *st, PyObject *x, int *mode)
{
    int w = writable(st, x, mode);
    if (w != -2)
        return w;
    if (writable_cheap == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "zerokv: the compiled executor was loaded without bind()");
        return -1;
    }
    PyObject *v = PyObject_CallOneArg(writable_cheap, x);
    if (v == NULL)
        return -1;
    w = PyObject_IsTrue(v);
    Py_DECREF(v);
    return w;
}

static PyObject *numpy_integer; /* numpy.integer, once a scalar argument is not a Python int */

/* A scalar argument as the full validation takes it: a Python int (not a bool) or a numpy
 * integer (a scheduler's count). 1 with its value in *x; 0: neither, or past 64 bits. */
static int int_value(PyObject *v, long long *x)
{
    int overflow = 0;
    if (PyLong_CheckExact(v)) {
        *x = PyLong_AsLongLongAndOverflow(v, &overflow);
        return !overflow;
    }
    if (numpy_integer == NULL) {
        PyObject *np = PyImport_ImportModule("numpy");
        numpy_integer = np ? PyObject_GetAttrString(np, "integer") : NULL;
        Py_XDECREF(np);
    }
    if (numpy_integer == NULL || !PyType_Check(numpy_integer) ||
        !PyObject_TypeCheck(v, (PyTypeObject *)numpy_integer)) {
        PyErr_Clear();
        return 0;
    }
    PyObject *i = PyNumber_Index(v);
    if (i == NULL) {
        PyErr_Clear();
        return 0;
    }
    *x = PyLong_AsLongLongAndOverflow(i, &overflow);
    Py_DECREF(i);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    return !overflow;
}

/* OP_TENSOR: 1 read, 0 not taken, -1 an exception. */
static int read_tensor(State *st, const int64_t *rec, int k, Call *c, int64_t *r)
{
    int64_t slot = rec[1], rank = rec[2], flags = rec[3];
    if (slot >= c->nobjs)
        return 0;
    PyObject *x = c->objs[slot];
    if (Py_TYPE(x) != st->type && (st->also == NULL || !PyType_IsSubtype(Py_TYPE(x), st->also)))
        return 0;
    DLTensor t;
    if (st->api->dltensor_from_py_object_no_sync(x, &t) != 0) {
        PyErr_Clear(); /* a tensor DLPack cannot describe (sparse, meta, ...) */
        return 0;
    }
    int64_t dev = (t.device.device_type == kDLCUDA || t.device.device_type == kDLROCM) ? t.device.device_id
                  : (t.device.device_type == kDLCPU || t.device.device_type == kDLCUDAHost) ? -1
                                                                                            : INT64_MIN;
    int64_t code = t.dtype.code | (int64_t)t.dtype.bits << 8 | (int64_t)t.dtype.lanes << 16;
    if (code != rec[4] || dev != st->device || t.ndim != rank)
        return 0;
    int64_t n[4], s[4];
    for (int i = 0; i < rank; i++) {
        int j = (flags & F_TRANSPOSE) ? (int)rank - 1 - i : i;
        n[i] = t.shape[j];
    }
    if (t.strides != NULL) {
        for (int i = 0; i < rank; i++)
            s[i] = t.strides[(flags & F_TRANSPOSE) ? rank - 1 - i : i];
    } else {
        int64_t acc = 1, rs[4];
        for (int i = (int)rank - 1; i >= 0; i--) {
            rs[i] = acc;
            acc *= t.shape[i] > 0 ? t.shape[i] : 1;
        }
        for (int i = 0; i < rank; i++)
            s[i] = rs[(flags & F_TRANSPOSE) ? rank - 1 - i : i];
    }
    for (int i = 0; i < rank; i++)
        if (rec[8 + i] >= 0 && r[rec[8 + i]] != n[i])
            return 0;
    int64_t sor = 0, outer = 0, last = rank - 1;
    for (int i = 0; i < rank; i++)
        sor |= s[i];
    for (int i = 0; i < last; i++)
        outer |= s[i];
    if (sor < 0 || ((flags & F_UNIT_INNER) && n[last] > 1 && s[last] != 1))
        return 0;
    int64_t p = (int64_t)((uintptr_t)t.data + t.byte_offset);
    int base = TENSOR_BASE + k * TENSOR_REGS;
    r[base + T_PTR] = p;
    int empty = 0;
    __int128 span = 1;
    for (int i = 0; i < rank; i++) {
        r[base + T_SIZE + i] = n[i];
        r[base + T_STRIDE + i] = s[i];
        span += (__int128)(n[i] - 1) * s[i];
        empty |= n[i] == 0;
    }
    if (empty)
        span = 0; /* no element, no byte */
    __int128 end = (__int128)p + span * rec[6];
    if (!fits(span) || !fits(end))
        return 0; /* beyond any memory: the full validation sees it */
    r[R_STOR] |= sor;
    r[base + T_END] = (int64_t)end;
    if (span > r[R_WIDEST])
        r[R_WIDEST] = (int64_t)span;
    if (flags & F_ALIGN) {
        int64_t o = outer | ((flags & F_INNER_IN_ALIGN) ? n[last] : 0);
        r[R_MISALIGN] |= (int64_t)(mod_pos((uint64_t)p, (uint64_t)rec[7]) | mod_pos((uint64_t)o, (uint64_t)rec[12]));
    }
    if (flags & F_OUTPUT) {
        int w = output_ok(st, x, &c->inference_mode);
        if (w < 0)
            return not_taken_or_raise() < 0 ? -1 : 0;
        if (w == 0)
            return 0;
    }
    return 1;
}

/* Tensor a shares no byte with a tensor of mask, or is an exact alias of one in exact. */
static int apart(const int64_t *r, int64_t k, int64_t mask, int64_t exact)
{
    int a = TENSOR_BASE + (int)k * TENSOR_REGS;
    int64_t lo = r[a], hi = r[a + T_END];
    for (int j = 0; j < N_TENSORS; j++) {
        if (!(mask >> j & 1))
            continue;
        int b = TENSOR_BASE + j * TENSOR_REGS;
        if (r[b] < hi && lo < r[b + T_END] &&
            !((exact >> j & 1) && r[b] == lo && r[b + T_STRIDE] == r[a + T_STRIDE] &&
              r[b + T_STRIDE + 1] == r[a + T_STRIDE + 1]))
            return 0;
    }
    return 1;
}

/* layout.distinct: a [n0, n1, inner] layout whose rows sit one after another. */
static int distinct(int64_t n0, int64_t s0, int64_t n1, int64_t s1, int64_t inner)
{
    __int128 l0 = (__int128)(n1 - 1) * s1 + inner, l1 = (__int128)(n0 - 1) * s0 + inner;
    return ((n1 <= 1 || s1 >= inner) && (n0 <= 1 || s0 >= l0)) ||
           ((n0 <= 1 || s0 >= inner) && (n1 <= 1 || s1 >= l1));
}

/* OP_ARITH: 1 done, 0 a value beyond 64 bits (not taken). */
static int arith(const int64_t *rec, int64_t *r)
{
    int64_t x = r[rec[3]], y = rec[4] >= 0 ? r[rec[4]] : rec[5];
    __int128 v;
    switch (rec[2]) {
    case A_ADD: v = (__int128)x + y; break;
    case A_SUB: v = (__int128)x - y; break;
    case A_MUL: v = (__int128)x * y; break;
    case A_OR: v = x | y; break;
    case A_AND: v = x & y; break;
    case A_EQ: v = x == y; break;
    case A_LT: v = x < y; break;
    case A_NE: v = x != y; break;
    case A_MAX: v = x > y ? x : y; break;
    default: v = x > y; break; /* A_GT (record_ok admits no other) */
    }
    if (!fits(v))
        return 0;
    r[rec[1]] = (int64_t)v;
    return 1;
}
