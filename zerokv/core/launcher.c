/*
 * The compiled executor of zerokv's bound calls (zerokv/core/bound.py holds the format and
 * zerokv/core/pyexec.py the Python executor; both run a call the same way).
 *
 * run(bc, objs, scalars) executes the records of bc.table on one call's arguments: torch
 * tensors are read through DLPack's C exchange API of their type (a DLTensor view, no Python
 * object made), each check of the table made on 64-bit registers; a call the table takes is
 * launched with cuLaunchKernel on torch's current stream and its result returned, a call it does
 * not take returns None (the caller's full validation then raises or builds a new signature).
 *
 * No CUDA or torch header is needed: the DLPack structures and the driver's prototypes are
 * declared here, and the driver is found in the process (libcuda.so.1) at the first launch.
 * Built at first use by zerokv/core/cexec.py with the host C compiler.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <structmember.h>

#include <dlfcn.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>

/* ---- the record format (zerokv/core/bound.py; cexec checks the two agree at load) ------------ */

enum {
    RECORD = 16,
    NREG = 192,
    N_TENSORS = 12,
    R_ZERO = 0,
    R_ONE = 1,
    R_WIDEST = 2,
    R_STOR = 3,
    R_MISALIGN = 4,
    TENSOR_BASE = 8,
    TENSOR_REGS = 10,
    CONST_BASE = 160,
    T_PTR = 0,
    T_SIZE = 1,
    T_STRIDE = 5,
    T_END = 9,
};

enum {
    OP_TENSOR = 1,
    OP_ABSENT = 2,
    OP_SCALAR = 3,
    OP_EQ = 4,
    OP_RANGE = 5,
    OP_CHECK = 6,
    OP_APART = 7,
    OP_ARITH = 8,
    OP_DONE_IF_ZERO = 9,
    OP_KEY = 10,
    OP_DISTINCT = 11,
    OP_ALLOC = 12,
};

enum { F_TRANSPOSE = 1, F_OUTPUT = 2, F_UNIT_INNER = 4, F_ALIGN = 8, F_INNER_IN_ALIGN = 16 };

enum { A_ADD, A_SUB, A_MUL, A_OR, A_AND, A_EQ, A_LT, A_NE, A_MAX, A_GT, A_COUNT };

#define F32_PARAM 4  /* a pack record's size | F32_PARAM << 8: the value written as an f32 */
#define MAX_RECORDS 256
#define MAX_KEY (RECORD - 3)
#define MAX_SLOTS 64
#define MAX_PARAMS 64 /* kernel parameters (zerokv's kernels have up to 40) */
#define MAX_PARAM_BYTES 4096
#define FORMS_KEPT 8 /* forms remembered per bound call (engines meet a handful) */

/* ---- DLPack 1.x, as the specification lays it out ------------------------------------------ */

enum { kDLCPU = 1, kDLCUDA = 2, kDLCUDAHost = 3, kDLROCM = 10 };

typedef struct {
    uint32_t major;
    uint32_t minor;
} DLPackVersion;

typedef struct {
    int32_t device_type;
    int32_t device_id;
} DLDevice;

typedef struct {
    uint8_t code;
    uint8_t bits;
    uint16_t lanes;
} DLDataType;

typedef struct {
    void *data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape;
    int64_t *strides; /* NULL: row-major */
    uint64_t byte_offset;
} DLTensor;

typedef struct DLPackExchangeAPIHeader {
    DLPackVersion version;
    struct DLPackExchangeAPIHeader *prev_api;
} DLPackExchangeAPIHeader;

/* Only the two entries zerokv calls are typed; the others are kept as opaque slots. */
typedef struct {
    DLPackExchangeAPIHeader header;
    void *managed_tensor_allocator;
    void *managed_tensor_from_py_object_no_sync;
    void *managed_tensor_to_py_object_no_sync;
    int (*dltensor_from_py_object_no_sync)(void *py_object, DLTensor *out);
    int (*current_work_stream)(int32_t device_type, int32_t device_id, void **out_stream);
} DLPackExchangeAPI;

/* ---- the driver's entry points, found at the first real launch ----------------------------- */

typedef int (*cuLaunchKernel_t)(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                unsigned by, unsigned bz, unsigned shared, void *stream,
                                void **params, void **extra);
typedef int (*cuCtxGetCurrent_t)(void **ctx);
typedef int (*cuCtxPushCurrent_t)(void *ctx);
typedef int (*cuCtxPopCurrent_t)(void **ctx);
typedef int (*cuGetErrorName_t)(int error, const char **name);

