/* Part of launcher.c, compiled as its one translation unit: the entries' tables checked at bind
 * time, and the remaining entries. */

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
