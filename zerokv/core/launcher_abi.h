/* Part of launcher.c, compiled as its one translation unit: the record format, DLPack's structures
 * and the driver's entry points. */

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