static struct {
    int tried;
    void *lib;
    cuLaunchKernel_t launch;
    cuCtxGetCurrent_t get_current;
    cuCtxPushCurrent_t push;
    cuCtxPopCurrent_t pop;
    cuGetErrorName_t error_name;
} cu;

static int load_driver(void)
{
    if (cu.launch != NULL)
        return 0;
    if (!cu.tried) {
        cu.tried = 1;
        cu.lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
        if (cu.lib == NULL)
            cu.lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
        if (cu.lib != NULL) {
            cu.get_current = (cuCtxGetCurrent_t)dlsym(cu.lib, "cuCtxGetCurrent");
            cu.push = (cuCtxPushCurrent_t)dlsym(cu.lib, "cuCtxPushCurrent_v2");
            cu.pop = (cuCtxPopCurrent_t)dlsym(cu.lib, "cuCtxPopCurrent_v2");
            cu.error_name = (cuGetErrorName_t)dlsym(cu.lib, "cuGetErrorName");
            if (cu.get_current && cu.push && cu.pop)
                cu.launch = (cuLaunchKernel_t)dlsym(cu.lib, "cuLaunchKernel");
        }
    }
    if (cu.launch != NULL)
        return 0;
    PyErr_SetString(PyExc_RuntimeError,
                    "zerokv: the CUDA driver (libcuda.so.1) cannot be loaded to launch a kernel");
    return -1;
}

/* ---- module state: where launches go, Python helpers ---------------------------------------- */

static PyObject *recorder;         /* fn(entry, grid, grid_y, params) or NULL */
static int counting;               /* launches counted, never made (set_recorder(None, False)) */
static long long launch_count;     /* launches since the last set_recorder */
static PyObject *writable_cheap;   /* generic_tensors.writable_cheap (bind()) */
static PyObject *torch_type_of;   /* tensors.torch_tensor_type (bind()): torch's tensor type */
static PyObject *inference_mode;   /* torch.is_inference_mode_enabled, once a signature needs it */
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
            Py_XDECREF(torch);
        }
        st->torch_rule = tt == (PyObject *)st->type && inference_mode != NULL;
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

/* OP_TENSOR: 1 read, 0 not taken, -1 an exception. */
static int read_tensor(State *st, const int64_t *rec, int k, Call *c, int64_t *r)
{
    int64_t slot = rec[1], rank = rec[2], flags = rec[3];
    if (slot >= c->nobjs)
        return 0;
    PyObject *x = c->objs[slot];
    if (Py_TYPE(x) != st->type)
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
    PyObject *v = c->scalars[rec[1]];
    int overflow = 0;
    long long x = PyLong_CheckExact(v) ? PyLong_AsLongLongAndOverflow(v, &overflow) : 0;
    got = PyLong_CheckExact(v) && !overflow && r[rec[3]] <= x && x <= r[rec[4]];
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

/* bc on a call's objects and scalars (arrays the caller keeps alive for the call). */
static PyObject *run_items(PyObject *bc, PyObject *const *objs, Py_ssize_t nobjs, PyObject *const *scalars,
                           Py_ssize_t nscalars)
{
    PyObject *capsule = state_of(bc);
    if (capsule == NULL)
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    State *st = (State *)PyCapsule_GetContext(capsule);
    Call c;
    c.objs = objs, c.nobjs = nobjs, c.scalars = scalars, c.nscalars = nscalars;
    c.any_made = 0;
    c.inference_mode = -1;
    PyObject *got = execute(bc, st, &c);
    if (c.any_made)
        for (int i = 0; i < MAX_SLOTS; i++)
            Py_XDECREF(c.made[i]);
    Py_DECREF(capsule);
    return got;
}

static PyObject *run_call(PyObject *bc, PyObject *objs, PyObject *scalars)
{
    if (!PyTuple_Check(objs) || !PyTuple_Check(scalars))
        Py_RETURN_NONE; /* the ops pass tuples; anything else goes to the full path */
    Py_INCREF(objs); /* the items stay alive while Python code the table calls runs */
    Py_INCREF(scalars);
    PyObject *got = run_items(bc, &PyTuple_GET_ITEM(objs, 0), PyTuple_GET_SIZE(objs), &PyTuple_GET_ITEM(scalars, 0),
                              PyTuple_GET_SIZE(scalars));
    Py_DECREF(scalars);
    Py_DECREF(objs);
    return got;
}

static PyObject *run(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "run(bc, objs, scalars) takes 3 arguments");
        return NULL;
    }
    return run_call(args[0], args[1], args[2]);
}

