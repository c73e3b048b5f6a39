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
 * declared in launcher_abi.h, and the driver is found in the process (libcuda.so.1) at the
 * first launch. Built at first use by zerokv/core/cexec.py with the host C compiler, this file
 * and the parts it includes (launcher_*.h) as one translation unit.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <structmember.h>

#include <dlfcn.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>

/* the executor by job, each part reading only the ones before it */
#include "launcher_abi.h"
#include "launcher_state.h"
#include "launcher_checks.h"
#include "launcher_outputs.h"
#include "launcher_launch.h"
#include "launcher_entries.h"
#include "launcher_bind.h"

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
