/* Part of launcher.c, compiled as its one translation unit: run(), and the ops' entries over their
 * recent bound calls. */

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