/* ---- the ops' entries: the recent bound calls of a call's scalars, run here ----------------- */

static PyObject *executor_globals; /* zerokv.core.executor's namespace: its "run" is the switch */
static PyObject *run_either_fn;    /* this module's run_either: the switch is on when it is "run" */
static PyObject *recent;           /* plans.recent: scalars key -> the recent bound calls */
static PyObject *python_run;       /* pyexec.run */
static PyObject *python_two, *python_n, *python_rows; /* the ops' Python entries */
static PyObject *s_run, *s_c_ok, *s_n, *s_empty_rows, *s_float32;

/* 1 when bc runs here (bc.c_ok), 0 when not, -1 with an exception. */
static int c_ok_of(PyObject *bc)
{
    PyObject *ok = slot_of(bc, off_c_ok);
    if (ok == Py_True)
        return 1;
    if (ok == Py_False)
        return 0;
    ok = PyObject_GetAttr(bc, s_c_ok);
    if (ok == NULL)
        return -1;
    int t = PyObject_IsTrue(ok);
    Py_DECREF(ok);
    return t;
}

static PyObject *run_either(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "run_either(bc, objs, scalars) takes 3 arguments");
        return NULL;
    }
    int ok = c_ok_of(args[0]);
    if (ok < 0)
        return NULL;
    if (ok || python_run == NULL)
        return run_call(args[0], args[1], args[2]);
    return PyObject_Vectorcall(python_run, args, 3, NULL);
}

/* The executor chosen for the ops' calls is this one (executor.run is run_either). */
static int entries_on(void)
{
    if (executor_globals == NULL || recent == NULL)
        return 0;
    PyObject *r = PyDict_GetItemWithError(executor_globals, s_run);
    if (r == NULL)
        PyErr_Clear();
    return r != NULL && r == run_either_fn;
}

/* The result of the first recent bound call of `key` that takes the call: a new reference;
 * Py_None (new reference) when none does, when the key has none, or when one of them runs on
 * the Python executor (the Python entry then runs them all); NULL with an exception that a
 * bound call raised. An unhashable key is left to the Python entry. */
static PyObject *recent_result(PyObject *key, PyObject *const *objs, Py_ssize_t nobjs, PyObject *const *scalars,
                               Py_ssize_t nscalars, int truth)
{
    PyObject *calls = PyDict_GetItemWithError(recent, key);
    if (calls == NULL) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    if (!PyTuple_CheckExact(calls))
        Py_RETURN_NONE;
    Py_INCREF(calls);
    PyObject *got = NULL;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(calls); i++) {
        PyObject *bc = PyTuple_GET_ITEM(calls, i);
        int ok = c_ok_of(bc);
        if (ok <= 0) {
            PyErr_Clear();
            break;
        }
        got = run_items(bc, objs, nobjs, scalars, nscalars);
        if (got == NULL)
            break;
        int taken = got != Py_None;
        if (taken && truth) {
            taken = PyObject_IsTrue(got);
            if (taken < 0) {
                Py_CLEAR(got);
                break;
            }
        }
        if (taken)
            break;
        Py_CLEAR(got);
    }
    Py_DECREF(calls);
    if (got == NULL && !PyErr_Occurred())
        got = Py_NewRef(Py_None);
    return got;
}

/* The two-way entry's arguments, as entry_args.table() lays them out and bind_entries() checks
 * them: their names (positions of a call), how many a call must give, the defaults of the others,
 * where each object of the bound call comes from (an argument, or one item of a tuple of several),
 * how each item of the recent calls' key is made, and the arguments that are the bound call's
 * scalars. Unbound (two_nargs 0): every call goes to the Python entry. */
enum { TWO_MAX_ARGS = 64, TWO_MAX_KEY = 16, TWO_MAX_SCALARS = 4, TWO_MAX_PARTS = 16 };
enum { KEY_VALUE, KEY_IS_NONE, KEY_NOT_NONE, KEY_OR_IS_NONE, KEY_KINDS };
typedef struct {
    int arg, part, parts; /* part -1: the argument itself */
} two_obj;
typedef struct {
    int kind, arg, other;
} two_key_item;
static struct {
    PyObject *names, *defaults; /* tuples, held */
    int nargs, required, written, nobjs, nkey, nscalars; /* written: those a keyword may name */
    int in_place; /* the first objects are the first arguments, as they are */
    two_obj objs[MAX_SLOTS];
    two_key_item key[TWO_MAX_KEY];
    int scalars[TWO_MAX_SCALARS];
} tw;

