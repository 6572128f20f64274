/* The CUDA backend's compiled fast path: the three driver calls of every
 * await -- cuLaunchKernel, cuEventRecord, cuEventQuery -- and cuGraphLaunch (a replayed
 * GEMM's captured library call) made straight through the driver's function pointers,
 * with plain integer handles, instead of through cuda.bindings' generic wrappers.
 *
 * The module holds no state and links nothing: the backend passes each call the driver
 * entry point it got from cuGetProcAddress (tests pass ctypes callbacks instead, which
 * is how CI checks this code without a GPU). Every function returns the CUresult as an
 * int; the Python side turns a non-zero one into the same error as the pure-Python
 * path. The pure-Python path stays the fallback: without a compiler at install, where
 * the driver gives no entry point, or with the backend's test hook (_cuda._use_fast_path)
 * off.
 *
 * Each call releases the GIL while the driver runs (a launch or record blocks while the
 * launch queue is full), as cuda.bindings does.
 *
 * Built with the limited API (abi3): one binary serves Python 3.11 and later.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

typedef int (*launch_fn)(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                         unsigned shmem, void *stream, void **params, void **extra);
typedef int (*record_fn)(void *event, void *stream);
typedef int (*query_fn)(void *event);
typedef int (*graph_launch_fn)(void *exec, void *stream);

/* An unsigned integer argument: a handle, a pointer or a dimension (an int, or any
 * object with __index__, such as a numpy integer). */
static int take(PyObject *o, unsigned long long *out) {
    unsigned long long v;
    if (PyLong_Check(o)) {
        v = PyLong_AsUnsignedLongLong(o);
    } else {
        PyObject *i = PyNumber_Index(o);
        if (i == NULL) return -1;
        v = PyLong_AsUnsignedLongLong(i);
        Py_DECREF(i);
    }
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    *out = v;
    return 0;
}

static int take_dim(PyObject *o, unsigned *out) {
    unsigned long long v;
    if (take(o, &v) < 0) return -1;
    if (v > 0xFFFFFFFFull) {
        PyErr_SetString(PyExc_OverflowError, "a launch dimension or shared-memory size does not fit in 32 bits");
        return -1;
    }
    *out = (unsigned)v;
    return 0;
}

/* The driver entry point, the first argument of each call: never 0. */
static int take_entry(PyObject *o, unsigned long long *out) {
    if (take(o, out) < 0) return -1;
    if (*out == 0) {
        PyErr_SetString(PyExc_ValueError, "no driver entry point");
        return -1;
    }
    return 0;
}

/* launch(pfn_launch, function, gx, gy, gz, bx, by, bz, shmem, stream, params) -> CUresult
 * params: the address of the packed kernelParams array (void **), or 0. */
static PyObject *fast_launch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 11) {
        PyErr_SetString(PyExc_TypeError, "launch takes 11 integer arguments");
        return NULL;
    }
    unsigned long long pfn, f, stream, params;
    unsigned d[7];
    if (take_entry(args[0], &pfn) < 0 || take(args[1], &f) < 0) return NULL;
    for (int i = 0; i < 7; i++)
        if (take_dim(args[2 + i], &d[i]) < 0) return NULL;
    if (take(args[9], &stream) < 0 || take(args[10], &params) < 0) return NULL;
    int err;
    /* A launch blocks while the driver's launch queue is full: other threads run meanwhile
     * (as with cuda.bindings, which releases the GIL around driver calls). */
    Py_BEGIN_ALLOW_THREADS
    err = ((launch_fn)(uintptr_t)pfn)((void *)(uintptr_t)f, d[0], d[1], d[2], d[3], d[4], d[5], d[6],
                                      (void *)(uintptr_t)stream, (void **)(uintptr_t)params, NULL);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(err);
}

/* record(pfn_record, event, stream) -> CUresult */
static PyObject *fast_record(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "record takes 3 integer arguments");
        return NULL;
    }
    unsigned long long pfn, ev, stream;
    if (take_entry(args[0], &pfn) < 0 || take(args[1], &ev) < 0 || take(args[2], &stream) < 0) return NULL;
    int err;
    Py_BEGIN_ALLOW_THREADS  /* may block like a launch */
    err = ((record_fn)(uintptr_t)pfn)((void *)(uintptr_t)ev, (void *)(uintptr_t)stream);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(err);
}

/* query(pfn_query, event) -> CUresult */
static PyObject *fast_query(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "query takes 2 integer arguments");
        return NULL;
    }
    unsigned long long pfn, ev;
    if (take_entry(args[0], &pfn) < 0 || take(args[1], &ev) < 0) return NULL;
    int err;
    Py_BEGIN_ALLOW_THREADS  /* as cuda.bindings does: the same behaviour on both paths */
    err = ((query_fn)(uintptr_t)pfn)((void *)(uintptr_t)ev);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(err);
}

/* graph_launch(pfn_graph_launch, exec, stream) -> CUresult */
static PyObject *fast_graph_launch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "graph_launch takes 3 integer arguments");
        return NULL;
    }
    unsigned long long pfn, exec, stream;
    if (take_entry(args[0], &pfn) < 0 || take(args[1], &exec) < 0 || take(args[2], &stream) < 0) return NULL;
    int err;
    Py_BEGIN_ALLOW_THREADS  /* may block like a launch */
    err = ((graph_launch_fn)(uintptr_t)pfn)((void *)(uintptr_t)exec, (void *)(uintptr_t)stream);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(err);
}

static PyMethodDef methods[] = {
    {"launch", (PyCFunction)(void (*)(void))fast_launch, METH_FASTCALL,
     "launch(pfn, function, gx, gy, gz, bx, by, bz, shmem, stream, params) -> CUresult"},
    {"record", (PyCFunction)(void (*)(void))fast_record, METH_FASTCALL, "record(pfn, event, stream) -> CUresult"},
    {"query", (PyCFunction)(void (*)(void))fast_query, METH_FASTCALL, "query(pfn, event) -> CUresult"},
    {"graph_launch", (PyCFunction)(void (*)(void))fast_graph_launch, METH_FASTCALL,
     "graph_launch(pfn, exec, stream) -> CUresult"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_cudafast", "The CUDA backend's compiled driver calls (see _cudafast.c).", 0, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__cudafast(void) { return PyModule_Create(&module); }