/* The arguments of a call of merge_plans.two by position, those it leaves out at their defaults
 * (borrowed); 0 when they are not a call this entry reads (the Python entry then makes it, or
 * names what is wrong). */
static int two_args(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, PyObject **a)
{
    int n = tw.nargs;
    if (n == 0 || nargs > n)
        return 0;
    PyObject *const *dflt = &PyTuple_GET_ITEM(tw.defaults, 0);
    if (kwnames == NULL) { /* by position: the rest at their defaults */
        if (nargs < tw.required)
            return 0;
        memcpy(a, args, sizeof(a[0]) * (size_t)nargs);
        memcpy(a + nargs, dflt + nargs, sizeof(a[0]) * (size_t)(n - nargs));
        return 1;
    }
    for (int i = 0; i < n; i++)
        a[i] = i < nargs ? args[i] : NULL;
    Py_ssize_t nkw = PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t j = 0; j < nkw; j++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, j);
        int i = 0, w = tw.written;
        while (i < w && name != PyTuple_GET_ITEM(tw.names, i))
            i++;
        for (int k = 0; i == w && k < w; k++)
            if (PyUnicode_Check(name) && PyUnicode_Compare(name, PyTuple_GET_ITEM(tw.names, k)) == 0)
                i = k;
        if (i == w || a[i] != NULL)
            return 0;
        a[i] = args[nargs + j];
    }
    for (int i = 0; i < n; i++) {
        if (a[i] != NULL)
            continue;
        if (i < tw.required)
            return 0;
        a[i] = dflt[i];
    }
    return 1;
}

static PyObject *fallback(PyObject *fn, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    if (fn == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "zerokv: the compiled entries are not bound");
        return NULL;
    }
    return PyObject_Vectorcall(fn, args, (size_t)nargs, kwnames);
}

static PyObject *bool_of(int x) { return x ? Py_True : Py_False; }

/* The key of a call of two() in the recent bound calls: one tuple kept and refilled while nobody
 * else holds it (a key is only looked up, never stored), a new one otherwise. A new reference:
 * give it back with two_key_done(). */
static PyObject *two_key_kept;

static PyObject *two_key(PyObject *const *items, int nkey)
{
    PyObject *key = two_key_kept, *old[TWO_MAX_KEY];
    if (key == NULL || Py_REFCNT(key) != 1 || PyTuple_GET_SIZE(key) != nkey) {
        key = PyTuple_New(nkey);
        if (key == NULL)
            return NULL;
        for (int i = 0; i < nkey; i++)
            PyTuple_SET_ITEM(key, i, Py_NewRef(items[i]));
        if (two_key_kept == NULL || Py_REFCNT(two_key_kept) == 1)
            Py_XSETREF(two_key_kept, Py_NewRef(key));
        return key;
    }
    Py_INCREF(key); /* held now: a call made while the old items go finds it taken */
    for (int i = 0; i < nkey; i++) {
        old[i] = PyTuple_GET_ITEM(key, i);
        PyTuple_SET_ITEM(key, i, Py_NewRef(items[i]));
    }
    for (int i = 0; i < nkey; i++)
        Py_DECREF(old[i]);
    return key;
}

static void two_key_done(PyObject *key) { Py_DECREF(key); }

/* A call's recent bound calls run on its arguments `a` (two_args'): a new reference, Py_None
 * when they leave the call (or an option of several is not given as a tuple of them) to the
 * Python entry; NULL with an exception. */
static PyObject *two_run(PyObject *const *a)
{
    PyObject *objs[MAX_SLOTS], *key_items[TWO_MAX_KEY], *scalars[TWO_MAX_SCALARS];
    memcpy(objs, a, sizeof(objs[0]) * (size_t)tw.in_place);
    for (int j = tw.in_place; j < tw.nobjs; j++) {
        two_obj o = tw.objs[j];
        PyObject *x = a[o.arg];
        if (o.part < 0 || x == Py_None)
            objs[j] = x;
        else if (PyTuple_CheckExact(x) && PyTuple_GET_SIZE(x) == o.parts)
            objs[j] = PyTuple_GET_ITEM(x, o.part);
        else /* the Python entry takes it or names what is wrong */
            Py_RETURN_NONE;
    }
    for (int k = 0; k < tw.nkey; k++) {
        two_key_item it = tw.key[k];
        PyObject *x = a[it.arg];
        switch (it.kind) {
        case KEY_IS_NONE:
            key_items[k] = bool_of(x == Py_None);
            break;
        case KEY_NOT_NONE:
            key_items[k] = bool_of(x != Py_None);
            break;
        case KEY_OR_IS_NONE:
            key_items[k] = x != Py_None ? x : bool_of(a[it.other] == Py_None);
            break;
        default:
            key_items[k] = x;
        }
    }
    for (int k = 0; k < tw.nscalars; k++)
        scalars[k] = a[tw.scalars[k]];
    PyObject *key = two_key(key_items, tw.nkey), *got = NULL;
    if (key != NULL) {
        got = recent_result(key, objs, tw.nobjs, scalars, tw.nscalars, 0);
        two_key_done(key);
    }
    return got;
}

static PyObject *two(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *a[TWO_MAX_ARGS];
    if (!entries_on() || !two_args(args, nargs, kwnames, a))
        return fallback(python_two, args, nargs, kwnames);
    PyObject *held = Py_NewRef(tw.defaults); /* the defaults among `a` stay while the call runs */
    PyObject *got = two_run(a);
    Py_DECREF(held);
    if (got != Py_None)
        return got; /* the result, NULL with a bound call's exception, or NULL from no memory */
    Py_DECREF(got);
    return fallback(python_two, args, nargs, kwnames);
}

/* An int item of a table in [lo, hi), else -1 with ValueError naming `what`. */
static int table_int(PyObject *x, int lo, int hi, const char *what)
{
    long v = PyLong_Check(x) ? PyLong_AsLong(x) : LONG_MIN;
    if (v == -1 && PyErr_Occurred())
        PyErr_Clear(), v = LONG_MIN;
    if (v < lo || v >= hi) {
        PyErr_Format(PyExc_ValueError, "bind_entries: the two-way table's %s must be an int in [%d, %d)", what, lo, hi);
        return INT_MIN;
    }
    return (int)v;
}

/* Tuple `t` of exactly `n` items (n < 0: any count up to -n), else NULL with ValueError. */
static PyObject *table_tuple(PyObject *t, Py_ssize_t n, const char *what)
{
    if (!PyTuple_Check(t) || (n >= 0 ? PyTuple_GET_SIZE(t) != n : PyTuple_GET_SIZE(t) > -n)) {
        PyErr_Format(PyExc_ValueError, "bind_entries: the two-way table's %s is not a tuple of the right size", what);
        return NULL;
    }
    return t;
}

/* The two-way table (entry_args.table()) checked item by item into tw; tw is unchanged on error. */
static int bind_two_table(PyObject *table)
{
    if (table_tuple(table, 7, "table") == NULL)
        return -1;
    PyObject *names = PyTuple_GET_ITEM(table, 0), *defaults = PyTuple_GET_ITEM(table, 3);
    PyObject *objs = PyTuple_GET_ITEM(table, 4), *key = PyTuple_GET_ITEM(table, 5);
    PyObject *scalars = PyTuple_GET_ITEM(table, 6);
    if (table_tuple(names, -TWO_MAX_ARGS, "names") == NULL)
        return -1;
    if (PyTuple_GET_SIZE(names) == 0) {
        PyErr_SetString(PyExc_ValueError, "bind_entries: the two-way table names no argument");
        return -1;
    }
    int n = (int)PyTuple_GET_SIZE(names);
    for (int i = 0; i < n; i++)
        if (!PyUnicode_CheckExact(PyTuple_GET_ITEM(names, i))) {
            PyErr_SetString(PyExc_ValueError, "bind_entries: the two-way table's names must be strings");
            return -1;
        }
    int required = table_int(PyTuple_GET_ITEM(table, 1), 0, n + 1, "required count");
    int written = table_int(PyTuple_GET_ITEM(table, 2), 0, n + 1, "keyword count");
    if (required == INT_MIN || written == INT_MIN || table_tuple(defaults, n, "defaults") == NULL ||
        table_tuple(objs, -MAX_SLOTS, "objects") == NULL || table_tuple(key, -TWO_MAX_KEY, "key") == NULL ||
        table_tuple(scalars, -TWO_MAX_SCALARS, "scalars") == NULL)
        return -1;
    two_obj o[MAX_SLOTS];
    two_key_item k[TWO_MAX_KEY];
    int sc[TWO_MAX_SCALARS];
    int nobjs = (int)PyTuple_GET_SIZE(objs), nkey = (int)PyTuple_GET_SIZE(key);
    int nscalars = (int)PyTuple_GET_SIZE(scalars);
    if (nkey == 0) {
        PyErr_SetString(PyExc_ValueError, "bind_entries: the two-way table's key is empty");
        return -1;
    }
    for (int j = 0; j < nobjs; j++) {
        PyObject *it = table_tuple(PyTuple_GET_ITEM(objs, j), 3, "object");
        if (it == NULL || (o[j].arg = table_int(PyTuple_GET_ITEM(it, 0), 0, n, "object's argument")) == INT_MIN ||
            (o[j].parts = table_int(PyTuple_GET_ITEM(it, 2), 1, TWO_MAX_PARTS + 1, "object's parts")) == INT_MIN ||
            (o[j].part = table_int(PyTuple_GET_ITEM(it, 1), -1, o[j].parts, "object's part")) == INT_MIN)
            return -1;
    }
    for (int j = 0; j < nkey; j++) {
        PyObject *it = table_tuple(PyTuple_GET_ITEM(key, j), 3, "key item");
        if (it == NULL || (k[j].kind = table_int(PyTuple_GET_ITEM(it, 0), 0, KEY_KINDS, "key kind")) == INT_MIN ||
            (k[j].arg = table_int(PyTuple_GET_ITEM(it, 1), 0, n, "key's argument")) == INT_MIN ||
            (k[j].other = table_int(PyTuple_GET_ITEM(it, 2), 0, n, "key's other argument")) == INT_MIN)
            return -1;
    }
    for (int j = 0; j < nscalars; j++)
        if ((sc[j] = table_int(PyTuple_GET_ITEM(scalars, j), 0, n, "scalar")) == INT_MIN)
            return -1;
    Py_XSETREF(tw.names, Py_NewRef(names));
    Py_XSETREF(tw.defaults, Py_NewRef(defaults));
    tw.in_place = 0;
    while (tw.in_place < nobjs && o[tw.in_place].arg == tw.in_place && o[tw.in_place].part < 0)
        tw.in_place++;
    tw.nargs = n, tw.required = required, tw.written = written, tw.nobjs = nobjs, tw.nkey = nkey, tw.nscalars = nscalars;
    memcpy(tw.objs, o, sizeof(o[0]) * (size_t)nobjs);
    memcpy(tw.key, k, sizeof(k[0]) * (size_t)nkey);
    memcpy(tw.scalars, sc, sizeof(sc[0]) * (size_t)nscalars);
    return 0;
}

static PyObject *n(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    if (!entries_on() || nargs != 2 || kwnames != NULL || !PyTuple_Check(args[0]))
        return fallback(python_n, args, nargs, kwnames);
    PyObject *key = PyTuple_Pack(2, s_n, args[1]), *got = NULL;
    if (key != NULL)
        got = recent_result(key, &PyTuple_GET_ITEM(args[0], 0), PyTuple_GET_SIZE(args[0]), NULL, 0, 0);
    Py_XDECREF(key);
    if (got != Py_None)
        return got;
    Py_DECREF(got);
    return fallback(python_n, args, nargs, kwnames);
}

static PyObject *empty_rows(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    if (!entries_on() || nargs != 3 || kwnames != NULL || !PyTuple_Check(args[1]))
        return fallback(python_rows, args, nargs, kwnames);
    PyObject *key = PyTuple_Pack(2, s_empty_rows, args[0]), *got = NULL;
    if (key != NULL)
        got = recent_result(key, &PyTuple_GET_ITEM(args[1], 0), PyTuple_GET_SIZE(args[1]), NULL, 0, 1);
    Py_XDECREF(key);
    if (got == NULL)
        return NULL;
    if (got != Py_None) {
        Py_DECREF(got);
        Py_RETURN_NONE; /* done */
    }
    Py_DECREF(got);
    return fallback(python_rows, args, nargs, kwnames);
}

/* The offset of `cls`'s __slots__ member `name` holding an object, or -1. */
static Py_ssize_t member_offset(PyObject *cls, const char *name)
{
    PyObject *d = PyObject_GetAttrString(cls, name);
    Py_ssize_t off = -1;
    if (d != NULL && Py_IS_TYPE(d, &PyMemberDescr_Type)) {
        PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
        if (m->type == T_OBJECT_EX && !(m->flags & READ_RESTRICTED))
            off = m->offset;
    }
    Py_XDECREF(d);
    PyErr_Clear();
    return off;
}

static PyObject *bind_entries(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if ((nargs != 7 && nargs != 8) || !PyDict_Check(args[0]) || !PyDict_Check(args[1]) || !PyType_Check(args[2]) ||
        !PyCallable_Check(args[3]) || !PyCallable_Check(args[4]) || !PyCallable_Check(args[5]) ||
        !PyCallable_Check(args[6])) {
        PyErr_SetString(PyExc_TypeError, "bind_entries(executor namespace, recent, BoundCall, python run, "
                                         "two, n, empty_rows[, two's table]) takes two dicts, a class, four "
                                         "callables and a table");
        return NULL;
    }
    if (nargs == 8 && bind_two_table(args[7]) < 0)
        return NULL;
    PyObject *either = PyObject_GetAttrString(module, "run_either");
    if (either == NULL)
        return NULL;
    Py_XSETREF(run_either_fn, either);
    Py_XSETREF(executor_globals, Py_NewRef(args[0]));
    Py_XSETREF(recent, Py_NewRef(args[1]));
    Py_XSETREF(bc_type, (PyTypeObject *)Py_NewRef(args[2]));
    off_c_state = member_offset(args[2], "c_state");
    off_c_ok = member_offset(args[2], "c_ok");
    Py_XSETREF(python_run, Py_NewRef(args[3]));
    Py_XSETREF(python_two, Py_NewRef(args[4]));
    Py_XSETREF(python_n, Py_NewRef(args[5]));
    Py_XSETREF(python_rows, Py_NewRef(args[6]));
    Py_RETURN_NONE;
}

/* ---- the rest of the module ----------------------------------------------------------------- */

static PyObject *set_recorder(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "set_recorder(fn_or_None, keep) takes 2 arguments");
        return NULL;
    }
    int keep = PyObject_IsTrue(args[1]);
    if (keep < 0)
        return NULL;
    if (args[0] != Py_None && !PyCallable_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "set_recorder: the recorder must be callable or None");
        return NULL;
    }
    PyObject *fn = args[0] != Py_None && keep ? Py_NewRef(args[0]) : NULL;
    Py_XSETREF(recorder, fn);
    counting = !keep;
    launch_count = 0;
    Py_RETURN_NONE;
}

static PyObject *launches(PyObject *module, PyObject *unused)
{
    return PyLong_FromLongLong(launch_count);
}

static PyObject *bind(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyCallable_Check(args[0]) || !PyCallable_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "bind(writable_cheap, torch_tensor_type) takes two callables");
        return NULL;
    }
    Py_XSETREF(writable_cheap, Py_NewRef(args[0]));
    Py_XSETREF(torch_type_of, Py_NewRef(args[1]));
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"run", (PyCFunction)(void (*)(void))run, METH_FASTCALL,
     "run(bc, objs, scalars): the bound call on one call's arguments: its result, or None when "
     "the table does not take the call."},
    {"run_either", (PyCFunction)(void (*)(void))run_either, METH_FASTCALL,
     "run_either(bc, objs, scalars): run() for a bound call this executor takes (bc.c_ok), the "
     "Python executor's run for the others."},
    {"two", (PyCFunction)(void (*)(void))two, METH_FASTCALL | METH_KEYWORDS,
     "merge_plans.two's entry: the recent bound calls of the call's scalars run here, else the "
     "Python entry (bound by bind_entries) makes the call."},
    {"n", (PyCFunction)(void (*)(void))n, METH_FASTCALL | METH_KEYWORDS,
     "merge_states_plan.n's entry, as two()."},
    {"empty_rows", (PyCFunction)(void (*)(void))empty_rows, METH_FASTCALL | METH_KEYWORDS,
     "empty_rows_plan.run's entry, as two()."},
    {"bind_entries", (PyCFunction)(void (*)(void))bind_entries, METH_FASTCALL,
     "bind_entries(executor namespace, recent, BoundCall, python run, two, n, empty_rows[, table]): "
     "the entries run the recent bound calls while the namespace's run is run_either, and call the "
     "Python entries otherwise; table: how two() reads a call (entry_args.table(), checked here)."},
    {"set_recorder", (PyCFunction)(void (*)(void))set_recorder, METH_FASTCALL,
     "set_recorder(fn, keep): launches go to fn(entry, grid, grid_y, params) (keep=True), are "
     "only counted (keep=False), or reach the driver (fn=None, keep=True); the count restarts."},
    {"launches", launches, METH_NOARGS, "launches(): launches since the last set_recorder."},
    {"bind", (PyCFunction)(void (*)(void))bind, METH_FASTCALL,
     "bind(writable_cheap, torch_tensor_type): how an output that requires grad or is an inference "
     "tensor is judged (generic_tensors.writable_cheap; for torch's tensor type, its rule made here)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "zerokv_launcher", "zerokv's compiled executor of bound calls.", -1, methods,
};

static int add_format(PyObject *m)
{
    static const struct {
        const char *name;
        long value;
    } format[] = {
        {"RECORD", RECORD}, {"NREG", NREG}, {"N_TENSORS", N_TENSORS}, {"R_ZERO", R_ZERO},
        {"R_ONE", R_ONE}, {"R_WIDEST", R_WIDEST}, {"R_STOR", R_STOR}, {"R_MISALIGN", R_MISALIGN},
        {"TENSOR_BASE", TENSOR_BASE}, {"TENSOR_REGS", TENSOR_REGS}, {"CONST_BASE", CONST_BASE},
        {"T_PTR", T_PTR}, {"T_SIZE", T_SIZE}, {"T_STRIDE", T_STRIDE}, {"T_END", T_END},
        {"OP_TENSOR", OP_TENSOR}, {"OP_ABSENT", OP_ABSENT}, {"OP_SCALAR", OP_SCALAR},
        {"OP_EQ", OP_EQ}, {"OP_RANGE", OP_RANGE}, {"OP_CHECK", OP_CHECK}, {"OP_APART", OP_APART},
        {"OP_ARITH", OP_ARITH}, {"OP_DONE_IF_ZERO", OP_DONE_IF_ZERO}, {"OP_KEY", OP_KEY},
        {"OP_DISTINCT", OP_DISTINCT}, {"OP_ALLOC", OP_ALLOC}, {"F_TRANSPOSE", F_TRANSPOSE},
        {"F_OUTPUT", F_OUTPUT}, {"F_UNIT_INNER", F_UNIT_INNER}, {"F_ALIGN", F_ALIGN},
        {"F_INNER_IN_ALIGN", F_INNER_IN_ALIGN}, {"A_ADD", A_ADD}, {"A_SUB", A_SUB},
        {"A_MUL", A_MUL}, {"A_OR", A_OR}, {"A_AND", A_AND}, {"A_EQ", A_EQ}, {"A_LT", A_LT},
        {"A_NE", A_NE}, {"A_MAX", A_MAX}, {"A_GT", A_GT},
    };
    PyObject *d = PyDict_New();
    if (d == NULL)
        return -1;
    for (size_t i = 0; i < sizeof(format) / sizeof(format[0]); i++) {
        PyObject *v = PyLong_FromLong(format[i].value);
        if (v == NULL || PyDict_SetItemString(d, format[i].name, v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(d);
            return -1;
        }
        Py_DECREF(v);
    }
    return PyModule_AddObject(m, "FORMAT", d) < 0 ? (Py_DECREF(d), -1) : 0;
}

PyMODINIT_FUNC PyInit_zerokv_launcher(void)
{
    struct {
        PyObject **slot;
        const char *text;
    } names[] = {
        {&s_requires_grad, "requires_grad"}, {&s_is_inference, "is_inference"}, {&s_version, "_version"}, {&s_c_state, "c_state"},
        {&s_table, "table"}, {&s_torch_type, "torch_type"}, {&s_device, "device"}, {&s_result, "result"},
        {&s_allocators, "allocators"}, {&s_entry, "entry"}, {&s_launcher, "launcher"}, {&s_expr, "expr"},
        {&s_handle, "handle"}, {&s_context, "context"}, {&s_block, "block"}, {&s_grid, "grid"},
        {&s_per_token, "per_token"}, {&s_run_tail, "run_tail"}, {&s_run_spans, "run_spans"},
        {&s_cap, "cap"}, {&s_pack, "pack"}, {&s_const_bits, "const_bits"}, {&s_nbytes, "nbytes"},
        {&s_t_lo, "t_lo"}, {&s_t_hi, "t_hi"}, {&s_consts, "consts"}, {&s_stream, "stream"},
        {&s_run, "run"}, {&s_c_ok, "c_ok"}, {&s_n, "n"}, {&s_empty_rows, "empty_rows"},
        {&s_float32, "float32"}, {&s_direct, "direct"},
    };
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        if (*names[i].slot == NULL && (*names[i].slot = PyUnicode_InternFromString(names[i].text)) == NULL)
            return NULL;
    if (unreadable == NULL) {
        unreadable = PyTuple_Pack(5, PyExc_AttributeError, PyExc_TypeError, PyExc_ValueError,
                                  PyExc_RuntimeError, PyExc_IndexError);
        if (unreadable == NULL)
            return NULL;
    }
    if (dtype_device == NULL && (dtype_device = Py_BuildValue("(ss)", "dtype", "device")) == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL)
        return NULL;
    if (add_format(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
