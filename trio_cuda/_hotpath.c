/* The runtime's compiled hot path (issue 12), in C:
 *
 * - ``_Launch._submit_now`` (trio_cuda/_kernel.py): the direct submission of a prepared
 *   kernel launch;
 * - ``enqueue_direct``: the same enqueue for a replayed op whose recipe is one prepared
 *   launch (_ops/_core.py, _Recipe.submit_now); ``TensorOp._submit_now`` for such a
 *   recipe or one prepared GEMM, and the CUDA backend's replay of a kept GEMM graph
 *   (gemm_replay);
 * - ``Device.poll`` (trio_cuda/_device.py) for an event without a completion word;
 * - for the general path (trio_cuda/_submit.py, Plan): ``_Launch._plan`` of a prepared
 *   launch, the walk's loop over launches and selects, and the loop over a plan's steps;
 * - the per-call path: ``DeviceOp.__await__`` (an iterator doing _submit.await_op's
 *   work), ``Kernel.__call__``, ``Device._event_handle`` and ``Event.__del__``.
 *
 * Why C helps here: the work is ~40 reads and writes of the runtime's objects'
 * attributes, a lock, and three driver calls. C reading attributes through
 * PyObject_GetAttr is no faster than Python's specialized bytecode (measured), so this
 * module reads and writes the ``__slots__`` of the runtime's classes directly at their
 * offsets. The offsets are taken at setup from the classes' member descriptors, each
 * checked to be a plain object slot; a class that is not what this file expects makes
 * setup fail as a whole, and the runtime keeps its pure-Python path (the same code,
 * which stays the reference and is tested both ways). Objects of exactly the expected
 * classes only. On a backend that offers them (DeviceDriver.hot_calls: CUDA with its
 * fast path) the launch, record and query are made straight through the driver's entry
 * points (and a kept GEMM graph's cuGraphLaunch), while the driver's methods are the
 * backend's own.
 *
 * The contract: each either does exactly what the Python does, or, before any effect,
 * hands the call to it (any case this file does not handle: op inputs, arguments not
 * seen before, memory not yet allocated, deferred frees to run first, keep-alives to
 * retire, a capture, a completion word, a query it cannot make, ...). Everything here
 * runs under the GIL; the runtime lock is the same RLock the Python code takes; the GIL
 * is released around each driver call.
 *
 * Not built with the limited API: the member descriptors' offsets need CPython's
 * structures (stable since 3.11). Built per Python version at install; optional.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <string.h>

/* ---- slots ------------------------------------------------------------------------ */

#define SLOT(o, off) (*(PyObject **)((char *)(o) + (off)))

static int slot_offset(PyObject *cls, const char *name, Py_ssize_t *out) {
    if (!PyType_Check(cls)) {
        PyErr_Format(PyExc_TypeError, "_hotpath: %R is not a class", cls);
        return -1;
    }
    PyObject *descr = PyObject_GetAttrString(cls, name);
    if (descr == NULL) return -1;
    int ok = Py_IS_TYPE(descr, &PyMemberDescr_Type) &&
             ((PyMemberDescrObject *)descr)->d_member->type == T_OBJECT_EX &&
             !(((PyMemberDescrObject *)descr)->d_member->flags & READONLY);
    if (ok) *out = ((PyMemberDescrObject *)descr)->d_member->offset;
    Py_DECREF(descr);
    if (!ok) {
        PyErr_Format(PyExc_TypeError, "_hotpath: %R.%s is not a plain __slots__ attribute", cls, name);
        return -1;
    }
    return 0;
}

/* ---- what setup() binds ----------------------------------------------------------- */

static PyObject *Launch_T, *Partition_T, *Tensor_T, *Stream_T, *Config_T, *Counters_T, *Event_T, *Device_T;
#define IS(o, T) ((PyObject *)Py_TYPE(o) == (T))

static struct {
    /* op (DeviceOp / _Launch) */
    Py_ssize_t op_inputs, op_state, op_args, op_kernel;
    /* Partition, Tensor */
    Py_ssize_t part_k, part_tensor, part_tile, tensor_args, tensor_buffer, tensor_tracked;
    /* Buffer */
    Py_ssize_t buf_capture, buf_writer, buf_readers, buf_lifetime, buf_ptr;
    /* Stream */
    Py_ssize_t s_device, s_generation, s_capture, s_dropped, s_keep, s_seq, s_done_seq, s_handle;
    /* _Config */
    Py_ssize_t cfg_writes, cfg_reads, cfg_grid;
    Py_ssize_t s_last_event, s_flag, s_wref, s_ok_seq, s_newest_pending;
    /* Event */
    Py_ssize_t ev_device, ev_stream, ev_stream_handle, ev_seq, ev_handle, ev_done, ev_error, ev_generation, ev_flag,
        ev_ticket;
    /* _Counters */
    Py_ssize_t ctr_launches, ctr_submissions;
    /* the walk: _Launch._inputs_at, _Select, Lane, Continue, Buffer */
    Py_ssize_t launch_inputs_at, sel_index, sel_expect, lane_device, lane_stream, cont_op, buf_generation, buf_device;
} O;

static PyObject *py_submit;   /* the Python _Launch._submit_now: every case not handled here */
static PyObject *lock_obj;    /* the runtime RLock */
static PyObject *tls;         /* _guard._tls (a threading.local) */
static PyObject *executing;   /* _submit.EXECUTING */
static PyObject *direct_failed;
static PyObject *Buffer_T;    /* (checked through the tensor's slot) */
static PyObject *py_poll;     /* the Python Device.poll */
static PyObject *device_globals; /* _device's module dict (poll_by_stream) */

static PyObject *one, *zero;
static PyObject *s_submitting, *s_acquire, *s_release, *s_generation, *s_resetting, *s_driver, *s_fault,
    *s_dead_buffers, *s_dead_streams, *s_lingering, *s_dead_graphs, *s_stats, *s_fast, *s_name, *s_launch,
    *s__key, *s__arg, *s_retire, *s_event_at, *s_event_handle, *s_record, *s_ticket, *s_wait_for, *s_query, *s_hot_calls, *s__fast, *s_token, *s__token, *s_launch_failed, *s_record_failed, *s_cross_device, *s_poll_by_stream, *s_claimed, *s_steps, *s_ops, *s_capture, *s__plan, *s_launches, *s__prepared_step, *s__enqueue_launch;

/* What ran here, for tests and probes (under the GIL; wrap-around is not a concern). */
static unsigned long long n_submits, n_submits_python, n_polls, n_polls_python, n_launches, n_records, n_queries, n_enqueues,
    n_plans, n_plans_python, n_handbacks, n_steps, n_steps_python;

/* ---- section timing (probes only) --------------------------------------------------- */
/* Built with -DHOTPATH_TIMING (benchmarks/probes/probe_sections.py builds such a copy), the
 * submission, the await and the poll add the time stamp counter's ticks of each of
 * their sections to tick_sum[] (read by timing()); a normal build compiles none of it. */
#define N_TIMED 40
#ifdef HOTPATH_TIMING
#include <x86intrin.h>
static unsigned long long tick_sum[N_TIMED], tick_n[N_TIMED];
#define T_START unsigned long long t_last_ = __rdtsc()
#define T_MARK(i)                                                                                                   \
    do {                                                                                                            \
        unsigned long long t_ = __rdtsc();                                                                          \
        tick_sum[i] += t_ - t_last_;                                                                                \
        tick_n[i]++;                                                                                                \
        t_last_ = t_;                                                                                               \
    } while (0)
#define T_AROUND(i, stmt)                                                                                           \
    do {                                                                                                            \
        unsigned long long t0_ = __rdtsc();                                                                         \
        stmt;                                                                                                       \
        tick_sum[i] += __rdtsc() - t0_;                                                                             \
        tick_n[i]++;                                                                                                \
    } while (0)
#else
#define T_START ((void)0)
#define T_MARK(i) ((void)0)
#define T_AROUND(i, stmt) stmt
#endif

/* ---- helpers ---------------------------------------------------------------------- */

static int add_one(PyObject *obj, Py_ssize_t off) { /* obj.<slot> += 1 */
    PyObject *v = SLOT(obj, off);
    if (v == NULL) {
        PyErr_SetString(PyExc_AttributeError, "_hotpath: a counter is unset");
        return -1;
    }
    PyObject *n = PyNumber_Add(v, one);
    if (n == NULL) return -1;
    Py_SETREF(SLOT(obj, off), n);
    return 0;
}

/* The direct submissions' "planned", "enqueued" and "direct" counts, kept here: three
 * dict updates per submission cost ~0.1 us on an H200 host. _submit.statistics() adds
 * this to what _counts says (through _submit.count_extras; nothing here writes _counts,
 * whose Python updates a reader may interrupt). */
static unsigned long long n_direct_here;

static PyObject *direct_counted(PyObject *module, PyObject *unused) {
    return PyLong_FromUnsignedLongLong(n_direct_here);
}

static PyObject *s_submissions;

/* device._stats.<name> += 1: at its slot for the runtime's statistics class, by attribute
 * for another class (as the Python's ``device._stats.<name> += 1``). */
static int stats_add(PyObject *device, Py_ssize_t off, PyObject *name) {
    PyObject *stats = PyObject_GetAttr(device, s_stats);
    if (stats == NULL) return -1;
    int e;
    if (IS(stats, Counters_T)) {
        e = add_one(stats, off);
    } else {
        PyObject *v = PyObject_GetAttr(stats, name);
        PyObject *n = v == NULL ? NULL : PyNumber_Add(v, one);
        e = n == NULL ? -1 : PyObject_SetAttr(stats, name, n);
        Py_XDECREF(v);
        Py_XDECREF(n);
    }
    Py_DECREF(stats);
    return e;
}

/* A true attribute of a dict-based object (the device): 1, 0, or -1 on error. */
static int attr_true(PyObject *o, PyObject *name) {
    PyObject *v = PyObject_GetAttr(o, name);
    if (v == NULL) return -1;
    int r = PyObject_IsTrue(v);
    Py_DECREF(v);
    return r;
}

/* lock.acquire() / lock.release() (name: s_acquire or s_release) through the lock's
 * bound methods, taken once per lock object (an RLock's methods cannot be replaced on
 * the instance; the reference held to the lock keeps the comparison sound). */
static PyObject *lock_bound_for, *lock_acquire_m, *lock_release_m;

/* The runtime lock taken and given back here, as its own methods do, where it is
 * CPython 3.11/3.12's _thread.RLock: calling its acquire() parses arguments and costs
 * ~130-180 ns on an H200 host, twice per await (the submission, the poll), against
 * ~20 ns for the same steps here. Its fields (the OS lock, the owner thread, the count)
 * are read at the place rlock_check found them on a fresh RLock at setup; where the
 * check fails (another layout, another version) the methods are called as before. A
 * lock held by another thread is waited for by its own acquire() (which releases the
 * GIL and handles signals); the GIL, held throughout, keeps these steps whole, as it
 * keeps the methods'. */
#if PY_VERSION_HEX < 0x030D0000
#define RLOCK_INLINE 1
typedef struct {
    PyObject_HEAD
    PyThread_type_lock lock;
    unsigned long owner;
    unsigned long count;
} RLockView;
static PyTypeObject *rlock_type; /* the RLock type whose layout rlock_check found (NULL: none) */
static unsigned long long n_lock_inline, n_lock_waits;

static int rlock_acquire_here(PyObject *o) { /* 1 taken, 0 not here (another thread has it) */
    RLockView *r = (RLockView *)o;
    unsigned long me = PyThread_get_thread_ident();
    if (r->count > 0 && r->owner == me) {
        if (r->count + 1 == 0) return 0; /* (the method raises its overflow error) */
        r->count++;
        return 1;
    }
    if (PyThread_acquire_lock_timed(r->lock, 0, 0) != PY_LOCK_ACQUIRED) {
        n_lock_waits++;
        return 0;
    }
    r->owner = me;
    r->count = 1;
    return 1;
}

static int rlock_release_here(PyObject *o) { /* 1 given back, 0 not held here (the method raises) */
    RLockView *r = (RLockView *)o;
    if (r->count == 0 || r->owner != PyThread_get_thread_ident()) return 0;
    if (--r->count == 0) {
        r->owner = 0;
        PyThread_release_lock(r->lock);
    }
    return 1;
}

static int call_true_of(PyObject *o, const char *name) { /* o.name(): 1 true, 0 false, -1 error */
    PyObject *r = PyObject_CallMethod(o, name, NULL);
    if (r == NULL) return -1;
    int t = PyObject_IsTrue(r);
    Py_DECREF(r);
    return t;
}

/* Does a fresh lock of ``lock``'s type keep its owner and count where RLockView says,
 * and do the steps above and its methods agree, taken and given back both ways? */
static int rlock_check(PyObject *lock) {
    PyTypeObject *t = Py_TYPE(lock);
    /* exactly _thread's RLock (not a class that takes its name, not a subclass), and a
     * fresh one of that type */
    PyObject *mod = PyImport_ImportModule("_thread");
    PyObject *real = mod == NULL ? NULL : PyObject_GetAttrString(mod, "RLock");
    Py_XDECREF(mod);
    if (real == NULL) {
        PyErr_Clear();
        return 0;
    }
    int exact = (PyObject *)t == real;
    Py_DECREF(real);
    if (!exact || t->tp_basicsize < (Py_ssize_t)sizeof(RLockView)) return 0;
    PyObject *fresh = PyObject_CallNoArgs((PyObject *)t);
    if (fresh == NULL) return -1;
    if (Py_TYPE(fresh) != t) {
        Py_DECREF(fresh);
        return 0;
    }
    RLockView *v = (RLockView *)fresh;
    unsigned long me = PyThread_get_thread_ident();
    int ok = v->count == 0 && v->owner == 0 && v->lock != NULL;
    /* its own acquire, twice: the owner and the count where they are read */
    ok = ok && call_true_of(fresh, "acquire") == 1 && v->owner == me && v->count == 1;
    ok = ok && call_true_of(fresh, "acquire") == 1 && v->owner == me && v->count == 2;
    /* (the OS lock is held: a try fails) */
    ok = ok && PyThread_acquire_lock_timed(v->lock, 0, 0) == PY_LOCK_FAILURE;
    /* given back here twice: free for its own non-blocking acquire, then its release */
    ok = ok && rlock_release_here(fresh) && v->count == 1 && call_true_of(fresh, "_is_owned") == 1;
    ok = ok && rlock_release_here(fresh) && v->count == 0 && v->owner == 0 && call_true_of(fresh, "_is_owned") == 0;
    if (ok) {
        PyObject *r = PyObject_CallMethod(fresh, "acquire", "O", Py_False);
        ok = r == Py_True && v->owner == me && v->count == 1;
        Py_XDECREF(r);
        ok = ok && call_true_of(fresh, "release") == 0 && v->count == 0;
    }
    /* taken here twice: its own release gives it back (a third raises) */
    ok = ok && rlock_acquire_here(fresh) && rlock_acquire_here(fresh) && call_true_of(fresh, "_is_owned") == 1;
    ok = ok && call_true_of(fresh, "release") == 0 && call_true_of(fresh, "release") == 0 && v->count == 0 &&
         call_true_of(fresh, "_is_owned") == 0;
    if (ok) {
        PyObject *r = PyObject_CallMethod(fresh, "release", NULL);
        ok = r == NULL && PyErr_ExceptionMatches(PyExc_RuntimeError);
        Py_XDECREF(r);
    }
    PyErr_Clear();
    Py_DECREF(fresh);
    return ok;
}
#endif

static int lock_call(PyObject *name) {
#ifdef RLOCK_INLINE
    if (Py_TYPE(lock_obj) == rlock_type &&
        (name == s_acquire ? rlock_acquire_here(lock_obj) : rlock_release_here(lock_obj))) {
        n_lock_inline++;
        return 0;
    }
#endif
    if (lock_bound_for != lock_obj) {
        PyObject *a = PyObject_GetAttr(lock_obj, s_acquire);
        PyObject *r = a == NULL ? NULL : PyObject_GetAttr(lock_obj, s_release);
        if (r == NULL) {
            Py_XDECREF(a);
            return -1;
        }
        Py_XSETREF(lock_acquire_m, a);
        Py_XSETREF(lock_release_m, r);
        Py_XSETREF(lock_bound_for, Py_NewRef(lock_obj));
    }
    PyObject *r = PyObject_CallNoArgs(name == s_acquire ? lock_acquire_m : lock_release_m);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

static int set_submitting(PyObject *flag) { return PyObject_SetAttr(tls, s_submitting, flag); }

/* The key of one scalar argument, as _kernel._scalar_key (float and int-like exact
 * types only; NULL without an error: not handled here). */
static PyObject *scalar_key(PyObject *a) {
    PyTypeObject *t = Py_TYPE(a);
    if (t == &PyFloat_Type) {
        double v = PyFloat_AS_DOUBLE(a);
        return Py_BuildValue("(OOd)", (PyObject *)t, a, copysign(1.0, v));
    }
    if (t == &PyLong_Type || t == &PyBool_Type) return PyTuple_Pack(2, (PyObject *)t, a);
    return NULL;
}

/* The prepared key of the arguments (as _kernel._prepared_key); NULL without an error:
 * not handled here. */
static PyObject *prepared_key(PyObject *args) {
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    PyObject *key = PyTuple_New(n);
    if (key == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *a = PyTuple_GET_ITEM(args, i);
        PyObject *k;
        if (IS(a, Partition_T)) {
            k = SLOT(a, O.part_k);
            if (k == NULL) goto unhandled;
            if (k == Py_None) {
                /* Partition._key(): (its tensor's writable descriptor, its tiles), cached */
                PyObject *t = SLOT(a, O.part_tensor), *tile = SLOT(a, O.part_tile);
                if (t == NULL || tile == NULL || !IS(t, Tensor_T)) goto unhandled;
                PyObject *d = SLOT(t, O.tensor_args), *b = SLOT(t, O.tensor_buffer);
                if (d == NULL || b == NULL || !IS(b, Buffer_T)) goto unhandled;
                if (d != Py_None && PyTuple_CheckExact(d) && PyTuple_GET_SIZE(d) == 2) {
                    k = PyTuple_Pack(2, PyTuple_GET_ITEM(d, 1), tile);
                    if (k == NULL) goto failed;
                    Py_INCREF(k);
                    Py_XSETREF(SLOT(a, O.part_k), k);
                } else {
                    PyObject *ptr = SLOT(b, O.buf_ptr);
                    if (ptr == NULL || ptr == Py_None) goto unhandled; /* not allocated yet */
                    k = PyObject_CallMethodNoArgs(a, s__key);
                    if (k == NULL) goto failed;
                }
            } else {
                Py_INCREF(k);
            }
        } else if (IS(a, Tensor_T)) {
            PyObject *d = SLOT(a, O.tensor_args);
            if (d == NULL) goto unhandled;
            if (d == Py_None) {
                PyObject *b = SLOT(a, O.tensor_buffer);
                if (b == NULL || !IS(b, Buffer_T)) goto unhandled;
                PyObject *ptr = SLOT(b, O.buf_ptr);
                if (ptr == NULL || ptr == Py_None) goto unhandled;
                k = PyObject_CallMethodObjArgs(a, s__arg, Py_False, NULL);
                if (k == NULL) goto failed;
            } else {
                if (!PyTuple_CheckExact(d) || PyTuple_GET_SIZE(d) < 1) goto unhandled;
                k = PyTuple_GET_ITEM(d, 0);
                Py_INCREF(k);
            }
        } else {
            k = scalar_key(a);
            if (k == NULL) {
                if (PyErr_Occurred()) {
                    Py_DECREF(key);
                    return NULL;
                }
                goto unhandled;
            }
        }
        PyTuple_SET_ITEM(key, i, k);
    }
    return key;
unhandled:
    Py_DECREF(key);
    return NULL;
failed:
    Py_DECREF(key);
    return NULL; /* (with the error) */
}

/* The buffer of argument i of a launch, as a write (a Partition: its tensor's) or a
 * read (a Tensor); the tensor through *tensor. Borrowed; NULL: not handled. */
static PyObject *arg_buffer(PyObject *args, PyObject *index, int write, PyObject **tensor) {
    Py_ssize_t i = PyLong_AsSsize_t(index);
    if (i < 0 || i >= PyTuple_GET_SIZE(args)) {
        PyErr_Clear();
        return NULL;
    }
    PyObject *a = PyTuple_GET_ITEM(args, i);
    PyObject *t;
    if (write) {
        if (!IS(a, Partition_T)) return NULL;
        t = SLOT(a, O.part_tensor);
        if (t == NULL || !IS(t, Tensor_T)) return NULL;
    } else {
        if (!IS(a, Tensor_T)) return NULL;
        t = a;
    }
    *tensor = t;
    return SLOT(t, O.tensor_buffer);
}

static unsigned long long n_waits_called; /* calls of Stream.wait_for (Python) made here */

static int wait_for(PyObject *s, PyObject *other, PyObject *seq) {
    n_waits_called++;
    PyObject *r = PyObject_CallMethodObjArgs(s, s_wait_for, other, seq, NULL);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

/* ---- direct driver calls ---------------------------------------------------------- */
/* A backend that offers them (DeviceDriver.hot_calls, the CUDA backend with its fast
 * path) has the launch, the record and the query of the hot path made here straight
 * through the driver's entry points, as trio_cuda/_backends/_cudafast.c does for the
 * Python methods: the same calls, the same handles, the GIL released around each. */

typedef int (*launch_fn)(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                         unsigned shmem, void *stream, void **params, void **extra);
typedef int (*record_fn)(void *event, void *stream);
typedef int (*query_fn)(void *event);

typedef struct {
    void *launch, *record, *query;
    PyObject *hot; /* the driver's hot_calls (owned), for its prepared type */
    long not_ready;
} Direct;

/* Is ``v`` (an entry of ``obj``'s instance dict, or NULL: none) nothing or ``own`` bound
 * to ``obj``? Both call the class's own method; the second is what some versions of
 * pytest's monkeypatch leave in the instance dict when they undo a method set there
 * (the H200 image's did: every reuse was refused after such a test). */
static int own_bound(PyObject *v, PyObject *obj, PyObject *own) {
    return v == NULL || (PyMethod_Check(v) && PyMethod_GET_SELF(v) == obj && PyMethod_GET_FUNCTION(v) == own);
}

/* Is method ``name`` of ``obj`` other than ``own`` (NULL: unknown)? A subclass's
 * override, a method patched on the class, or one in ``obj``'s instance dict ``dict``
 * (except ``own`` bound to ``obj``: see own_bound). 1 replaced, 0 not, -1 an error (a
 * lookup in the dict raised; set). */
static int method_replaced(PyObject *obj, PyObject *dict, PyObject *name, PyObject *own) {
    if (own == NULL || _PyType_Lookup(Py_TYPE(obj), name) != own) return 1;
    PyObject *v = dict == NULL ? NULL : PyDict_GetItemWithError(dict, name);
    if (v == NULL && PyErr_Occurred()) return -1;
    return !own_bound(v, obj, own);
}

/* Is driver method ``name`` of ``obj`` other than the backend's own (``originals[name]``)?
 * A lookup that raises counts as replaced: the Python method is called, which says. */
static int replaced(PyObject *obj, PyObject *dict, PyObject *name, PyObject *originals) {
    int r = method_replaced(obj, dict, name, PyDict_GetItemWithError(originals, name));
    if (PyErr_Occurred()) {
        PyErr_Clear();
        return 1;
    }
    return r;
}

/* The answer of direct_calls for the driver it last said yes to, kept while nothing it
 * read can have changed: the driver's instance dict is the same dict at the same
 * version (hot_calls, _fast, _token and any method set on the instance are there), the
 * dict of the backend's own methods (hot_calls[3]) is at the same version, and the
 * driver's class has the same valid version tag (a method patched on it or on a base
 * changes that). Dict versions are unique in the interpreter's life, so a dict freed
 * and another made at its address is never taken for it; only the thread's token is
 * read on every call. Kept on Python 3.11 and 3.12 only, where it is tested: a 3.13
 * build kept nothing (the valid-tag flag read below was never set) and 3.14 keeps no
 * dict versions; the full check runs there. */
#if PY_VERSION_HEX < 0x030D0000 /* (3.11, 3.12: the versions read below are tested there) */
#define DIRECT_CACHE 1
typedef struct {
    PyObject *dict; /* (compared, not held) */
    uint64_t dict_version;
    unsigned int type_version;
} DriverState;
static struct {
    PyObject *driver, *own, *token; /* (compared, not held) */
    PyObject *hot;                  /* the hot_calls tuple (held) */
    DriverState state;
    uint64_t own_version;
    Direct d;
} dc;
static unsigned long long n_direct_cached;

static uint64_t dict_version(PyObject *dict) {
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
    return ((PyDictObject *)dict)->ma_version_tag;
#pragma GCC diagnostic pop
}

/* The driver's class's version tag and instance dict's version, for a driver whose
 * attributes are read the generic way (else 0: nothing kept for it). */
static int driver_state(PyObject *driver, DriverState *st) {
    PyTypeObject *t = Py_TYPE(driver);
    if (t->tp_getattro != PyObject_GenericGetAttr || !PyType_HasFeature(t, Py_TPFLAGS_VALID_VERSION_TAG) ||
        t->tp_version_tag == 0)
        return 0;
    PyObject *dict = PyObject_GenericGetDict(driver, NULL);
    if (dict == NULL) {
        PyErr_Clear();
        return 0;
    }
    int ok = PyDict_CheckExact(dict);
    st->dict = dict;
    st->dict_version = ok ? dict_version(dict) : 0;
    st->type_version = t->tp_version_tag;
    Py_DECREF(dict); /* (compared by version: unique for the interpreter's life) */
    return ok;
}

static int same_state(const DriverState *a, const DriverState *b) {
    return a->dict == b->dict && a->dict_version == b->dict_version && a->type_version == b->type_version;
}

/* 1: the kept answer holds for ``driver`` (filled in *d), 0: ask in full. The token is
 * read first: reading it may run code (a threading.local's __init__ on a new thread). */
static int direct_cached(PyObject *driver, Direct *d) {
    if (dc.hot == NULL || driver != dc.driver) return 0;
    /* (held until the end: the entry the token is read from must still be the entry) */
    PyObject *hot = Py_NewRef(dc.hot);
    PyObject *tok = PyObject_GetAttr(PyTuple_GET_ITEM(hot, 0), s_token);
    if (tok == NULL) {
        PyErr_Clear();
        Py_DECREF(hot);
        return 0;
    }
    Py_DECREF(tok); /* (compared by identity: the driver's dict holds its own) */
    DriverState now;
    if (dc.hot != hot || driver != dc.driver || tok != dc.token || !driver_state(driver, &now) ||
        !same_state(&now, &dc.state) || dict_version(dc.own) != dc.own_version) {
        Py_DECREF(hot);
        return 0;
    }
    *d = dc.d;
    d->hot = hot; /* (the reference taken above) */
    n_direct_cached++;
    return 1;
}

/* Keep the full answer ``d`` (a yes) for ``driver``, whose state was ``before`` when
 * the full check began and whose own-method table was at ``own_version`` when read:
 * only if nothing changed while the check ran (its reads may run code), each
 * attribute it read is a plain entry of the instance dict, and the numbers it read
 * are exact ints (no __index__ to give another answer next time). */
static void direct_keep(PyObject *driver, const DriverState *before, uint64_t own_version, PyObject *hc, PyObject *fast,
                        PyObject *mine, const Direct *d) {
    PyTypeObject *t = Py_TYPE(driver);
    PyObject *names[3] = {s_hot_calls, s__fast, s__token}, *values[3] = {hc, fast, mine};
    if (!PyLong_CheckExact(PyTuple_GET_ITEM(hc, 2)))
        return;
    for (int i = 0; i < 3; i++)
        if (!PyLong_CheckExact(PyTuple_GET_ITEM(fast, i))) return;
    PyObject *dict = PyObject_GenericGetDict(driver, NULL); /* (held across the lookups) */
    if (dict == NULL) {
        PyErr_Clear();
        return;
    }
    int plain = dict == before->dict;
    for (int i = 0; plain && i < 3; i++) {
        PyObject *c = _PyType_Lookup(t, names[i]);
        plain = (c == NULL || Py_TYPE(c)->tp_descr_set == NULL) && PyDict_GetItemWithError(dict, names[i]) == values[i];
    }
    PyErr_Clear();
    Py_DECREF(dict);
    if (!plain) return;
    DriverState after;
    PyObject *own = PyTuple_GET_ITEM(hc, 3);
    if (!driver_state(driver, &after) || !same_state(before, &after) || dict_version(own) != own_version) return;
    /* every field first, the old tuple released last (its release may run code) */
    PyObject *old = dc.hot;
    dc.hot = Py_NewRef(hc);
    dc.driver = driver;
    dc.own = own;
    dc.token = mine;
    dc.state = after;
    dc.own_version = own_version;
    dc.d = *d;
    dc.d.hot = NULL;
    Py_XDECREF(old);
}
#endif

/* Fill *d: 1 if direct calls may be made on this thread now, 0 if not (the Python
 * methods then), -1 on error. */
static int direct_calls(PyObject *driver, Direct *d) {
    d->hot = NULL;
#ifdef DIRECT_CACHE
    if (direct_cached(driver, d)) return 1;
    DriverState before; /* (the state the answer below is read from; 0: not kept) */
    int keep = driver_state(driver, &before);
#endif
    PyObject *hc = PyObject_GetAttr(driver, s_hot_calls);
    if (hc == NULL) { /* (a driver without it: the Python methods, as they would be called) */
        PyErr_Clear();
        return 0;
    }
    if (hc == Py_None || !PyTuple_CheckExact(hc) || PyTuple_GET_SIZE(hc) != 4 || !PyType_Check(PyTuple_GET_ITEM(hc, 1)) ||
        !PyDict_CheckExact(PyTuple_GET_ITEM(hc, 3))) {
        Py_DECREF(hc);
        return 0;
    }
#ifdef DIRECT_CACHE
    uint64_t own_version = dict_version(PyTuple_GET_ITEM(hc, 3));
#endif
    PyObject *fast = PyObject_GetAttr(driver, s__fast);
    if (fast == NULL) {
        PyErr_Clear();
        Py_DECREF(hc);
        return 0;
    }
    int ok = PyTuple_CheckExact(fast) && PyTuple_GET_SIZE(fast) == 3;
    PyObject *mine = NULL;
    if (ok) {
        PyObject *tok = PyObject_GetAttr(PyTuple_GET_ITEM(hc, 0), s_token);
        mine = tok == NULL ? NULL : PyObject_GetAttr(driver, s__token);
        ok = tok != NULL && mine != NULL && tok == mine; /* this device's context is current here */
        Py_XDECREF(tok);
        if (PyErr_Occurred()) PyErr_Clear(); /* (no token yet on this thread: the Python makes it current) */
    }
    if (ok) {
        d->launch = PyLong_AsVoidPtr(PyTuple_GET_ITEM(fast, 0));
        d->record = PyLong_AsVoidPtr(PyTuple_GET_ITEM(fast, 1));
        d->query = PyLong_AsVoidPtr(PyTuple_GET_ITEM(fast, 2));
        d->not_ready = PyLong_AsLong(PyTuple_GET_ITEM(hc, 2));
        if (PyErr_Occurred() || !d->launch || !d->record || !d->query) {
            PyErr_Clear();
            ok = 0;
        }
    }
    if (ok) {
        /* A method replaced on this driver object (a test's fault injection, a tool's
         * wrapper) is called, as the Python path would call it: no direct call for it. */
        PyObject *dict = PyObject_GenericGetDict(driver, NULL);
        if (dict == NULL) PyErr_Clear();
        PyObject *own = PyTuple_GET_ITEM(hc, 3);
        if (replaced(driver, dict, s_launch, own)) d->launch = NULL;
        if (replaced(driver, dict, s_record, own)) d->record = NULL;
        if (replaced(driver, dict, s_query, own)) d->query = NULL;
#ifdef DIRECT_CACHE
        if (keep) direct_keep(driver, &before, own_version, hc, fast, mine, d);
#endif
        Py_XDECREF(dict);
    }
    Py_XDECREF(mine);
    Py_DECREF(fast);
    if (!ok) {
        Py_DECREF(hc);
        return 0;
    }
    d->hot = hc;
    return 1;
}

/* A handle or an address as a pointer (an int, or an object with __int__ such as a
 * cuda.bindings handle); NULL with an error set on failure. */
static void *as_pointer(PyObject *o, int *failed) {
    *failed = 0;
    if (PyLong_Check(o)) {
        void *p = PyLong_AsVoidPtr(o);
        if (p == NULL && PyErr_Occurred()) *failed = 1;
        return p;
    }
    PyObject *i = PyNumber_Long(o);
    if (i == NULL) {
        *failed = 1;
        return NULL;
    }
    void *p = PyLong_AsVoidPtr(i);
    Py_DECREF(i);
    if (p == NULL && PyErr_Occurred()) *failed = 1;
    return p;
}

static PyObject *prep_type;
static Py_ssize_t prep_off[8]; /* fn, gx, gy, gz, bx, by, bz, params */

/* The launch of a prepared launch on a stream handle: 1 made, 0 not made here (the
 * Python method then, nothing happened), -1 an error raised (a failed launch). */
static int launch_direct(PyObject *driver, Direct *d, PyObject *p, PyObject *stream) {
    if (d->launch == NULL) return 0;
    PyObject *ptype = PyTuple_GET_ITEM(d->hot, 1);
    if (!IS(p, ptype)) return 0;
    if (prep_type != ptype) { /* the offsets of this type, all or none */
        static const char *names[8] = {"fn", "gx", "gy", "gz", "bx", "by", "bz", "params"};
        Py_ssize_t off[8];
        for (int i = 0; i < 8; i++) {
            if (slot_offset(ptype, names[i], &off[i]) < 0) {
                PyErr_Clear();
                return 0;
            }
        }
        memcpy(prep_off, off, sizeof(off));
        Py_INCREF(ptype);
        Py_XSETREF(prep_type, ptype);
    }
    unsigned long dims[6];
    PyObject *fn = SLOT(p, prep_off[0]), *params = SLOT(p, prep_off[7]);
    if (fn == NULL || params == NULL || !PyLong_CheckExact(fn) || !PyLong_CheckExact(params)) return 0;
    for (int i = 0; i < 6; i++) {
        PyObject *v = SLOT(p, prep_off[1 + i]);
        if (v == NULL || !PyLong_CheckExact(v)) return 0;
        dims[i] = PyLong_AsUnsignedLong(v);
        if ((dims[i] == (unsigned long)-1 && PyErr_Occurred()) || dims[i] > 0xFFFFFFFFul) {
            PyErr_Clear();
            return 0;
        }
    }
    int failed;
    void *f = PyLong_AsVoidPtr(fn), *pp = PyLong_AsVoidPtr(params), *st = as_pointer(stream, &failed);
    if (failed || PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    int err;
    launch_fn call = (launch_fn)d->launch;
    T_AROUND(20, Py_BEGIN_ALLOW_THREADS err = call(f, (unsigned)dims[0], (unsigned)dims[1], (unsigned)dims[2],
                                                (unsigned)dims[3], (unsigned)dims[4], (unsigned)dims[5], 0, st,
                                                (void **)pp, NULL);
             Py_END_ALLOW_THREADS);
    n_launches++;
    if (err) {
        PyObject *el = PyLong_FromLong(err);
        PyObject *r = el == NULL ? NULL : PyObject_CallMethodObjArgs(driver, s_launch_failed, el, p, NULL);
        Py_XDECREF(el);
        if (r != NULL) { /* _launch_failed always raises */
            Py_DECREF(r);
            PyErr_SetString(PyExc_SystemError, "_hotpath: a failed launch raised nothing");
        }
        return -1;
    }
    return 1;
}

/* cuEventRecord(event, stream): 1 made, 0 not made here, -1 an error raised. */
static int record_direct(PyObject *driver, Direct *d, PyObject *event, PyObject *stream) {
    if (d->record == NULL) return 0;
    int failed1, failed2;
    void *e = as_pointer(event, &failed1), *st = as_pointer(stream, &failed2);
    if (failed1 || failed2) {
        PyErr_Clear();
        return 0;
    }
    int err;
    record_fn call = (record_fn)d->record;
    T_AROUND(21, Py_BEGIN_ALLOW_THREADS err = call(e, st); Py_END_ALLOW_THREADS);
    n_records++;
    if (err) {
        PyObject *el = PyLong_FromLong(err);
        PyObject *r = el == NULL ? NULL : PyObject_CallMethodObjArgs(driver, s_record_failed, el, NULL);
        Py_XDECREF(el);
        if (r != NULL) {
            Py_DECREF(r);
            PyErr_SetString(PyExc_SystemError, "_hotpath: a failed record raised nothing");
        }
        return -1;
    }
    return 1;
}

/* cuEventQuery(event): 1 done, 0 pending, 2 anything else (not made here, or an
 * answer the Python must interpret: it asks again). */
static int query_direct(Direct *d, PyObject *event) {
    if (d->query == NULL) return 2;
    int failed;
    void *e = as_pointer(event, &failed);
    if (failed) {
        PyErr_Clear();
        return 2;
    }
    int err;
    query_fn call = (query_fn)d->query;
    T_AROUND(22, Py_BEGIN_ALLOW_THREADS err = call(e); Py_END_ALLOW_THREADS);
    n_queries++;
    if (err == 0) return 1;
    return err == d->not_ready ? 0 : 2;
}

/* driver.launch(prepared, stream): straight through the entry point when ``d`` allows,
 * else the driver's method. 0, or -1 with the error set. */
static int launch_prepared(PyObject *driver, Direct *d, PyObject *prepared, PyObject *stream) {
    int made = d != NULL ? launch_direct(driver, d, prepared, stream) : 0;
    if (made == 0) {
        PyObject *r = PyObject_CallMethodObjArgs(driver, s_launch, prepared, stream, NULL);
        if (r == NULL) return -1;
        Py_DECREF(r);
    }
    return made < 0 ? -1 : 0;
}

/* Stream.event_at(seq) for a stream that just enqueued point ``seq`` (not capturing,
 * with a live handle): the stream's last event if it covers seq, else a new Event
 * recorded now. New reference; NULL on error. */
static PyObject *event_new(PyObject *s, PyObject *device, PyObject *driver, PyObject *seq, Direct *direct,
                           PyObject *flag, PyObject *wref, PyObject *handle, PyObject *gen);

/* Bound by setup_calls (NULL before: the Python methods are called). */
static PyObject *py_event_handle, *py_recycle_event, *py_submission_stream, *registry_globals;
static PyObject *s__event_pool, *s_pop, *s_append, *s__create_event, *s__current, *s__devices, *s__pick,
    *s__recycle_event;

static PyObject *device_dict(PyObject *device) { /* new reference */
    return PyObject_GenericGetDict(device, NULL);
}

/* device._event_handle() (_device.Device._event_handle, under the lock): a pooled handle
 * of the device's generation, else a new one; the Python method where it is replaced. */
static PyObject *event_handle(PyObject *device) {
    if (!IS(device, Device_T)) return PyObject_CallMethodNoArgs(device, s_event_handle);
    PyObject *d = device_dict(device);
    if (d == NULL) return NULL;
    int own = method_replaced(device, d, s_event_handle, py_event_handle) == 0;
    /* (each held as soon as it is read: the next lookup may run code that changes the dict) */
    PyObject *pool = own ? Py_XNewRef(PyDict_GetItemWithError(d, s__event_pool)) : NULL;
    PyObject *gen = pool == NULL ? NULL : Py_XNewRef(PyDict_GetItemWithError(d, s_generation));
    Py_DECREF(d);
    if (!own || pool == NULL || gen == NULL) {
        Py_XDECREF(pool);
        if (PyErr_Occurred()) return NULL;
        return PyObject_CallMethodNoArgs(device, s_event_handle); /* set on the instance, or unusual */
    }
    PyObject *h = NULL;
    for (;;) {
        Py_ssize_t n = PyObject_Length(pool);
        if (n < 0) break;
        if (n == 0) {
            PyObject *drv = PyObject_GetAttr(device, s_driver);
            if (drv != NULL) h = PyObject_CallMethodNoArgs(drv, s__create_event);
            Py_XDECREF(drv);
            break;
        }
        PyObject *item = PyObject_CallMethodNoArgs(pool, s_pop);
        if (item == NULL) {
            if (PyErr_ExceptionMatches(PyExc_IndexError)) { /* emptied by another thread meanwhile */
                PyErr_Clear();
                continue;
            }
            break;
        }
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2) {
            Py_DECREF(item);
            PyErr_SetString(PyExc_TypeError, "_hotpath: an event pool entry is not (generation, handle)");
            break;
        }
        int same = PyObject_RichCompareBool(PyTuple_GET_ITEM(item, 0), gen, Py_EQ);
        if (same > 0) h = Py_NewRef(PyTuple_GET_ITEM(item, 1));
        Py_DECREF(item);
        if (same != 0) break;
    }
    Py_DECREF(pool);
    Py_DECREF(gen);
    return h;
}

static PyObject *py_event_at; /* Stream.event_at as bound at setup */

/* The stream's last event ``last`` recorded again for point ``seq``, when nothing but
 * the stream holds it: done without an error, no weak reference, the stream's
 * generation, no completion word, and its handle would go back to the device's pool
 * through the compiled Event.__del__ (the device's _recycle_event and _event_handle
 * its own). Then dropping it and taking a pooled handle for a new Event (which
 * event_new does) differs from recording it again only in which handle stays in the
 * pool; nothing else can tell the two apart. The record is made first, straight
 * through the driver's entry point, and the event's fields change only once it is.
 * Returns the event (a new reference), NULL without an error: not here (event_new
 * then), NULL with an error: the record failed (the event as it was). */
static PyObject *s___del__;
static unsigned long long n_event_reuses;
static PyMethodDef event_del_def;

static int own_recycling(PyObject *device) {
    PyObject *del = _PyType_Lookup((PyTypeObject *)Event_T, s___del__);
    if (del == NULL || !Py_IS_TYPE(del, &PyMethodDescr_Type) || ((PyMethodDescrObject *)del)->d_method != &event_del_def)
        return 0;
    if (!IS(device, Device_T)) return 0;
    PyObject *d = device_dict(device);
    if (d == NULL) {
        PyErr_Clear();
        return 0;
    }
    int own = method_replaced(device, d, s__recycle_event, py_recycle_event) == 0 &&
              method_replaced(device, d, s_event_handle, py_event_handle) == 0;
    Py_DECREF(d);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    return own;
}

static int reuse_ok(PyObject *s, PyObject *device, PyObject *last, Py_ssize_t wo) {
    PyObject *flag = SLOT(s, O.s_flag), *wref = SLOT(s, O.s_wref), *handle = SLOT(s, O.s_handle),
             *gen = SLOT(s, O.s_generation);
    PyObject *lflag = SLOT(last, O.ev_flag), *lgen = SLOT(last, O.ev_generation), *lh = SLOT(last, O.ev_handle);
    if (flag == NULL || wref == NULL || handle == NULL || gen == NULL || lflag == NULL || lgen == NULL || lh == NULL ||
        !PyLong_CheckExact(flag) || !PyLong_CheckExact(lflag) || SLOT(last, O.ev_done) != Py_True ||
        SLOT(last, O.ev_error) != Py_None || SLOT(last, O.ev_device) != device || SLOT(last, O.ev_stream) != wref)
        return 0;
    if (PyLong_AsLong(flag) >= 0 || PyLong_AsLong(lflag) >= 0) {
        PyErr_Clear();
        return 0;
    }
    int same = PyObject_RichCompareBool(lgen, gen, Py_EQ);
    if (same <= 0) {
        PyErr_Clear();
        return 0;
    }
    /* (no reference, weak reference or other last event came while this ran) */
    return own_recycling(device) && Py_REFCNT(last) == 2 && (wo == 0 || *(PyObject **)((char *)last + wo) == NULL) &&
           SLOT(s, O.s_last_event) == last;
}

static PyObject *event_reuse(PyObject *s, PyObject *device, PyObject *driver, PyObject *seq, Direct *direct,
                             PyObject *last) {
    /* only the stream holds it, and its __del__ has not run (a finalizer may have
     * resurrected an event whose handle is in the pool already) */
    if (direct == NULL || direct->record == NULL || !IS(last, Event_T) || Py_REFCNT(last) != 1 ||
        PyObject_GC_IsFinalized(last))
        return NULL;
    /* (the list of its weak references: at tp_weaklistoffset, which is negative where
     * Python 3.12+ keeps it before the object, as _PyObject_GET_WEAKREFS_LISTPTR reads it) */
    Py_ssize_t wo = Py_TYPE(last)->tp_weaklistoffset;
    if (wo != 0 && *(PyObject **)((char *)last + wo) != NULL) return NULL;
    Py_INCREF(last); /* (held from here: the checks below may run a collection) */
    if (!reuse_ok(s, device, last, wo)) {
        Py_DECREF(last);
        return NULL;
    }
    PyObject *handle = Py_NewRef(SLOT(s, O.s_handle)), *lh = Py_NewRef(SLOT(last, O.ev_handle));
    int made = record_direct(driver, direct, lh, handle);
    Py_DECREF(lh);
    /* 0: not made here, no error (event_new then); -1: the record's error. The GIL was
     * released around the record: if another thread took a reference or a weak
     * reference meanwhile, or the stream has another last event, the event stays as it
     * was (done: nothing asks the driver about its handle again, which goes back to the
     * pool when it dies) and event_new makes the new point's event. */
    if (made <= 0 || Py_REFCNT(last) != 2 || (wo != 0 && *(PyObject **)((char *)last + wo) != NULL) ||
        SLOT(s, O.s_last_event) != last) {
        Py_DECREF(handle);
        Py_DECREF(last);
        return NULL;
    }
#define SET(off, v) Py_XSETREF(SLOT(last, O.off), Py_NewRef(v))
    SET(ev_seq, seq);
    SET(ev_done, Py_False);
    SET(ev_stream_handle, handle);
    SET(ev_ticket, zero);
#undef SET
    Py_DECREF(handle);
    n_event_reuses++;
    return last;
}

static PyObject *event_at(PyObject *s, PyObject *device, PyObject *driver, PyObject *seq, Direct *direct) {
    PyObject *h = SLOT(s, O.s_handle), *cap = SLOT(s, O.s_capture);
    /* (Stream.event_at as the class has it now: with type as its metaclass, what the
     * class's MRO holds, as a function is given as it is) */
    PyObject *own = Py_IS_TYPE(Stream_T, &PyType_Type) ? _PyType_Lookup((PyTypeObject *)Stream_T, s_event_at) : NULL;
    /* a destroyed or capturing stream, or the method replaced on the class: the Python says */
    if (h == NULL || h == Py_None || cap != Py_None || own != py_event_at)
        return PyObject_CallMethodOneArg(s, s_event_at, seq);
    PyObject *last = SLOT(s, O.s_last_event);
    if (last != NULL && last != Py_None) {
        if (!IS(last, Event_T)) {
            PyErr_SetString(PyExc_TypeError, "_hotpath: a stream's last event is not an Event");
            return NULL;
        }
        int covers = PyObject_RichCompareBool(SLOT(last, O.ev_seq), seq, Py_GE);
        if (covers < 0) return NULL;
        if (covers) return Py_NewRef(last);
        PyObject *again = event_reuse(s, device, driver, seq, direct, last);
        if (again != NULL || PyErr_Occurred()) return again;
    }
    PyObject *flag = SLOT(s, O.s_flag), *wref = SLOT(s, O.s_wref), *handle = SLOT(s, O.s_handle),
             *gen = SLOT(s, O.s_generation);
    if (flag == NULL || wref == NULL || handle == NULL || gen == NULL || !PyLong_CheckExact(flag)) {
        PyErr_SetString(PyExc_AttributeError, "_hotpath: a stream is missing an attribute");
        return NULL;
    }
    /* held across the calls below */
    Py_INCREF(flag);
    Py_INCREF(wref);
    Py_INCREF(handle);
    Py_INCREF(gen);
    PyObject *ev = event_new(s, device, driver, seq, direct, flag, wref, handle, gen);
    Py_DECREF(flag);
    Py_DECREF(wref);
    Py_DECREF(handle);
    Py_DECREF(gen);
    return ev;
}

static PyObject *event_new(PyObject *s, PyObject *device, PyObject *driver, PyObject *seq, Direct *direct,
                           PyObject *flag, PyObject *wref, PyObject *handle, PyObject *gen) {
    long f = PyLong_AsLong(flag);
    if (f == -1 && PyErr_Occurred()) return NULL;
    PyObject *ticket;
    if (f >= 0) {
        PyObject *t = PyObject_GetAttr(device, s_ticket);
        if (t == NULL) return NULL;
        ticket = PyNumber_Add(t, one);
        Py_DECREF(t);
        if (ticket == NULL) return NULL;
        if (PyObject_SetAttr(device, s_ticket, ticket) < 0) {
            Py_DECREF(ticket);
            return NULL;
        }
    } else {
        ticket = Py_NewRef(zero);
    }
    PyObject *eh;
    T_AROUND(11, eh = event_handle(device));
    if (eh == NULL) {
        Py_DECREF(ticket);
        return NULL;
    }
    PyTypeObject *et = (PyTypeObject *)Event_T;
    PyObject *ev;
    T_AROUND(12, ev = et->tp_alloc(et, 0));
    if (ev == NULL) { /* (out of memory: the handle is dropped, as the Python's would be) */
        Py_DECREF(eh);
        Py_DECREF(ticket);
        return NULL;
    }
#define SET(off, v) Py_XSETREF(SLOT(ev, O.off), Py_NewRef(v))
    SET(ev_device, device);
    SET(ev_stream, wref);
    SET(ev_stream_handle, handle);
    SET(ev_seq, seq);
    SET(ev_handle, eh);
    SET(ev_done, Py_False);
    SET(ev_error, Py_None);
    SET(ev_generation, gen);
    SET(ev_flag, flag);
    SET(ev_ticket, ticket);
#undef SET
    Py_DECREF(eh);
    int made = 0;
    if (f < 0 && direct != NULL) made = record_direct(driver, direct, SLOT(ev, O.ev_handle), handle);
    if (made == 0) {
        PyObject *r = PyObject_CallMethodObjArgs(driver, s_record, SLOT(ev, O.ev_handle), handle, flag, ticket, NULL);
        made = r == NULL ? -1 : 1;
        Py_XDECREF(r);
    }
    Py_DECREF(ticket);
    if (made < 0) {
        Py_DECREF(ev);
        return NULL;
    }
    Py_INCREF(ev);
    T_AROUND(13, Py_XSETREF(SLOT(s, O.s_last_event), ev)); /* (the old event's __del__ may run) */
    return ev;
}

/* ---- the ops' direct launches ------------------------------------------------------ */
/* enqueue_direct(s, cfg, prepared, writes, reads): _submit.direct_enqueue(s,
 * _kernel.enqueue_prepared, (cfg, prepared, writes, reads)) in C, for a replayed op whose
 * recipe is one prepared launch (_ops._core._Recipe.submit_now). The caller holds the
 * runtime lock and has done the checks and set the op's state; ``writes`` / ``reads``
 * are lists of (buffer, tracked) pairs. Arguments of another shape go to the Python,
 * before any effect. Returns the event to wait for, or None. */
static PyObject *py_direct_enqueue, *py_enqueue_prepared;

static int pairs_ok(PyObject *pairs) {
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(pairs); i++) {
        PyObject *it = PyList_GET_ITEM(pairs, i);
        if (!PyTuple_CheckExact(it) || PyTuple_GET_SIZE(it) != 2) return 0;
        PyObject *b = PyTuple_GET_ITEM(it, 0), *t = PyTuple_GET_ITEM(it, 1);
        if (!IS(b, Buffer_T) || (t != Py_True && t != Py_False)) return 0;
        PyObject *w = SLOT(b, O.buf_writer), *rd = SLOT(b, O.buf_readers), *lt = SLOT(b, O.buf_lifetime);
        if (w == NULL || rd == NULL || lt == NULL || !PyDict_CheckExact(rd) || !PyDict_CheckExact(lt)) return 0;
        if (w != Py_None && !(PyTuple_CheckExact(w) && PyTuple_GET_SIZE(w) == 2)) return 0;
    }
    return 1;
}

/* Order the next work on ``s`` after the pending accesses of buffer ``b`` on other
 * streams: its writer, and for a write its readers too (order_accesses, for one). */
static int changed_slot(void) {
    PyErr_SetString(PyExc_SystemError, "_hotpath: a buffer's pending accesses changed type during a submission");
    return -1;
}

static int order_one_held(PyObject *s, PyObject *b, int write);

static int order_one(PyObject *s, PyObject *b, int write) {
    /* held: wait_for runs Python, which may drop the tensor's reference to it */
    Py_INCREF(b);
    int r = order_one_held(s, b, write);
    Py_DECREF(b);
    return r;
}

static int order_one_held(PyObject *s, PyObject *b, int write) {
    PyObject *w = SLOT(b, O.buf_writer), *readers = SLOT(b, O.buf_readers);
    if (w == NULL || readers == NULL || !PyDict_CheckExact(readers) ||
        (w != Py_None && !(PyTuple_CheckExact(w) && PyTuple_GET_SIZE(w) == 2)))
        return changed_slot();
    if (w != Py_None && PyTuple_GET_ITEM(w, 0) != s) {
        Py_INCREF(w);
        int e = wait_for(s, PyTuple_GET_ITEM(w, 0), PyTuple_GET_ITEM(w, 1));
        Py_DECREF(w);
        if (e < 0) return -1;
    }
    if (!write) return 0;
    readers = SLOT(b, O.buf_readers); /* (again: wait_for ran) */
    if (readers == NULL || !PyDict_CheckExact(readers)) return changed_slot();
    if (PyDict_GET_SIZE(readers)) {
        PyObject *items = PyDict_Items(readers);
        if (items == NULL) return -1;
        for (Py_ssize_t m = 0; m < PyList_GET_SIZE(items); m++) {
            PyObject *r = PyList_GET_ITEM(items, m);
            if (PyTuple_GET_ITEM(r, 0) != s && wait_for(s, PyTuple_GET_ITEM(r, 0), PyTuple_GET_ITEM(r, 1)) < 0) {
                Py_DECREF(items);
                return -1;
            }
        }
        Py_DECREF(items);
    }
    return 0;
}

/* Register point ``seq`` of ``s`` as the writer or a reader of buffer ``b`` (untracked:
 * only its lifetime) (note_accesses, for one). */
static int note_one(PyObject *s, PyObject *seq, PyObject *b, int tracked, int write) {
    PyObject *lifetime = SLOT(b, O.buf_lifetime), *readers = SLOT(b, O.buf_readers);
    if (lifetime == NULL || readers == NULL || !PyDict_CheckExact(lifetime) || !PyDict_CheckExact(readers))
        return changed_slot();
    if (!tracked) return PyDict_SetItem(lifetime, s, seq);
    if (!write) return PyDict_SetItem(readers, s, seq);
    PyObject *w = PyTuple_Pack(2, s, seq);
    if (w == NULL) return -1;
    Py_XSETREF(SLOT(b, O.buf_writer), w); /* (the old writer's release may run Python) */
    readers = SLOT(b, O.buf_readers);
    if (readers == NULL || !PyDict_CheckExact(readers)) return changed_slot();
    if (PyDict_GET_SIZE(readers)) PyDict_Clear(readers);
    return 0;
}

static int order_pairs(PyObject *s, PyObject *pairs, int write) {
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(pairs); i++) {
        PyObject *it = PyList_GET_ITEM(pairs, i);
        if (PyTuple_GET_ITEM(it, 1) == Py_True && order_one(s, PyTuple_GET_ITEM(it, 0), write) < 0) return -1;
    }
    return 0;
}

static int note_pairs(PyObject *s, PyObject *seq, PyObject *pairs, int write) {
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(pairs); i++) {
        PyObject *it = PyList_GET_ITEM(pairs, i);
        if (note_one(s, seq, PyTuple_GET_ITEM(it, 0), PyTuple_GET_ITEM(it, 1) == Py_True, write) < 0) return -1;
    }
    return 0;
}

/* _kernel._enqueue_launch(s, device, cfg, args, prepared): a prepared launch on ``s`` (not
 * capturing), ordered after the pending accesses of its buffers on other streams and
 * registered as their writer or reader; the device's launch counted. For arguments
 * checked by shape_ok; ``driver`` is the device's, ``direct`` its direct calls or NULL.
 * Returns the stream's new point (a new reference), or NULL with the error set. */
static PyObject *enqueue_launch(PyObject *s, PyObject *device, PyObject *driver, Direct *direct, PyObject *cfg,
                                PyObject *args, PyObject *prepared) {
    /* held: the calls out below (wait_for, a replaced launch) run Python */
    PyObject *wpos = Py_NewRef(SLOT(cfg, O.cfg_writes)), *rpos = Py_NewRef(SLOT(cfg, O.cfg_reads)),
             *grid = Py_NewRef(SLOT(cfg, O.cfg_grid)), *seq = NULL;
    unsigned long long waits = n_waits_called;
    for (int write = 1; write >= 0; write--) {
        PyObject *pos = write ? wpos : rpos;
        for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(pos); j++) {
            PyObject *t, *b = arg_buffer(args, PyTuple_GET_ITEM(pos, j), write, &t);
            if (b == NULL) goto changed;
            if (SLOT(t, O.tensor_tracked) == Py_True && order_one(s, b, write) < 0) goto failed;
        }
    }
    if (waits != n_waits_called) direct = NULL; /* Python ran (Stream.wait_for): the driver's method, as looked up now */
    int empty = PySequence_Contains(grid, zero);
    if (empty < 0) goto failed;
    if (!empty && launch_prepared(driver, direct, prepared, SLOT(s, O.s_handle)) < 0) goto failed;
    if (add_one(s, O.s_seq) < 0) goto failed;
    seq = Py_NewRef(SLOT(s, O.s_seq));
    for (int write = 1; write >= 0; write--) {
        PyObject *pos = write ? wpos : rpos;
        for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(pos); j++) {
            PyObject *t, *b = arg_buffer(args, PyTuple_GET_ITEM(pos, j), write, &t);
            if (b == NULL) goto changed;
            if (note_one(s, seq, b, SLOT(t, O.tensor_tracked) == Py_True, write) < 0) goto failed;
        }
    }
    {
        /* device._stats.launches += 1 (by attribute for statistics of another class) */
        PyObject *stats = PyObject_GetAttr(device, s_stats);
        if (stats == NULL) goto failed;
        int e;
        if (IS(stats, Counters_T)) {
            e = add_one(stats, O.ctr_launches);
        } else {
            PyObject *v = PyObject_GetAttr(stats, s_launches);
            PyObject *n = v == NULL ? NULL : PyNumber_Add(v, one);
            e = n == NULL ? -1 : PyObject_SetAttr(stats, s_launches, n);
            Py_XDECREF(v);
            Py_XDECREF(n);
        }
        Py_DECREF(stats);
        if (e < 0) goto failed;
    }
    Py_DECREF(wpos);
    Py_DECREF(rpos);
    Py_DECREF(grid);
    return seq;
changed: /* (checked before: only a bug could get here) */
    PyErr_SetString(PyExc_SystemError, "_hotpath: a launch argument changed during its enqueue");
failed:
    Py_XDECREF(seq);
    Py_DECREF(wpos);
    Py_DECREF(rpos);
    Py_DECREF(grid);
    return NULL;
}

static PyObject *enqueue_held(PyObject *s, PyObject *device, PyObject *cfg, PyObject *prepared, PyObject *writes,
                              PyObject *reads);

static PyObject *enqueue_direct(PyObject *module, PyObject *const *argv, Py_ssize_t argc) {
    if (argc != 5) {
        PyErr_SetString(PyExc_TypeError, "enqueue_direct(stream, cfg, prepared, writes, reads)");
        return NULL;
    }
    PyObject *s = argv[0], *cfg = argv[1], *prepared = argv[2], *writes = argv[3], *reads = argv[4];
    PyObject *device = IS(s, Stream_T) ? SLOT(s, O.s_device) : NULL;
    PyObject *grid = IS(cfg, Config_T) ? SLOT(cfg, O.cfg_grid) : NULL;
    PyObject *seq = device != NULL ? SLOT(s, O.s_seq) : NULL;
    if (device == NULL || grid == NULL || !PyTuple_Check(grid) || seq == NULL || !PyLong_CheckExact(seq) ||
        SLOT(s, O.s_done_seq) == NULL || SLOT(s, O.s_handle) == NULL || SLOT(s, O.s_handle) == Py_None ||
        SLOT(s, O.s_keep) == NULL || SLOT(s, O.s_capture) != Py_None ||
        !PyList_CheckExact(writes) || !PyList_CheckExact(reads) || !pairs_ok(writes) || !pairs_ok(reads)) {
        PyObject *arg = PyTuple_Pack(4, cfg, prepared, writes, reads);
        if (arg == NULL) return NULL;
        PyObject *r = PyObject_CallFunctionObjArgs(py_direct_enqueue, s, py_enqueue_prepared, arg, NULL);
        Py_DECREF(arg);
        return r;
    }
    /* held across the calls below */
    Py_INCREF(device);
    Py_INCREF(writes);
    Py_INCREF(reads);
    PyObject *r = enqueue_held(s, device, cfg, prepared, writes, reads);
    Py_DECREF(device);
    Py_DECREF(writes);
    Py_DECREF(reads);
    return r;
}

/* A direct enqueue (_submit.direct_enqueue of one step, under the lock, checked): the
 * flag up, the stream's keep-alives retired, the step ordered after its buffers' pending
 * accesses on other streams, ``step`` (the launch or the call), the stream's new point
 * registered as their writer or reader (a launch counted), the event to wait for (if
 * anything was enqueued that is not known done), the flag down, the submission counted.
 * On an error after the flag went up: counted as failed (direct_failed), the flag down,
 * the error raised. Returns the event or None (new references), NULL on error. */
typedef int (*enqueue_step)(PyObject *s, PyObject *device, PyObject *driver, Direct *direct, void *arg);

static PyObject *enqueue_with(PyObject *s, PyObject *device, PyObject *writes, PyObject *reads, enqueue_step step,
                              void *arg, int launch) {
    PyObject *start = Py_NewRef(SLOT(s, O.s_seq)), *seq = NULL, *ev = NULL, *driver = NULL;
    Direct direct = {NULL, NULL, NULL, NULL, 0};
    int use_direct = 0;
    if (set_submitting(Py_True) < 0) {
        Py_DECREF(start);
        return NULL;
    }
    {
        int r = PyObject_IsTrue(SLOT(s, O.s_keep));
        if (r < 0) goto failed;
        if (r) {
            PyObject *x = PyObject_CallMethodNoArgs(s, s_retire);
            if (x == NULL) goto failed;
            Py_DECREF(x);
        }
    }
    if (order_pairs(s, writes, 1) < 0 || order_pairs(s, reads, 0) < 0) goto failed;
    driver = PyObject_GetAttr(device, s_driver);
    if (driver == NULL) goto failed;
    use_direct = direct_calls(driver, &direct);
    if (use_direct < 0) goto failed;
    if (step(s, device, driver, use_direct ? &direct : NULL, arg) < 0) goto failed;
    if (add_one(s, O.s_seq) < 0) goto failed;
    seq = Py_NewRef(SLOT(s, O.s_seq));
    if (note_pairs(s, seq, writes, 1) < 0 || note_pairs(s, seq, reads, 0) < 0) goto failed;
    if (launch && stats_add(device, O.ctr_launches, s_launches) < 0) goto failed;
    {
        int later = PyObject_RichCompareBool(seq, start, Py_GT);
        if (later > 0) later = PyObject_RichCompareBool(seq, SLOT(s, O.s_done_seq), Py_GT);
        if (later < 0) goto failed;
        ev = later ? event_at(s, device, driver, seq, use_direct ? &direct : NULL) : Py_NewRef(Py_None);
        if (ev == NULL) goto failed;
    }
    Py_CLEAR(direct.hot);
    Py_CLEAR(driver);
    Py_CLEAR(seq);
    Py_CLEAR(start);
    if (set_submitting(Py_False) < 0) goto error;
    if (stats_add(device, O.ctr_submissions, s_submissions) < 0) goto error;
    n_direct_here++;
    return ev;
failed: { /* as direct_enqueue: counted as failed, the flag down, the error raised */
    PyObject *et, *ev_, *tb;
    PyErr_Fetch(&et, &ev_, &tb);
    PyObject *x = PyObject_CallNoArgs(direct_failed);
    if (x == NULL) {
        Py_XDECREF(et);
        Py_XDECREF(ev_);
        Py_XDECREF(tb);
    } else {
        Py_DECREF(x);
        PyErr_Restore(et, ev_, tb);
    }
    PyErr_Fetch(&et, &ev_, &tb);
    if (set_submitting(Py_False) < 0) PyErr_Clear();
    PyErr_Restore(et, ev_, tb);
    Py_XDECREF(direct.hot);
    Py_XDECREF(driver);
    Py_XDECREF(seq);
    Py_XDECREF(start);
    Py_XDECREF(ev);
    return NULL;
}
error:
    Py_XDECREF(ev);
    return NULL;
}

/* _kernel.enqueue_prepared's launch: none for an empty grid. */
static int launch_step(PyObject *s, PyObject *device, PyObject *driver, Direct *direct, void *arg) {
    PyObject **cp = (PyObject **)arg; /* {cfg, prepared} */
    int empty = PySequence_Contains(SLOT(cp[0], O.cfg_grid), zero);
    if (empty < 0) return -1;
    return empty ? 0 : launch_prepared(driver, direct, cp[1], SLOT(s, O.s_handle));
}

static PyObject *enqueue_held(PyObject *s, PyObject *device, PyObject *cfg, PyObject *prepared, PyObject *writes,
                              PyObject *reads) {
    PyObject *cp[2] = {cfg, prepared};
    PyObject *ev = enqueue_with(s, device, writes, reads, launch_step, cp, 1);
    if (ev != NULL) n_enqueues++;
    return ev;
}

/* The cache entry of a launch of these exact arguments on ``device`` (the kernel's
 * ``_fast``: (device, generation, cfg, prepared)), a new reference: the cache may drop it
 * while the caller calls out. NULL without an error: not prepared here (nothing cached,
 * arguments whose key is not made here, another device). Its generation is the caller's
 * to compare. */
static PyObject *prepared_entry(PyObject *k, PyObject *device, PyObject *args) {
    PyObject *key = prepared_key(args);
    if (key == NULL) return NULL;
    PyObject *fast = PyObject_GetAttr(k, s_fast);
    if (fast == NULL) {
        Py_DECREF(key);
        return NULL;
    }
    PyObject *hit = PyDict_CheckExact(fast) ? PyDict_GetItemWithError(fast, key) : NULL;
    Py_XINCREF(hit);
    Py_DECREF(key);
    Py_DECREF(fast);
    if (hit == NULL) return NULL;
    if (!PyTuple_CheckExact(hit) || PyTuple_GET_SIZE(hit) != 4 || PyTuple_GET_ITEM(hit, 0) != device ||
        PyTuple_GET_ITEM(hit, 3) == Py_None || !IS(PyTuple_GET_ITEM(hit, 2), Config_T)) {
        Py_DECREF(hit);
        return NULL;
    }
    return hit;
}

/* ---- submit ----------------------------------------------------------------------- */

static PyObject *delegate(PyObject *op, PyObject *s) {
    n_submits_python++;
    return PyObject_CallFunctionObjArgs(py_submit, op, s, NULL);
}

/* Is everything this file reads there, of the expected types? (Before any effect.) */
static int shape_ok(PyObject *op, PyObject *s, PyObject *cfg, PyObject *args) {
    if (!IS(cfg, Config_T)) return 0;
    PyObject *w = SLOT(cfg, O.cfg_writes), *r = SLOT(cfg, O.cfg_reads), *g = SLOT(cfg, O.cfg_grid);
    if (w == NULL || r == NULL || g == NULL || !PyTuple_Check(w) || !PyTuple_Check(r) || !PyTuple_Check(g)) return 0;
    for (int pass = 0; pass < 2; pass++) {
        PyObject *pos = pass == 0 ? w : r;
        for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(pos); j++) {
            PyObject *t;
            PyObject *b = arg_buffer(args, PyTuple_GET_ITEM(pos, j), pass == 0, &t);
            if (b == NULL || !IS(b, Buffer_T)) return 0;
            PyObject *tracked = SLOT(t, O.tensor_tracked);
            if (tracked != Py_True && tracked != Py_False) return 0;
            PyObject *wr = SLOT(b, O.buf_writer), *rd = SLOT(b, O.buf_readers), *lt = SLOT(b, O.buf_lifetime),
                     *cap = SLOT(b, O.buf_capture);
            if (wr == NULL || rd == NULL || lt == NULL || cap == NULL || !PyDict_CheckExact(rd) || !PyDict_CheckExact(lt))
                return 0;
            if (wr != Py_None && !(PyTuple_CheckExact(wr) && PyTuple_GET_SIZE(wr) == 2)) return 0;
            if (cap != Py_None) return 0; /* recorded by an open capture: the Python path says no */
        }
    }
    PyObject *seq = SLOT(s, O.s_seq), *done = SLOT(s, O.s_done_seq), *h = SLOT(s, O.s_handle);
    if (seq == NULL || done == NULL || h == NULL || h == Py_None || !PyLong_CheckExact(seq)) return 0;
    return 1;
}

static PyObject *submit_held(PyObject *op, PyObject *s, PyObject *args, PyObject *k, PyObject *device);

static PyObject *submit_now(PyObject *op, PyObject *s) {
    if (!IS(op, Launch_T) || !IS(s, Stream_T)) return delegate(op, s);
    PyObject *inputs = SLOT(op, O.op_inputs), *args = SLOT(op, O.op_args), *k = SLOT(op, O.op_kernel),
             *device = SLOT(s, O.s_device);
    if (inputs == NULL || args == NULL || k == NULL || device == NULL || !PyTuple_CheckExact(inputs) ||
        PyTuple_GET_SIZE(inputs) != 0 || !PyTuple_CheckExact(args))
        return delegate(op, s);
    /* held across the calls below (any of them may run other threads) */
    Py_INCREF(args);
    Py_INCREF(k);
    Py_INCREF(device);
    PyObject *r = submit_held(op, s, args, k, device);
    Py_DECREF(args);
    Py_DECREF(k);
    Py_DECREF(device);
    return r;
}

static PyObject *submit_held(PyObject *op, PyObject *s, PyObject *args, PyObject *k, PyObject *device) {
    T_START;
    {
        PyObject *sub = PyObject_GetAttr(tls, s_submitting);
        if (sub == NULL) return NULL;
        int nested = PyObject_IsTrue(sub);
        Py_DECREF(sub);
        if (nested) return nested < 0 ? NULL : delegate(op, s);
    }
    T_MARK(0);
    PyObject *hit = prepared_entry(k, device, args); /* (its generation is compared under the lock) */
    if (hit == NULL) return PyErr_Occurred() ? NULL : delegate(op, s);
    T_MARK(1);
    PyObject *generation = PyTuple_GET_ITEM(hit, 1), *cfg = PyTuple_GET_ITEM(hit, 2),
             *prepared = PyTuple_GET_ITEM(hit, 3);
    PyObject *result = NULL, *ev = NULL, *names = NULL, *name = NULL;
    int locked = 0, flagged = 0, executing_set = 0, use_direct = 0;
    Direct direct = {NULL, NULL, NULL, NULL, 0};
    PyObject *driver = NULL; /* the device's driver, read once */

    if (lock_call(s_acquire) < 0) goto error;
    locked = 1;
    T_MARK(2);
    /* direct_ready(s, generation), inlined as in the Python */
    {
        PyObject *state = SLOT(op, O.op_state);
        if (state == NULL || state != Py_None) goto python;
        PyObject *dgen = PyObject_GetAttr(device, s_generation);
        if (dgen == NULL) goto error;
        int ne = PyObject_RichCompareBool(generation, dgen, Py_NE);
        Py_DECREF(dgen);
        if (ne) goto python_or_error;
        int r = attr_true(device, s_resetting);
        if (r) goto python_or_error;
        driver = PyObject_GetAttr(device, s_driver);
        if (driver == NULL) goto error;
        PyObject *fault = PyObject_GetAttr(driver, s_fault);
        if (fault == NULL) goto error;
        int faulted = fault != Py_None;
        Py_DECREF(fault);
        if (faulted) goto python;
        PyObject *sgen = SLOT(s, O.s_generation), *scap = SLOT(s, O.s_capture), *sdrop = SLOT(s, O.s_dropped);
        if (sgen == NULL || scap == NULL || sdrop == NULL) goto python;
        ne = PyObject_RichCompareBool(sgen, generation, Py_NE);
        if (ne) goto python_or_error;
        if (scap != Py_None || sdrop != Py_False) goto python;
        if (!shape_ok(op, s, cfg, args)) goto python;
        /* deferred work the general path does first: let the Python do it */
        if ((r = attr_true(device, s_dead_buffers)) || (r = attr_true(device, s_dead_streams)) ||
            (r = attr_true(device, s_lingering)) || (r = attr_true(device, s_dead_graphs)))
            goto python_or_error;
        PyObject *keep = SLOT(s, O.s_keep);
        if (keep == NULL) goto python;
        r = PyObject_IsTrue(keep);
        if (r) goto python_or_error;
        PyObject *stats = PyObject_GetAttr(device, s_stats);
        if (stats == NULL) goto error;
        r = IS(stats, Counters_T);
        Py_DECREF(stats);
        if (!r) goto python;
    }
    T_MARK(3);
    use_direct = direct_calls(driver, &direct);
    if (use_direct < 0) goto error;
    T_MARK(4);
    /* the submission: nothing above had an effect */
    Py_INCREF(executing);
    Py_XSETREF(SLOT(op, O.op_state), executing);
    executing_set = 1;
    PyObject *start = SLOT(s, O.s_seq);
    Py_INCREF(start);
    if (set_submitting(Py_True) < 0) {
        Py_DECREF(start);
        goto error;
    }
    flagged = 1;
    T_MARK(5);
    {
        PyObject *seq = enqueue_launch(s, device, driver, use_direct ? &direct : NULL, cfg, args, prepared);
        if (seq == NULL) goto start_failed;
        T_MARK(6);
        /* ev = s.event_at(seq) if seq > start and seq > s.done_seq else None */
        int later = PyObject_RichCompareBool(seq, start, Py_GT);
        if (later > 0) later = PyObject_RichCompareBool(seq, SLOT(s, O.s_done_seq), Py_GT);
        if (later < 0) goto seq_failed;
        if (later) {
            ev = event_at(s, device, driver, seq, use_direct ? &direct : NULL);
            if (ev == NULL) goto seq_failed;
        } else {
            ev = Py_NewRef(Py_None);
        }
        Py_DECREF(seq);
        Py_DECREF(start);
        T_MARK(7);
        goto enqueued;
    seq_failed:
        Py_DECREF(seq);
    start_failed:
        Py_DECREF(start);
        goto failed;
    }
enqueued:
    flagged = 0;
    if (set_submitting(Py_False) < 0) goto error;
    {
        PyObject *stats = PyObject_GetAttr(device, s_stats);
        if (stats == NULL) goto error;
        int e = add_one(stats, O.ctr_submissions);
        Py_DECREF(stats);
        if (e < 0) goto error;
        n_direct_here++;
    }
    T_MARK(8);
    locked = 0;
    if (lock_call(s_release) < 0) goto error;
    T_MARK(9);
    name = PyObject_GetAttr(k, s_name);
    if (name == NULL) goto error;
    names = PyList_New(1);
    if (names == NULL) goto error;
    PyList_SET_ITEM(names, 0, name);
    name = NULL;
    result = PyTuple_Pack(3, args, ev, names);
    n_submits++;
    Py_XDECREF(direct.hot);
    Py_XDECREF(driver);
    Py_DECREF(names);
    Py_DECREF(ev);
    Py_DECREF(hit);
    T_MARK(10);
    return result;

failed: { /* direct_failed(), as the Python does on any error of the enqueue */
    PyObject *et, *ev_, *tb;
    PyErr_Fetch(&et, &ev_, &tb);
    PyObject *r = PyObject_CallNoArgs(direct_failed);
    if (r == NULL) {
        Py_XDECREF(et);
        Py_XDECREF(ev_);
        Py_XDECREF(tb);
    } else {
        Py_DECREF(r);
        PyErr_Restore(et, ev_, tb);
    }
    goto error;
}
python_or_error:
    if (PyErr_Occurred()) goto error;
python:
    /* nothing was done: the Python path decides (it takes the lock again) */
    Py_CLEAR(direct.hot);
    Py_CLEAR(driver);
    if (lock_call(s_release) < 0) {
        Py_DECREF(hit);
        return NULL;
    }
    Py_DECREF(hit);
    return delegate(op, s);
error: {
    PyObject *et, *ev_, *tb;
    PyErr_Fetch(&et, &ev_, &tb);
    if (flagged) {
        if (set_submitting(Py_False) < 0) PyErr_Clear();
    }
    if (locked) {
        if (lock_call(s_release) < 0) PyErr_Clear();
    }
    PyErr_Restore(et, ev_, tb);
    (void)executing_set;
    Py_XDECREF(direct.hot);
    Py_XDECREF(driver);
    Py_XDECREF(name);
    Py_XDECREF(ev);
    Py_DECREF(hit);
    return NULL;
}
}

/* op._submit_now(stream), the method that replaces the Python one */
static PyObject *submit_method(PyObject *op, PyObject *const *argv, Py_ssize_t argc) {
    if (argc != 1) {
        PyErr_SetString(PyExc_TypeError, "_submit_now(stream)");
        return NULL;
    }
    return submit_now(op, argv[0]);
}

static PyMethodDef submit_def = {"_submit_now", (PyCFunction)(void (*)(void))submit_method, METH_FASTCALL,
                                 "_Launch._submit_now, compiled (trio_cuda/_hotpath.c)."};

/* ---- the ops' direct submissions ---------------------------------------------------- */
/* ``TensorOp._submit_now`` (trio_cuda/_ops/_core.py) with ``_Recipe.submit_now``: a lone
 * op replayed from a recipe whose one step is a prepared kernel launch (enqueued as
 * enqueue_direct above) or a prepared step of another kind (a GEMM: its function,
 * through _submit.direct_enqueue), on its operands only. The same checks in the same
 * order, under the same lock; every other case (a step not prepared yet, arguments of
 * other classes) goes to the Python before any effect. Bound by setup_ops. */
static PyObject *TensorOp_T, *Recipe_T, *Step_T, *py_op_submit, *core_counts, *py_make, *py_direct_tidy, *s_hits;
static PyObject *empty_tuple; /* (set at import, below) */
static struct {
    Py_ssize_t top_args, top_hit, rec_device, rec_direct, rec_generation, rec_ops, rec_result, rec_uses, st_kernel,
        st_prepared, st_cfg, st_writes, st_reads, st_ready;
} Q;
static unsigned long long n_op_submits, n_op_submits_python;

static PyObject *op_delegate(PyObject *op, PyObject *s) {
    n_op_submits_python++;
    return PyObject_CallFunctionObjArgs(py_op_submit, op, s, NULL);
}

/* _ops._core._buffers(args, sources): [(args[i]._buffer, args[i]._tracked if t is None
 * else t) for i, t in sources], for tensors of exactly the runtime's class. NULL without
 * an error: not handled here. */
static PyObject *op_pairs(PyObject *args, PyObject *sources) {
    if (!PyTuple_CheckExact(sources)) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(sources);
    PyObject *list = PyList_New(n);
    if (list == NULL) return NULL;
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *src = PyTuple_GET_ITEM(sources, j);
        if (!PyTuple_CheckExact(src) || PyTuple_GET_SIZE(src) != 2 || !PyLong_CheckExact(PyTuple_GET_ITEM(src, 0)))
            goto unhandled;
        Py_ssize_t i = PyLong_AsSsize_t(PyTuple_GET_ITEM(src, 0));
        if (i < 0 || i >= PyTuple_GET_SIZE(args)) {
            PyErr_Clear();
            goto unhandled;
        }
        PyObject *a = PyTuple_GET_ITEM(args, i), *t = PyTuple_GET_ITEM(src, 1);
        if (!IS(a, Tensor_T)) goto unhandled;
        PyObject *b = SLOT(a, O.tensor_buffer), *tracked = t == Py_None ? SLOT(a, O.tensor_tracked) : t;
        if (b == NULL || tracked == NULL) goto unhandled;
        Py_INCREF(b); /* (an allocation may collect garbage, and a finalizer run Python) */
        Py_INCREF(tracked);
        PyObject *pair = PyTuple_Pack(2, b, tracked);
        Py_DECREF(b);
        Py_DECREF(tracked);
        if (pair == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, j, pair);
    }
    return list;
unhandled:
    Py_DECREF(list);
    return NULL;
}

static int dict_add_one(PyObject *d, PyObject *key) { /* d[key] += 1 */
    PyObject *v = PyDict_GetItemWithError(d, key);
    if (v == NULL) {
        if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, key); /* (as d[key] += 1) */
        return -1;
    }
    PyObject *n = PyNumber_Add(v, one);
    if (n == NULL) return -1;
    int r = PyDict_SetItem(d, key, n);
    Py_DECREF(n);
    return r;
}

/* 1 if ``a`` and ``b`` differ (a != b), 0 if not, -1 on error. */
static int differ(PyObject *a, PyObject *b) {
    if (a == b) return 0;
    return PyObject_RichCompareBool(a, b, Py_NE);
}

/* _submit.direct_ready(s, generation) under the lock: 1 ready, 0 not, -1 error. */
static int op_direct_ready(PyObject *s, PyObject *device, PyObject *generation) {
    PyObject *dgen = PyObject_GetAttr(device, s_generation);
    if (dgen == NULL) return -1;
    int r = differ(generation, dgen);
    Py_DECREF(dgen);
    if (r) return r < 0 ? -1 : 0;
    if ((r = attr_true(device, s_resetting))) return r < 0 ? -1 : 0;
    PyObject *driver = PyObject_GetAttr(device, s_driver);
    if (driver == NULL) return -1;
    PyObject *fault = PyObject_GetAttr(driver, s_fault);
    Py_DECREF(driver);
    if (fault == NULL) return -1;
    int faulted = fault != Py_None;
    Py_DECREF(fault);
    if (faulted) return 0;
    PyObject *sgen = SLOT(s, O.s_generation), *scap = SLOT(s, O.s_capture), *sdrop = SLOT(s, O.s_dropped);
    if (sgen == NULL || scap == NULL || sdrop == NULL) {
        PyErr_SetString(PyExc_AttributeError, "_hotpath: a stream's slot is unset");
        return -1;
    }
    if ((r = differ(sgen, generation))) return r < 0 ? -1 : 0;
    if (scap != Py_None) return 0;
    Py_INCREF(sdrop);
    r = PyObject_IsTrue(sdrop);
    Py_DECREF(sdrop);
    if (r) return r < 0 ? -1 : 0;
    if ((r = attr_true(device, s_dead_buffers)) || (r = attr_true(device, s_dead_streams)) ||
        (r = attr_true(device, s_lingering)) || (r = attr_true(device, s_dead_graphs))) {
        if (r < 0) return -1;
        PyObject *x = PyObject_CallOneArg(py_direct_tidy, device);
        if (x == NULL) return -1;
        Py_DECREF(x);
    }
    return 1;
}

/* Whether the memory of ``args[i]`` for i in ``uses`` may be used as it is (allocated,
 * not recorded by a capture, of the device's generation), read as the Python reads it
 * (attributes in its order; any class): 1, 0 (the general path says why), -1 error. */
static int op_uses_ok(PyObject *args, PyObject *uses) {
    static const char *what[] = {"ptr", "capture", "generation", "device"};
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(uses); j++) {
        PyObject *ix = PyTuple_GET_ITEM(uses, j);
        Py_ssize_t i = PyLong_AsSsize_t(ix);
        if (i == -1 && PyErr_Occurred()) return -1;
        if (i < 0) i += PyTuple_GET_SIZE(args);
        if (i < 0 || i >= PyTuple_GET_SIZE(args)) {
            PyErr_SetString(PyExc_IndexError, "tuple index out of range");
            return -1;
        }
        PyObject *a = PyTuple_GET_ITEM(args, i), *b, *v[4] = {NULL, NULL, NULL, NULL};
        if (IS(a, Tensor_T)) {
            b = Py_XNewRef(SLOT(a, O.tensor_buffer));
            if (b == NULL) b = PyObject_GetAttrString(a, "_buffer"); /* (unset: raises as the Python) */
        } else {
            b = PyObject_GetAttrString(a, "_buffer");
        }
        if (b == NULL) return -1;
        int r = 1;
        if (IS(b, Buffer_T)) { /* its slots, each held (what follows may run Python) */
            Py_ssize_t offs[4] = {O.buf_ptr, O.buf_capture, O.buf_generation, O.buf_device};
            for (int m = 0; m < 4; m++) v[m] = Py_XNewRef(SLOT(b, offs[m]));
        }
        /* b.ptr is None or b.capture is not None or b.generation != b.device.generation */
        for (int m = 0; m < 4 && r == 1; m++) {
            if (v[m] == NULL && (v[m] = PyObject_GetAttrString(b, what[m])) == NULL) r = -1;
            else if (m == 0 && v[0] == Py_None) r = 0;
            else if (m == 1 && v[1] != Py_None) r = 0;
        }
        if (r == 1) {
            PyObject *dgen = PyObject_GetAttr(v[3], s_generation);
            if (dgen == NULL) r = -1;
            else {
                int ne = differ(v[2], dgen);
                Py_DECREF(dgen);
                r = ne < 0 ? -1 : !ne;
            }
        }
        for (int m = 0; m < 4; m++) Py_XDECREF(v[m]);
        Py_DECREF(b);
        if (r != 1) return r;
    }
    return 1;
}

/* _core's functions the Python submission calls, as bound at setup (a test or a tool
 * that replaced one sees the Python run): 1 yes, 0 no, -1 error. */
static PyObject *kernel_globals; /* _kernel's module dict (set by setup) */
static PyObject *core_globals, *submit_globals, *py_direct_ready, *py_buffers, *hot_enqueue_direct;
static int global_is(PyObject *globals, const char *name, PyObject *fn) {
    PyObject *v = PyDict_GetItemString(globals, name);
    return v == fn;
}
static int op_functions_own(void) {
    return global_is(core_globals, "direct_ready", py_direct_ready) && global_is(core_globals, "_make", py_make) &&
           global_is(core_globals, "direct_enqueue", py_direct_enqueue) &&
           global_is(core_globals, "_buffers", py_buffers) &&
           global_is(submit_globals, "direct_tidy", py_direct_tidy) &&
           global_is(kernel_globals, "enqueue_direct", hot_enqueue_direct);
}

/* _submit.direct_enqueue(s, _matmul._gemm_direct, (static, writes, reads)) in C, for
 * a replayed op whose recipe is one prepared GEMM (under the lock, checked; writes and
 * reads lists of (buffer, tracked) pairs): ordered after the pending accesses of its
 * buffers on other streams, the backend's matmul called (Python: the library call or
 * its replayed graph), the stream's point registered as their writer or reader. Bound
 * by set_gemm_step; used only while _matmul's order_accesses and note_accesses are the
 * ones bound. Returns the event to wait for, or None. */
static PyObject *py_gemm_step, *matmul_globals, *py_order_accesses, *py_note_accesses, *s__foreign_streams,
    *s__foreign, *s_matmul;
static unsigned long long n_gemms;

static int gemm_step_own(PyObject *fn) {
    return py_gemm_step != NULL && fn == py_gemm_step && global_is(matmul_globals, "order_accesses", py_order_accesses) &&
           global_is(matmul_globals, "note_accesses", py_note_accesses);
}

static PyObject *s__gemms, *s_replay, *s_graphs, *s__graph_pfn, *s_replays;
static unsigned long long n_gemm_replays;
typedef int (*graph_launch_fn)(void *exec, void *stream);

/* The replay branch of the CUDA backend's matmul (CudaDevice.matmul with reuse, not
 * capturing, not foreign; trio_cuda/_backends/_cuda.py) for a call whose graph is kept:
 * the key (desc, a, b, d, bias, int(stream)) looked up in the backend's Gemms.graphs,
 * moved to the most recently used end, its graph launched straight through the driver's
 * cuGraphLaunch, Gemms.replays counted. 1 launched; 0 not here (direct calls off, the
 * backend's matmul replaced, replays off, no such graph, a launch the driver refused:
 * the Python method then makes the call, which captures, launches or raises; a refused
 * launch enqueued nothing); -1 an error raised. Under the runtime lock. */
static int gemm_replay(PyObject *driver, Direct *direct, PyObject *stat, PyObject *handle) {
    if (direct == NULL || !PyTuple_CheckExact(stat) || PyTuple_GET_SIZE(stat) != 5) return 0;
    PyObject *dict = PyObject_GenericGetDict(driver, NULL);
    if (dict == NULL) PyErr_Clear();
    int rep = replaced(driver, dict, s_matmul, PyTuple_GET_ITEM(direct->hot, 3));
    Py_XDECREF(dict);
    if (rep) return 0;
    int result = -1;
    PyObject *gemms = NULL, *graphs = NULL, *pfn = NULL, *hi = NULL, *key = NULL, *g = NULL;
    if ((gemms = PyObject_GetAttr(driver, s__gemms)) == NULL) goto out;
    int on = attr_true(gemms, s_replay);
    if (on <= 0) {
        result = on < 0 ? -1 : 0;
        goto out;
    }
    if ((graphs = PyObject_GetAttr(gemms, s_graphs)) == NULL || (pfn = PyObject_GetAttr(driver, s__graph_pfn)) == NULL)
        goto out;
    result = 0;
    if (!PyDict_CheckExact(graphs) || !PyLong_CheckExact(pfn)) goto out;
    void *launch = PyLong_AsVoidPtr(pfn);
    if (launch == NULL) { /* (0: no entry point; the Python launches through cuda.bindings) */
        PyErr_Clear();
        goto out;
    }
    result = -1;
    if ((hi = PyNumber_Long(handle)) == NULL) goto out;
    key = PyTuple_Pack(6, PyTuple_GET_ITEM(stat, 0), PyTuple_GET_ITEM(stat, 1), PyTuple_GET_ITEM(stat, 2),
                       PyTuple_GET_ITEM(stat, 3), PyTuple_GET_ITEM(stat, 4), hi);
    if (key == NULL) goto out;
    g = Py_XNewRef(PyDict_GetItemWithError(graphs, key));
    if (g == NULL) {
        result = PyErr_Occurred() ? -1 : 0; /* not kept: the Python captures it (or calls the library) */
        goto out;
    }
    result = 0;
    if (!PyTuple_CheckExact(g) || PyTuple_GET_SIZE(g) != 2 || !PyLong_CheckExact(PyTuple_GET_ITEM(g, 0))) goto out;
    void *exec = PyLong_AsVoidPtr(PyTuple_GET_ITEM(g, 0)), *stream = PyLong_AsVoidPtr(hi);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        goto out;
    }
    result = -1;
    /* the most recently used last: eviction takes the first (as graphs.pop + insert) */
    if (PyDict_DelItem(graphs, key) < 0 || PyDict_SetItem(graphs, key, g) < 0) goto out;
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = ((graph_launch_fn)launch)(exec, stream);
    Py_END_ALLOW_THREADS
    if (err) { /* refused: the Python launches again and says what it means */
        result = 0;
        goto out;
    }
    PyObject *r = PyObject_GetAttr(gemms, s_replays), *r1 = r == NULL ? NULL : PyNumber_Add(r, one);
    Py_XDECREF(r);
    if (r1 == NULL) goto out;
    int set = PyObject_SetAttr(gemms, s_replays, r1);
    Py_DECREF(r1);
    if (set < 0) goto out;
    n_gemm_replays++;
    result = 1;
out:
    Py_XDECREF(gemms);
    Py_XDECREF(graphs);
    Py_XDECREF(pfn);
    Py_XDECREF(hi);
    Py_XDECREF(key);
    Py_XDECREF(g);
    return result;
}

/* _gemm_direct's call: desc, a, b, d, bias = static; capturing None if another
 * library's stream was ever wrapped, else False; replayed as a graph unless so. */
static int gemm_step(PyObject *s, PyObject *device, PyObject *driver, Direct *direct, void *arg) {
    PyObject *stat = (PyObject *)arg;
    int foreign = attr_true(device, s__foreign_streams);
    if (foreign < 0) return -1;
    PyObject *sforeign = PyObject_GetAttr(s, s__foreign);
    if (sforeign == NULL) return -1;
    if (!foreign) { /* reuse, not capturing: the kept graph, launched here if it may be */
        int sf = PyObject_IsTrue(sforeign);
        PyObject *handle = sf ? NULL : Py_XNewRef(SLOT(s, O.s_handle));
        int r = sf < 0 ? -1 : (handle == NULL ? 0 : gemm_replay(driver, direct, stat, handle));
        Py_XDECREF(handle);
        if (r != 0) {
            Py_DECREF(sforeign);
            return r < 0 ? -1 : 0;
        }
    }
    PyObject *mm = PyObject_GetAttr(driver, s_matmul);
    if (mm == NULL) {
        Py_DECREF(sforeign);
        return -1;
    }
    PyObject *argv[9] = {PyTuple_GET_ITEM(stat, 0), PyTuple_GET_ITEM(stat, 1), PyTuple_GET_ITEM(stat, 2),
                         PyTuple_GET_ITEM(stat, 3), PyTuple_GET_ITEM(stat, 4), SLOT(s, O.s_handle),
                         foreign ? Py_None : Py_False, sforeign, foreign ? Py_False : Py_True};
    Py_INCREF(argv[5]); /* (the stream's handle, held across the call) */
    PyObject *x = PyObject_Vectorcall(mm, argv, 9, NULL);
    Py_DECREF(argv[5]);
    Py_DECREF(sforeign);
    Py_DECREF(mm);
    if (x == NULL) return -1;
    Py_DECREF(x);
    return 0;
}

static PyObject *gemm_enqueue(PyObject *s, PyObject *device, PyObject *stat, PyObject *writes, PyObject *reads) {
    PyObject *ev = enqueue_with(s, device, writes, reads, gemm_step, stat, 0);
    if (ev != NULL) n_gemms++;
    return ev;
}

/* set_gemm_step(fn, matmul_globals): the GEMM step function (_matmul._gemm_direct) whose
 * direct submissions gemm_enqueue makes, and its module's globals (its
 * order_accesses and note_accesses must stay the ones bound now). */
static PyObject *set_gemm_step(PyObject *module, PyObject *const *argv, Py_ssize_t argc) {
    if (argc != 2 || !PyCallable_Check(argv[0]) || !PyDict_Check(argv[1])) {
        PyErr_SetString(PyExc_TypeError, "set_gemm_step(fn, module_globals)");
        return NULL;
    }
    PyObject *oa = PyDict_GetItemString(argv[1], "order_accesses"), *na = PyDict_GetItemString(argv[1], "note_accesses");
    if (oa == NULL || na == NULL) {
        PyErr_SetString(PyExc_KeyError, "set_gemm_step: the module has no order_accesses / note_accesses");
        return NULL;
    }
    Py_XSETREF(py_order_accesses, Py_NewRef(oa));
    Py_XSETREF(py_note_accesses, Py_NewRef(na));
    Py_XSETREF(matmul_globals, Py_NewRef(argv[1]));
    Py_XSETREF(py_gemm_step, Py_NewRef(argv[0]));
    Py_RETURN_NONE;
}

static PyObject *op_submit_held(PyObject *op, PyObject *s, PyObject *hit, PyObject *st, PyObject *args,
                                PyObject *device);

static PyObject *op_submit(PyObject *op, PyObject *s) {
    if (!PyObject_TypeCheck(op, (PyTypeObject *)TensorOp_T) || !IS(s, Stream_T) || !op_functions_own())
        return op_delegate(op, s);
    {
        /* _tls.submitting first: reading it may run Python, and nothing is read yet (the
         * Python answers None for a nested submission as for the checks below) */
        PyObject *sub = PyObject_GetAttr(tls, s_submitting);
        if (sub == NULL) return NULL;
        int nested = PyObject_IsTrue(sub);
        Py_DECREF(sub);
        if (nested) {
            if (nested < 0) return NULL;
            Py_RETURN_NONE;
        }
    }
    PyObject *hit = SLOT(op, Q.top_hit);
    if (hit == NULL) return op_delegate(op, s);
    if (hit == Py_None) Py_RETURN_NONE;
    if (!IS(hit, Recipe_T)) return op_delegate(op, s);
    PyObject *st = SLOT(hit, Q.rec_direct), *args = SLOT(op, Q.top_args), *device = SLOT(s, O.s_device);
    if (st == NULL || args == NULL || device == NULL) return op_delegate(op, s);
    if (st == Py_None) Py_RETURN_NONE;
    if (!IS(st, Step_T) || !PyTuple_CheckExact(args)) return op_delegate(op, s);
    /* held from here on (what follows may run Python, which may change the slots) */
    Py_INCREF(hit);
    Py_INCREF(st);
    Py_INCREF(args);
    Py_INCREF(device);
    PyObject *r = op_submit_held(op, s, hit, st, args, device);
    Py_DECREF(hit);
    Py_DECREF(st);
    Py_DECREF(args);
    Py_DECREF(device);
    return r;
}

static PyObject *op_submit_held(PyObject *op, PyObject *s, PyObject *hit, PyObject *st, PyObject *args,
                                PyObject *device) {
    PyObject *writes = NULL, *reads = NULL, *ev = NULL, *res = NULL, *gen = NULL, *uses = NULL, *cfg = NULL,
             *prepared = NULL, *ready = NULL, *spec = NULL, *ops = NULL, *out = NULL, *k = NULL, *rdev = NULL,
             *wsrc = NULL, *rsrc = NULL;
    int locked = 0, kernel = 0;
    PyObject **fields[] = {&gen, &uses, &spec, &ops, &rdev, &k, &cfg, &prepared, &ready, &wsrc, &rsrc};
    PyObject *objs[] = {hit, hit, hit, hit, hit, st, st, st, st, st, st};
    Py_ssize_t offs[] = {Q.rec_generation, Q.rec_uses, Q.rec_result, Q.rec_ops, Q.rec_device, Q.st_kernel,
                         Q.st_cfg, Q.st_prepared, Q.st_ready, Q.st_writes, Q.st_reads};
    for (int m = 0; m < 11; m++) *fields[m] = Py_XNewRef(SLOT(objs[m], offs[m]));
    for (int m = 0; m < 11; m++)
        if (*fields[m] == NULL) goto python_unlocked;
    if (rdev != device) goto none;
    kernel = k != Py_None;
    if (kernel && prepared == Py_None) goto none;
    if (!kernel && !(PyTuple_CheckExact(ready) && PyTuple_GET_SIZE(ready) == 2))
        goto python_unlocked; /* a step of another kind, not prepared (yet) */
    if (!PyTuple_CheckExact(uses) || !PyTuple_CheckExact(spec)) goto python_unlocked;
    writes = op_pairs(args, wsrc);
    reads = writes == NULL ? NULL : op_pairs(args, rsrc);
    if (reads == NULL) {
        if (PyErr_Occurred()) goto done;
        goto python_unlocked;
    }
    if (lock_call(s_acquire) < 0) goto done;
    locked = 1;
    {
        PyObject *state = SLOT(op, O.op_state);
        if (state == NULL) goto python;
        if (state != Py_None) goto none;
        int r = op_direct_ready(s, device, gen); /* (may free memory first: an effect) */
        if (r < 0) goto done;
        if (r == 0) goto none;
        r = op_uses_ok(args, uses);
        if (r < 0) goto done;
        if (r == 0) goto none;
    }
    /* the submission */
    Py_INCREF(executing);
    Py_XSETREF(SLOT(op, O.op_state), executing);
    if (dict_add_one(core_counts, s_hits) < 0) goto done;
    if (kernel) {
        PyObject *argv[5] = {s, cfg, prepared, writes, reads};
        ev = enqueue_direct(NULL, argv, 5);
    } else if (gemm_step_own(PyTuple_GET_ITEM(ready, 0)) && pairs_ok(writes) && pairs_ok(reads) &&
               PyTuple_CheckExact(PyTuple_GET_ITEM(ready, 1)) && PyTuple_GET_SIZE(PyTuple_GET_ITEM(ready, 1)) == 5 &&
               SLOT(s, O.s_seq) != NULL && PyLong_CheckExact(SLOT(s, O.s_seq)) && SLOT(s, O.s_done_seq) != NULL &&
               SLOT(s, O.s_keep) != NULL && SLOT(s, O.s_handle) != NULL && SLOT(s, O.s_capture) == Py_None) {
        ev = gemm_enqueue(s, device, PyTuple_GET_ITEM(ready, 1), writes, reads);
    } else {
        PyObject *arg = PyTuple_Pack(3, PyTuple_GET_ITEM(ready, 1), writes, reads);
        if (arg == NULL) goto done;
        ev = PyObject_CallFunctionObjArgs(py_direct_enqueue, s, PyTuple_GET_ITEM(ready, 0), arg, NULL);
        Py_DECREF(arg);
    }
    if (ev == NULL) goto done;
    locked = 0;
    if (lock_call(s_release) < 0) goto done;
    /* _make(self.result, args, ()): an operand itself, here; any other spec, the Python's */
    {
        int overflow = 0;
        long kind = PyTuple_GET_SIZE(spec) == 2 && PyLong_CheckExact(PyTuple_GET_ITEM(spec, 0))
                        ? PyLong_AsLongAndOverflow(PyTuple_GET_ITEM(spec, 0), &overflow)
                        : -1;
        Py_ssize_t p = kind == 0 && !overflow && PyLong_CheckExact(PyTuple_GET_ITEM(spec, 1))
                           ? PyLong_AsSsize_t(PyTuple_GET_ITEM(spec, 1))
                           : -1;
        if (PyErr_Occurred()) goto done;
        if (p >= 0 && p < PyTuple_GET_SIZE(args)) res = Py_NewRef(PyTuple_GET_ITEM(args, p));
        else if ((res = PyObject_CallFunctionObjArgs(py_make, spec, args, empty_tuple, NULL)) == NULL) goto done;
    }
    out = PyTuple_Pack(3, res, ev, ops);
    if (out != NULL) n_op_submits++;
    goto done;
none:
    out = Py_NewRef(Py_None);
    goto done;
python:
    /* (only before any effect: nothing under the lock ran yet) */
    locked = 0;
    if (lock_call(s_release) < 0) goto done;
python_unlocked:
    out = op_delegate(op, s);
done:
    if (locked) {
        PyObject *et, *ev_, *tb;
        PyErr_Fetch(&et, &ev_, &tb);
        if (lock_call(s_release) < 0) {
            if (et != NULL) PyErr_Clear(); /* the first error wins */
            else {
                PyErr_Fetch(&et, &ev_, &tb);
                Py_CLEAR(out);
            }
        }
        PyErr_Restore(et, ev_, tb);
    }
    Py_XDECREF(writes);
    Py_XDECREF(reads);
    Py_XDECREF(ev);
    Py_XDECREF(res);
    for (int m = 0; m < 11; m++) Py_XDECREF(*fields[m]);
    return out;
}

static PyObject *op_submit_method(PyObject *op, PyObject *const *argv, Py_ssize_t argc) {
    if (argc != 1) {
        PyErr_SetString(PyExc_TypeError, "_submit_now(stream)");
        return NULL;
    }
    return op_submit(op, argv[0]);
}

static PyMethodDef op_submit_def = {"_submit_now", (PyCFunction)(void (*)(void))op_submit_method, METH_FASTCALL,
                                    "TensorOp._submit_now, compiled (trio_cuda/_hotpath.c)."};

/* _ops._core._op_key(op, args) for the common arguments: tensors whose kernel descriptor
 * is cached, None, bool, int, str, float and tuples of ints; any other argument (a
 * tensor without its descriptor yet, numpy scalars and dtypes, ...) goes to the Python
 * function, which has no effect but that cache. */
static PyObject *py_op_key;

static PyObject *op_key(PyObject *module, PyObject *const *argv, Py_ssize_t argc) {
    if (argc != 2 || !PyTuple_CheckExact(argv[1])) {
        if (py_op_key == NULL) {
            PyErr_SetString(PyExc_TypeError, "op_key(op, args): setup_ops() first, args a tuple");
            return NULL;
        }
        return PyObject_Vectorcall(py_op_key, argv, argc, NULL);
    }
    PyObject *op = argv[0], *args = argv[1];
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    PyObject *key = PyTuple_New(n + 2);
    if (key == NULL) return NULL;
    PyObject *name = PyObject_GetAttr(op, s_name);
    if (name == NULL) {
        Py_DECREF(key);
        return NULL;
    }
    PyTuple_SET_ITEM(key, 0, Py_NewRef((PyObject *)Py_TYPE(op)));
    PyTuple_SET_ITEM(key, 1, name);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *a = PyTuple_GET_ITEM(args, i), *k = NULL;
        PyTypeObject *t = Py_TYPE(a);
        if (IS(a, Tensor_T)) {
            PyObject *d = SLOT(a, O.tensor_args);
            if (d == NULL || !PyTuple_CheckExact(d) || PyTuple_GET_SIZE(d) < 1) goto python;
            k = Py_NewRef(PyTuple_GET_ITEM(d, 0));
        } else if (a == Py_None || t == &PyBool_Type || t == &PyLong_Type || t == &PyUnicode_Type) {
            k = PyTuple_Pack(2, (PyObject *)t, a);
        } else if (t == &PyFloat_Type) {
            k = scalar_key(a);
        } else if (t == &PyTuple_Type) {
            for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(a); j++)
                if (!PyLong_CheckExact(PyTuple_GET_ITEM(a, j))) goto python;
            k = PyTuple_Pack(2, (PyObject *)t, a);
        } else {
            goto python;
        }
        if (k == NULL) {
            Py_DECREF(key);
            return NULL;
        }
        PyTuple_SET_ITEM(key, i + 2, k);
    }
    return key;
python:
    Py_DECREF(key);
    return PyObject_Vectorcall(py_op_key, argv, argc, NULL);
}

/* ---- the general path: planning and running a plan's steps ------------------------- */
/* Three pieces of _submit.Plan's walk of a DAG (the chain ``inc(op.first())`` repeated,
 * awaited once, is all of them):
 * - ``_Launch._plan(plan, lane, values)``: a launch of arguments prepared before on this
 *   device, whose memory this plan may use as it is, planned as its prepared step;
 * - ``walk(plan, work, values)``: Plan._walk's loop over frames of _Launch and _Select
 *   ops; it leaves any other frame on top of ``work`` and returns False (the Python
 *   walks that one frame, then calls it again), True when the walk is done;
 * - ``run_steps(steps)``: Plan._run_steps without a trace; a prepared launch step is
 *   enqueued here, any other step is called.
 * Every case not handled goes to the Python before any effect. */
static PyObject *Lane_T, *Select_T, *Continue_T, *py_plan, *py_select_plan, *py_prepared_step, *py_enqueue_launch;

/* Is _kernel's global ``name`` still ``fn`` (not replaced by a test's or a tool's
 * wrapper, which the Python would call)? 1, 0, or -1 on error. */
static int kernel_global_is(PyObject *name, PyObject *fn) {
    PyObject *v = PyDict_GetItemWithError(kernel_globals, name);
    if (v == NULL) return PyErr_Occurred() ? -1 : 0;
    return v == fn;
}
static PyObject *plan_descr; /* the compiled _Launch._plan, as installed on the class */

static PyObject *plan_delegate(PyObject *op, PyObject *plan, PyObject *lane, PyObject *values) {
    n_plans_python++;
    return PyObject_CallFunctionObjArgs(py_plan, op, plan, lane, values, NULL);
}

/* May this plan use buffer ``b`` as it is (allocated, not recorded by a capture, of its
 * device's generation), with no plan.use? 1 yes, 0 no or not known here, -1 error. */
static int buffer_ready(PyObject *b) {
    if (b == NULL || !IS(b, Buffer_T)) return 0;
    PyObject *ptr = SLOT(b, O.buf_ptr), *cap = SLOT(b, O.buf_capture), *gen = SLOT(b, O.buf_generation),
             *dev = SLOT(b, O.buf_device);
    if (ptr == NULL || cap == NULL || gen == NULL || dev == NULL || ptr == Py_None || cap != Py_None) return 0;
    Py_INCREF(gen);
    PyObject *dgen = PyObject_GetAttr(dev, s_generation);
    int ne = dgen == NULL ? -1 : PyObject_RichCompareBool(gen, dgen, Py_NE);
    Py_DECREF(gen);
    Py_XDECREF(dgen);
    return ne < 0 ? -1 : !ne;
}

/* The launch's arguments with its input values in place (as _Launch._plan makes them): a
 * new reference; NULL without an error: not handled here. */
static PyObject *merged_args(PyObject *op, PyObject *args, PyObject *values) {
    Py_ssize_t nv = PyTuple_CheckExact(values) ? PyTuple_GET_SIZE(values) : PyList_GET_SIZE(values);
    if (nv == 0) return Py_NewRef(args);
    PyObject *pos = SLOT(op, O.launch_inputs_at);
    if (pos == NULL || !PyTuple_CheckExact(pos)) return NULL;
    Py_ssize_t np = PyTuple_GET_SIZE(pos), n = PyTuple_GET_SIZE(args), m = np == 1 ? 1 : (np < nv ? np : nv);
    PyObject *full = PyTuple_New(n);
    if (full == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) PyTuple_SET_ITEM(full, i, Py_NewRef(PyTuple_GET_ITEM(args, i)));
    for (Py_ssize_t j = 0; j < m; j++) {
        PyObject *pj = PyTuple_GET_ITEM(pos, j);
        Py_ssize_t i = PyLong_CheckExact(pj) ? PyLong_AsSsize_t(pj) : -1;
        if (i < 0 || i >= n) {
            PyErr_Clear();
            Py_DECREF(full);
            return NULL;
        }
        PyObject *v = PyTuple_CheckExact(values) ? PyTuple_GET_ITEM(values, j) : PyList_GET_ITEM(values, j);
        Py_SETREF(PyTuple_GET_ITEM(full, i), Py_NewRef(v));
    }
    return full;
}

static PyObject *launch_plan_full(PyObject *op, PyObject *plan, PyObject *lane, PyObject *values, PyObject *k,
                                  PyObject *device, PyObject *full);

/* _Launch._plan(plan, lane, values), compiled */
static PyObject *launch_plan(PyObject *op, PyObject *plan, PyObject *lane, PyObject *values) {
    if (!IS(op, Launch_T) || !IS(lane, Lane_T) || !(PyTuple_CheckExact(values) || PyList_CheckExact(values)))
        return plan_delegate(op, plan, lane, values);
    PyObject *args = SLOT(op, O.op_args), *k = SLOT(op, O.op_kernel), *device = SLOT(lane, O.lane_device);
    if (args == NULL || k == NULL || device == NULL || !PyTuple_CheckExact(args))
        return plan_delegate(op, plan, lane, values);
    PyObject *full = merged_args(op, args, values);
    if (full == NULL) return PyErr_Occurred() ? NULL : plan_delegate(op, plan, lane, values);
    Py_INCREF(k);
    Py_INCREF(device);
    PyObject *r = launch_plan_full(op, plan, lane, values, k, device, full);
    Py_DECREF(k);
    Py_DECREF(device);
    Py_DECREF(full);
    return r;
}

static PyObject *launch_plan_full(PyObject *op, PyObject *plan, PyObject *lane, PyObject *values, PyObject *k,
                                  PyObject *device, PyObject *full) {
    PyObject *hit = prepared_entry(k, device, full), *steps = NULL, *ops = NULL, *inner = NULL, *step = NULL, *name = NULL;
    if (hit == NULL) return PyErr_Occurred() ? NULL : plan_delegate(op, plan, lane, values);
    {
        /* prepared for the device's generation of now (as _Launch._plan asks) */
        PyObject *dgen = PyObject_GetAttr(device, s_generation);
        int eq = dgen == NULL ? -1 : PyObject_RichCompareBool(PyTuple_GET_ITEM(hit, 1), dgen, Py_EQ);
        Py_XDECREF(dgen);
        if (eq <= 0) {
            Py_DECREF(hit);
            return eq < 0 ? NULL : plan_delegate(op, plan, lane, values);
        }
    }
    PyObject *cfg = PyTuple_GET_ITEM(hit, 2), *prepared = PyTuple_GET_ITEM(hit, 3);
    PyObject *wpos = Py_XNewRef(SLOT(cfg, O.cfg_writes)), *rpos = Py_XNewRef(SLOT(cfg, O.cfg_reads));
    if (wpos == NULL || rpos == NULL || !PyTuple_CheckExact(wpos) || !PyTuple_CheckExact(rpos)) goto python;
    {
        /* the step the Python would plan: _kernel._prepared_step, unless replaced */
        int same = kernel_global_is(s__prepared_step, py_prepared_step);
        if (same < 0) goto error;
        if (!same) goto python;
    }
    {
        PyObject *cap = PyObject_GetAttr(plan, s_capture);
        if (cap == NULL) goto error;
        int capturing = cap != Py_None;
        Py_DECREF(cap);
        if (capturing) goto python;
    }
    /* memory the plan must take in hand (plan.use): the Python does it */
    for (int write = 1; write >= 0; write--) {
        PyObject *pos = write ? wpos : rpos;
        for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(pos); j++) {
            PyObject *t;
            int ok = buffer_ready(arg_buffer(full, PyTuple_GET_ITEM(pos, j), write, &t));
            if (ok < 0) goto error;
            if (!ok) goto python;
        }
    }
    steps = PyObject_GetAttr(plan, s_steps);
    ops = steps == NULL ? NULL : PyObject_GetAttr(plan, s_ops);
    name = ops == NULL ? NULL : PyObject_GetAttr(k, s_name);
    if (name == NULL) goto error;
    if (!PyList_CheckExact(steps) || !PyList_CheckExact(ops)) goto python;
    inner = PyTuple_Pack(3, cfg, full, prepared);
    step = inner == NULL ? NULL : PyTuple_Pack(3, py_prepared_step, lane, inner);
    if (step == NULL || PyList_Append(steps, step) < 0 || PyList_Append(ops, name) < 0) goto error;
    n_plans++;
    Py_DECREF(wpos);
    Py_DECREF(rpos);
    Py_DECREF(hit);
    Py_DECREF(steps);
    Py_DECREF(ops);
    Py_DECREF(name);
    Py_DECREF(inner);
    Py_DECREF(step);
    return Py_NewRef(full);
python:
    Py_XDECREF(wpos);
    Py_XDECREF(rpos);
    Py_DECREF(hit);
    Py_XDECREF(steps);
    Py_XDECREF(ops);
    Py_XDECREF(name);
    return plan_delegate(op, plan, lane, values);
error:
    Py_XDECREF(wpos);
    Py_XDECREF(rpos);
    Py_DECREF(hit);
    Py_XDECREF(steps);
    Py_XDECREF(ops);
    Py_XDECREF(name);
    Py_XDECREF(inner);
    Py_XDECREF(step);
    return NULL;
}

static PyObject *plan_method(PyObject *op, PyObject *const *argv, Py_ssize_t argc) {
    if (argc != 3) {
        PyErr_SetString(PyExc_TypeError, "_plan(plan, lane, values)");
        return NULL;
    }
    return launch_plan(op, argv[0], argv[1], argv[2]);
}

static PyMethodDef plan_def = {"_plan", (PyCFunction)(void (*)(void))plan_method, METH_FASTCALL,
                               "_Launch._plan, compiled (trio_cuda/_hotpath.c)."};

/* op._plan(plan, lane, values) of an op the walk handles */
static PyObject *plan_op(PyObject *op, PyObject *plan, PyObject *ln, PyObject *vals) {
    if (IS(op, Launch_T)) return launch_plan(op, plan, ln, vals);
    /* _Select._plan: the common case (an element of a launch's tuple) here */
    Py_ssize_t nv = PyTuple_CheckExact(vals) ? PyTuple_GET_SIZE(vals) : PyList_GET_SIZE(vals);
    PyObject *index = SLOT(op, O.sel_index), *expect = SLOT(op, O.sel_expect);
    if (nv >= 1 && index != NULL && expect == Py_None && PyLong_CheckExact(index)) {
        PyObject *v = PyTuple_CheckExact(vals) ? PyTuple_GET_ITEM(vals, 0) : PyList_GET_ITEM(vals, 0);
        if (PyTuple_CheckExact(v) && PyTuple_GET_SIZE(v)) return PyObject_GetItem(v, index);
    }
    return PyObject_CallFunctionObjArgs(py_select_plan, op, plan, ln, vals, NULL);
}

static int push_frame(PyObject *work, PyObject *op, PyObject *ln, Py_ssize_t n) {
    PyObject *nn = PyLong_FromSsize_t(n);
    PyObject *fr = nn == NULL ? NULL : PyTuple_Pack(3, op, ln, nn);
    Py_XDECREF(nn);
    if (fr == NULL) return -1;
    int r = PyList_Append(work, fr);
    Py_DECREF(fr);
    return r;
}

static PyObject *walk_frames(PyObject *plan, PyObject *work, PyObject *values, PyObject *claimed, int launch_ok,
                             int select_ok);

/* walk(plan, work, values): see above */
static PyObject *walk(PyObject *module, PyObject *const *argv, Py_ssize_t argc) {
    if (argc != 3) {
        PyErr_SetString(PyExc_TypeError, "walk(plan, work, values)");
        return NULL;
    }
    PyObject *plan = argv[0], *work = argv[1], *values = argv[2];
    if (!PyList_CheckExact(work) || !PyList_CheckExact(values)) Py_RETURN_FALSE;
    /* the ops' methods as installed (a test or a tool may replace them) */
    int launch_ok = plan_descr != NULL && _PyType_Lookup((PyTypeObject *)Launch_T, s__plan) == plan_descr;
    int select_ok = _PyType_Lookup((PyTypeObject *)Select_T, s__plan) == py_select_plan;
    if (!launch_ok && !select_ok) Py_RETURN_FALSE;
    PyObject *claimed = PyObject_GetAttr(plan, s_claimed);
    if (claimed == NULL) return NULL;
    PyObject *r = PyList_CheckExact(claimed) ? walk_frames(plan, work, values, claimed, launch_ok, select_ok)
                                             : Py_NewRef(Py_False);
    Py_DECREF(claimed);
    return r;
}

#define HANDLED(o) ((launch_ok && IS(o, Launch_T)) || (select_ok && IS(o, Select_T)))

static PyObject *walk_frames(PyObject *plan, PyObject *work, PyObject *values, PyObject *claimed, int launch_ok,
                             int select_ok) {
    while (PyList_GET_SIZE(work)) {
        Py_ssize_t top = PyList_GET_SIZE(work) - 1;
        PyObject *fr = PyList_GET_ITEM(work, top);
        if (!PyTuple_CheckExact(fr) || PyTuple_GET_SIZE(fr) != 3 || !HANDLED(PyTuple_GET_ITEM(fr, 0)) ||
            !PyLong_CheckExact(PyTuple_GET_ITEM(fr, 2)))
            goto handback;
        Py_ssize_t n = PyLong_AsSsize_t(PyTuple_GET_ITEM(fr, 2));
        if (n == 0 || (n == -1 && PyErr_Occurred()) || n < -1) {
            PyErr_Clear();
            goto handback;
        }
        PyObject *op = Py_NewRef(PyTuple_GET_ITEM(fr, 0)), *ln = Py_NewRef(PyTuple_GET_ITEM(fr, 1));
        if (PyList_SetSlice(work, top, top + 1, NULL) < 0) goto error;
        for (;;) {
            PyObject *r;
            if (n < 0) {
                PyObject *state = SLOT(op, O.op_state), *inputs = SLOT(op, O.op_inputs);
                if (state != Py_None || inputs == NULL || !PyTuple_CheckExact(inputs)) {
                    /* executed, shared, or not what this expects: the Python says */
                    if (push_frame(work, op, ln, -1) < 0) goto error;
                    Py_DECREF(op);
                    Py_DECREF(ln);
                    goto handback;
                }
                Py_INCREF(executing);
                Py_XSETREF(SLOT(op, O.op_state), executing);
                if (PyList_Append(claimed, op) < 0) goto error;
                Py_ssize_t k = PyTuple_GET_SIZE(inputs);
                if (k) {
                    /* (the ops handled here do not fork: checked at setup) */
                    Py_INCREF(inputs); /* held: the pushes allocate (a collection may run finalizers) */
                    int e = push_frame(work, op, ln, k);
                    if (e == 0 && k == 1) {
                        PyObject *nxt = PyTuple_GET_ITEM(inputs, 0);
                        if (HANDLED(nxt)) {
                            Py_SETREF(op, Py_NewRef(nxt));
                            Py_DECREF(inputs);
                            continue;
                        }
                        e = push_frame(work, nxt, ln, -1);
                    } else {
                        for (Py_ssize_t i = k - 1; e == 0 && i >= 0; i--) e = push_frame(work, PyTuple_GET_ITEM(inputs, i), ln, -1);
                    }
                    Py_DECREF(inputs);
                    if (e < 0) goto error;
                    break;
                }
                r = plan_op(op, plan, ln, empty_tuple);
            } else {
                Py_ssize_t size = PyList_GET_SIZE(values), lo = size - n;
                if (n == 1 && size == 0) {
                    PyErr_SetString(PyExc_IndexError, "pop from empty list");
                    goto error;
                }
                if (lo < 0) lo = 0;
                PyObject *vals = n == 1 ? PyTuple_Pack(1, PyList_GET_ITEM(values, size - 1))
                                        : PyList_GetSlice(values, lo, size);
                if (vals == NULL || PyList_SetSlice(values, lo, size, NULL) < 0) {
                    Py_XDECREF(vals);
                    goto error;
                }
                r = plan_op(op, plan, ln, vals);
                Py_DECREF(vals);
            }
            if (r == NULL) goto error;
            if (IS(r, Continue_T)) {
                PyObject *nxt = SLOT(r, O.cont_op);
                if (nxt == NULL) {
                    Py_DECREF(r);
                    PyErr_SetString(PyExc_AttributeError, "op");
                    goto error;
                }
                Py_SETREF(op, Py_NewRef(nxt));
                Py_DECREF(r);
                n = -1;
                if (HANDLED(op)) continue;
                if (push_frame(work, op, ln, -1) < 0) goto error;
                break;
            }
            int e = PyList_Append(values, r);
            Py_DECREF(r);
            if (e < 0) goto error;
            break;
        error:
            Py_DECREF(op);
            Py_DECREF(ln);
            return NULL;
        }
        Py_DECREF(op);
        Py_DECREF(ln);
    }
    Py_RETURN_TRUE;
handback:
    n_handbacks++;
    Py_RETURN_FALSE;
}
#undef HANDLED

/* run_steps(steps): see above */
static PyObject *run_steps(PyObject *module, PyObject *steps) {
    if (!PyList_CheckExact(steps)) {
        PyErr_SetString(PyExc_TypeError, "run_steps(list)");
        return NULL;
    }
    PyObject *device = NULL, *driver = NULL; /* of the last prepared step (owned) */
    Direct direct = {NULL, NULL, NULL, NULL, 0};
    int use_direct = 0;
    /* _prepared_step enqueues through _kernel._enqueue_launch: a wrapper put there is
     * called, through the step */
    int own = kernel_global_is(s__enqueue_launch, py_enqueue_launch);
    if (own < 0) return NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(steps); i++) {
        PyObject *st = PyList_GET_ITEM(steps, i);
        if (!PyTuple_CheckExact(st) || PyTuple_GET_SIZE(st) != 3) {
            PyErr_SetString(PyExc_ValueError, "_hotpath: a plan step is not (fn, lane, arg)");
            goto error;
        }
        Py_INCREF(st);
        PyObject *fn = PyTuple_GET_ITEM(st, 0), *lane = PyTuple_GET_ITEM(st, 1), *arg = PyTuple_GET_ITEM(st, 2);
        PyObject *s = IS(lane, Lane_T) ? SLOT(lane, O.lane_stream) : NULL;
        PyObject *dev = IS(lane, Lane_T) ? SLOT(lane, O.lane_device) : NULL;
        if (own && fn == py_prepared_step && s != NULL && dev != NULL && IS(s, Stream_T) && PyTuple_CheckExact(arg) &&
            PyTuple_GET_SIZE(arg) == 3 && PyTuple_CheckExact(PyTuple_GET_ITEM(arg, 1)) &&
            shape_ok(NULL, s, PyTuple_GET_ITEM(arg, 0), PyTuple_GET_ITEM(arg, 1))) {
            if (dev != device) {
                Py_CLEAR(direct.hot);
                Py_XSETREF(driver, PyObject_GetAttr(dev, s_driver));
                Py_XSETREF(device, Py_NewRef(dev));
                if (driver == NULL) {
                    Py_DECREF(st);
                    goto error;
                }
                use_direct = direct_calls(driver, &direct);
                if (use_direct < 0) {
                    Py_DECREF(st);
                    goto error;
                }
            }
            Py_INCREF(s); /* (the step holds the lane, the lane its stream: held anyway) */
            unsigned long long waits = n_waits_called;
            PyObject *seq = enqueue_launch(s, dev, driver, use_direct ? &direct : NULL, PyTuple_GET_ITEM(arg, 0),
                                           PyTuple_GET_ITEM(arg, 1), PyTuple_GET_ITEM(arg, 2));
            Py_DECREF(s);
            Py_DECREF(st);
            if (seq == NULL) goto error;
            Py_DECREF(seq);
            n_steps++;
            if (waits != n_waits_called) { /* Python ran (Stream.wait_for): the driver's methods are looked up again */
                Py_CLEAR(direct.hot);
                Py_CLEAR(driver);
                Py_CLEAR(device);
            }
            continue;
        }
        /* any other step: called, as the Python loop calls it (it may change what the
         * device's driver is: looked up again after it) */
        Py_CLEAR(direct.hot);
        Py_CLEAR(driver);
        Py_CLEAR(device);
        PyObject *r = PyObject_CallFunctionObjArgs(fn, lane, arg, NULL);
        Py_DECREF(st);
        if (r == NULL) goto error;
        Py_DECREF(r);
        n_steps_python++;
    }
    Py_XDECREF(direct.hot);
    Py_XDECREF(driver);
    Py_XDECREF(device);
    Py_RETURN_NONE;
error:
    Py_XDECREF(direct.hot);
    Py_XDECREF(driver);
    Py_XDECREF(device);
    return NULL;
}

/* ---- poll ------------------------------------------------------------------------- */

/* a.<slot> = max(a.<slot>, v) for ints */
static int raise_to(PyObject *o, Py_ssize_t off, PyObject *v) {
    PyObject *cur = SLOT(o, off);
    if (cur == NULL) {
        PyErr_SetString(PyExc_AttributeError, "_hotpath: a stream point is unset");
        return -1;
    }
    int lt = PyObject_RichCompareBool(cur, v, Py_LT);
    if (lt <= 0) return lt;
    Py_INCREF(v);
    Py_SETREF(SLOT(o, off), v);
    return 0;
}

static PyObject *poll_delegate(PyObject *dev, PyObject *ev) {
    n_polls_python++;
    return PyObject_CallFunctionObjArgs(py_poll, dev, ev, NULL);
}

/* Device.poll(ev) for an event without a completion word (see _device.Device.poll):
 * the answer from the stream, or one driver query. Every other case (done with an
 * error, a completion word, a reset, a query that failed, the stream's newest event to
 * ask about first) is handed, before any effect, to the Python method. */
static PyObject *poll_held(PyObject *dev, PyObject *ev, PyObject *flag, PyObject *egen, PyObject *eseq, PyObject *wref,
                           PyObject *handle);

static PyObject *poll_method(PyObject *dev, PyObject *const *argv, Py_ssize_t argc) {
    if (argc != 1) {
        PyErr_SetString(PyExc_TypeError, "poll(event)");
        return NULL;
    }
    PyObject *ev = argv[0];
    if (!IS(ev, Event_T) || !IS(dev, Device_T)) return poll_delegate(dev, ev);
    PyObject *done = SLOT(ev, O.ev_done), *err = SLOT(ev, O.ev_error), *flag = SLOT(ev, O.ev_flag),
             *egen = SLOT(ev, O.ev_generation), *eseq = SLOT(ev, O.ev_seq), *wref = SLOT(ev, O.ev_stream),
             *handle = SLOT(ev, O.ev_handle);
    if (done == NULL || err == NULL || flag == NULL || egen == NULL || eseq == NULL || wref == NULL || handle == NULL)
        return poll_delegate(dev, ev);
    if (done == Py_True && err == Py_None) {
        n_polls++;
        Py_RETURN_TRUE;
    }
    if (done != Py_False) return poll_delegate(dev, ev);
    /* held across the calls below */
    Py_INCREF(egen);
    Py_INCREF(eseq);
    Py_INCREF(wref);
    Py_INCREF(handle);
    PyObject *r = poll_held(dev, ev, flag, egen, eseq, wref, handle);
    Py_DECREF(egen);
    Py_DECREF(eseq);
    Py_DECREF(wref);
    Py_DECREF(handle);
    return r;
}

static PyObject *poll_held(PyObject *dev, PyObject *ev, PyObject *flag, PyObject *egen, PyObject *eseq, PyObject *wref,
                           PyObject *handle) {
    if (!PyLong_CheckExact(flag) || !PyWeakref_CheckRef(wref)) return poll_delegate(dev, ev);
    long f = PyLong_AsLong(flag);
    if (f == -1 && PyErr_Occurred()) return NULL;
    if (f >= 0) return poll_delegate(dev, ev); /* a completion word: the Python reads it */
    T_START;
    if (lock_call(s_acquire) < 0) return NULL;
    T_MARK(32);
    PyObject *result = NULL;
    PyObject *s = NULL, *driver = NULL;
    {
        PyObject *dgen = PyObject_GetAttr(dev, s_generation);
        if (dgen == NULL) goto error;
        int ne = PyObject_RichCompareBool(egen, dgen, Py_NE);
        Py_DECREF(dgen);
        if (ne) goto python_or_error; /* reset since it was recorded: the Python raises */
        s = PyWeakref_GetObject(wref);
        if (s == NULL) goto error;
        Py_INCREF(s);
        if (s != Py_None && !IS(s, Stream_T)) goto python;
        driver = PyObject_GetAttr(dev, s_driver);
        if (driver == NULL) goto error;
        if (s != Py_None) {
            PyObject *pbs = PyDict_GetItemWithError(device_globals, s_poll_by_stream);
            if (pbs == NULL) goto python_or_error;
            int by_stream = PyObject_IsTrue(pbs);
            if (by_stream < 0) goto error;
            if (by_stream) {
                int r = attr_true(dev, s_cross_device);
                if (r < 0) goto error;
                by_stream = !r;
            }
            if (by_stream) {
                PyObject *sgen = SLOT(s, O.s_generation);
                if (sgen == NULL) goto python;
                int eq = PyObject_RichCompareBool(sgen, egen, Py_EQ);
                if (eq < 0) goto error;
                by_stream = eq;
            }
            if (by_stream) {
                PyObject *fault = PyObject_GetAttr(driver, s_fault);
                if (fault == NULL) goto error;
                by_stream = fault == Py_None;
                Py_DECREF(fault);
            }
            if (by_stream) {
                PyObject *ok = SLOT(s, O.s_ok_seq);
                if (ok == NULL) goto python;
                int le = PyObject_RichCompareBool(eseq, ok, Py_LE);
                if (le < 0) goto error;
                if (le) {
                    Py_XSETREF(SLOT(ev, O.ev_done), Py_NewRef(Py_True));
                    result = Py_NewRef(Py_True);
                    goto out;
                }
                PyObject *last = SLOT(s, O.s_last_event);
                if (last == NULL) goto python;
                if (last != Py_None && !IS(last, Event_T)) goto python;
                if (last != Py_None && last != ev) {
                    /* The Python asks about the stream's newest event first (_newest_done)
                     * when: last.seq > ev.seq, last.seq != s._newest_pending, not
                     * last.done, last.generation == ev.generation, s.capture is None.
                     * Then the Python does it; otherwise the event's own query, here. */
                    PyObject *lseq = SLOT(last, O.ev_seq), *np_ = SLOT(s, O.s_newest_pending),
                             *ldone = SLOT(last, O.ev_done), *lgen = SLOT(last, O.ev_generation),
                             *scap = SLOT(s, O.s_capture);
                    if (lseq == NULL || np_ == NULL || ldone == NULL || lgen == NULL || scap == NULL) goto python;
                    int ask = PyObject_RichCompareBool(lseq, eseq, Py_GT);
                    if (ask > 0) ask = PyObject_RichCompareBool(lseq, np_, Py_NE);
                    if (ask > 0) ask = ldone == Py_False;
                    if (ask > 0) ask = PyObject_RichCompareBool(lgen, egen, Py_EQ);
                    if (ask > 0) ask = scap == Py_None;
                    if (ask) goto python_or_error;
                }
            }
        }
        /* The query: straight through the driver's entry point, or (no direct calls
         * here) the Python method does it, with everything around it. */
        Direct direct;
        T_MARK(33);
        int dc = direct_calls(driver, &direct);
        if (dc < 0) goto error;
        if (dc == 0) goto python;
        T_MARK(34);
        int isdone = query_direct(&direct, handle);
        Py_DECREF(direct.hot);
        T_MARK(35);
        /* An answer other than done or pending (a fault, a refused query): the Python
         * asks again and says what it means (a query changes nothing on the device). */
        if (isdone == 2) goto python;
        if (isdone == 0) { /* pending: unless the device faulted (the Python raises that) */
            PyObject *fault = PyObject_GetAttr(driver, s_fault);
            if (fault == NULL) goto error;
            int faulted = fault != Py_None;
            Py_DECREF(fault);
            if (faulted) goto python;
        }
        if (isdone) {
            Py_XSETREF(SLOT(ev, O.ev_done), Py_NewRef(Py_True));
            if (s != Py_None && (raise_to(s, O.s_done_seq, eseq) < 0 || raise_to(s, O.s_ok_seq, eseq) < 0)) goto error;
            result = Py_NewRef(Py_True);
        } else {
            result = Py_NewRef(Py_False);
        }
        goto out;
    }
python_or_error:
    if (PyErr_Occurred()) goto error;
python:
    Py_XDECREF(s);
    Py_XDECREF(driver);
    if (lock_call(s_release) < 0) return NULL;
    return poll_delegate(dev, ev);
error:
    Py_XDECREF(s);
    Py_XDECREF(driver);
    {
        PyObject *et, *ev_, *tb;
        PyErr_Fetch(&et, &ev_, &tb);
        if (lock_call(s_release) < 0) PyErr_Clear();
        PyErr_Restore(et, ev_, tb);
    }
    return NULL;
out:
    n_polls++;
    Py_XDECREF(s);
    Py_XDECREF(driver);
    T_MARK(36);
    if (lock_call(s_release) < 0) {
        Py_DECREF(result);
        return NULL;
    }
    T_MARK(37);
    return result;
}

static PyMethodDef poll_def = {"poll", (PyCFunction)(void (*)(void))poll_method, METH_FASTCALL,
                               "poll($self, ev, /)\n--\n\nTrue if ``ev`` has completed (non-blocking; any thread).\n\n"
                               "Raises:\n    DeviceReset: The device was reset after the event was recorded.\n"
                               "    DeviceFault: The work before the event failed, or the device faulted.\n\n"
                               "(Compiled: trio_cuda/_hotpath.c; TRIO_CUDA_HOTPATH=0 runs the Python method.)"};

/* ---- await ------------------------------------------------------------------------ */

/* ``DeviceOp.__await__`` (trio_cuda/_submit.py, await_op) as an iterator in C: trio's
 * cancel check, the direct submission, trio's trap and the poll after it, with
 * await_op's checks in its order. Any other case is handed to the Python and then
 * driven as ``yield from`` drives it: before any effect, to await_op itself (outside
 * trio, trio's traps switched off, a cancelled task, an object this file does not
 * know); the general path, to _run_planned; after the submission, to await_rest (a
 * wait that goes on past the first poll, the process's first wait, a cancel found
 * after trio's pass). Bound by setup_calls, which checks trio's classes' slots; a trio
 * whose internals differ keeps the Python generator. */

static PyObject *run_context, *trap, *Value_T, *DeviceOp_T, *DeviceError_T, *Task_T, *CancelStatus_T, *Runner_T, *traps_globals,
    *submit_globals, *trace_globals, *notifier_globals, *py_current_device, *py_await, *py_await_rest,
    *py_raise_named, *py_run_planned, *py_clock;
static Py_ssize_t task_status_off, task_runner_off, task_points_off, status_cancelled_off, runner_ki_off,
    runner_main_off;
static PyObject *s_task, *s_unwrap, *s_on, *s_direct_on, *s_active, *s__budget_ns, *s__paths, *s__submit_now,
    *s__submission_stream, *s_reached, *s_poll, *s_throw, *s_close, *s_gi_frame, *s_cr_frame, *s_gi_yieldfrom,
    *s_cr_await;
/* awaits begun here, handed to await_op before any effect, handed to await_rest */
static unsigned long long n_awaits, n_awaits_python, n_awaits_rest;

enum { A_START, A_FINAL, A_PASSED, A_SUB, A_DONE };

typedef struct {
    PyObject_HEAD
    int state;
    int running; /* (a generator's "already executing") */
    int named;   /* an error raised now is in await_op's ``try``: a DeviceError is named */
    PyObject *op, *stream, *value, *ev, *names, *started, *sub;
} Await;

static void await_finish(Await *a) {
    a->state = A_DONE;
    Py_CLEAR(a->op);
    Py_CLEAR(a->stream);
    Py_CLEAR(a->value);
    Py_CLEAR(a->ev);
    Py_CLEAR(a->names);
    Py_CLEAR(a->started);
    Py_CLEAR(a->sub);
}

/* The error set now (normalized, its traceback attached): a new reference, cleared. */
static PyObject *fetch_error(void) {
    PyObject *type, *val, *tb;
    PyErr_Fetch(&type, &val, &tb);
    PyErr_NormalizeException(&type, &val, &tb);
    if (tb != NULL && val != NULL) PyException_SetTraceback(val, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    return val;
}

/* The error set now gets ``old`` as its cause (if ``cause``) and its context, as a raise
 * inside ``except`` makes it (set in place: PyErr_SetObject would chain the exception
 * the caller is handling instead). */
static void chain_error(PyObject *old, int cause) {
    PyObject *type, *val, *tb;
    PyErr_Fetch(&type, &val, &tb);
    PyErr_NormalizeException(&type, &val, &tb);
    if (val != NULL) {
        if (cause) PyException_SetCause(val, Py_NewRef(old));
        PyException_SetContext(val, Py_NewRef(old));
    }
    PyErr_Restore(type, val, tb);
}

/* The error raised now ends the await, as it would end await_op: a StopIteration
 * becomes RuntimeError (PEP 479: a generator's return is not an error), and a
 * DeviceError inside its ``try`` is named after the submission's ops. */
static PySendResult await_fail(Await *a) {
    if (PyErr_ExceptionMatches(PyExc_StopIteration)) {
        PyObject *val = fetch_error();
        PyErr_SetString(PyExc_RuntimeError, "generator raised StopIteration");
        if (val != NULL) {
            chain_error(val, 1);
            Py_DECREF(val);
        }
    } else if (a->named && a->names != NULL && a->stream != NULL && PyErr_ExceptionMatches(DeviceError_T)) {
        PyObject *val = fetch_error();
        PyObject *r = PyObject_CallFunctionObjArgs(py_raise_named, val, a->names, a->stream, NULL);
        if (r != NULL) {
            Py_DECREF(r);
            PyErr_SetString(PyExc_SystemError, "_hotpath: raise_named returned");
        }
        if (val != NULL) {
            chain_error(val, 0);
            Py_DECREF(val);
        }
    }
    await_finish(a);
    return PYGEN_ERROR;
}

static PySendResult sub_send(Await *a, PyObject *arg, PyObject **result) {
    PySendResult r = PyIter_Send(a->sub, arg, result);
    if (r != PYGEN_NEXT) await_finish(a);
    return r;
}

/* Drive ``sub`` (a new reference: a generator or coroutine just made) from now on. */
static PySendResult hand_over(Await *a, PyObject *sub, PyObject **result) {
    if (sub == NULL) {
        await_finish(a);
        return PYGEN_ERROR;
    }
    Py_XSETREF(a->sub, sub);
    a->state = A_SUB;
    return sub_send(a, Py_None, result);
}

static PySendResult to_python(Await *a, PyObject **result) {
    n_awaits_python++;
    return hand_over(a, PyObject_CallFunctionObjArgs(py_await, a->op, a->stream, NULL), result);
}

static PySendResult to_planned(Await *a, PyObject **result) {
    return hand_over(a, PyObject_CallFunctionObjArgs(py_run_planned, a->op, a->stream, NULL), result);
}

static PySendResult to_rest(Await *a, PyObject *started, int stage, PyObject **result) {
    n_awaits_rest++;
    PyObject *st = PyLong_FromLong(stage);
    PyObject *sub = st == NULL ? NULL
                               : PyObject_CallFunctionObjArgs(py_await_rest, a->value, a->ev, a->names, a->stream,
                                                              started, st, NULL);
    Py_XDECREF(st);
    return hand_over(a, sub, result);
}

static PySendResult yield_trap(Await *a, int state, PyObject **result) {
    a->state = state;
    *result = Py_NewRef(trap);
    return PYGEN_NEXT;
}

static PySendResult give_value(Await *a, PyObject **result) {
    *result = Py_NewRef(a->value);
    await_finish(a);
    return PYGEN_RETURN;
}

/* A module's global (borrowed), or NULL with the AttributeError its Python raises. */
static PyObject *module_global(PyObject *globals, PyObject *name) {
    PyObject *v = PyDict_GetItemWithError(globals, name);
    if (v == NULL && !PyErr_Occurred())
        PyErr_Format(PyExc_AttributeError, "module %R has no attribute %R", PyDict_GetItemString(globals, "__name__"),
                     name);
    return v;
}

/* A module global's truth: 1, 0, -1 (error). */
static int global_true(PyObject *globals, PyObject *name) {
    PyObject *v = module_global(globals, name);
    return v == NULL ? -1 : PyObject_IsTrue(v);
}

/* trio's current task (new reference), or NULL without an error outside trio. */
static PyObject *current_task(void) {
    PyObject *t = PyObject_GetAttr(run_context, s_task);
    if (t == NULL && PyErr_ExceptionMatches(PyExc_AttributeError)) PyErr_Clear();
    return t;
}

/* trio's cancel check of ``task`` (_traps.after_pass without the count): 0 go on,
 * 1 cancelled (or a KeyboardInterrupt pending for the main task), 2 not what this file
 * knows (the Python decides). */
static int task_cancelled(PyObject *task) {
    if (!IS(task, Task_T)) return 2;
    PyObject *status = SLOT(task, task_status_off), *runner = SLOT(task, task_runner_off);
    if (status == NULL || runner == NULL || !IS(status, CancelStatus_T) || !IS(runner, Runner_T)) return 2;
    PyObject *c = SLOT(status, status_cancelled_off), *ki = SLOT(runner, runner_ki_off);
    if (c == Py_True) return 1;
    if (c != Py_False || (ki != Py_True && ki != Py_False)) return 2;
    if (ki == Py_False) return 0;
    PyObject *main = SLOT(runner, runner_main_off);
    return main == NULL ? 2 : main == task;
}

/* The cancel check, counted as trio counts it when it passes: 0, 1 or 2 as above, -1. */
static int cancel_check(void) {
    PyObject *task = current_task();
    if (task == NULL) return PyErr_Occurred() ? -1 : 2;
    int c = task_cancelled(task);
    if (c == 0 && add_one(task, task_points_off) < 0) c = -1;
    Py_DECREF(task);
    return c;
}

static int call_true(PyObject *dev, PyObject *name, PyObject *ev) { /* dev.<name>(ev): 1, 0, -1 */
    PyObject *r = PyObject_CallMethodOneArg(dev, name, ev);
    if (r == NULL) return -1;
    int t = PyObject_IsTrue(r);
    Py_DECREF(r);
    return t;
}

static int count_fast_path(void) { /* _notifier._paths[0] += 1 */
    PyObject *paths = module_global(notifier_globals, s__paths);
    if (paths == NULL) return -1;
    Py_INCREF(paths);
    PyObject *v = PySequence_GetItem(paths, 0);
    PyObject *n = v == NULL ? NULL : PyNumber_Add(v, one);
    int r = n == NULL ? -1 : PySequence_SetItem(paths, 0, n);
    Py_XDECREF(v);
    Py_XDECREF(n);
    Py_DECREF(paths);
    return r;
}

/* ev's device, polled: 1 complete (counted on the fast path), 0 pending, -1 */
static int poll_counted(PyObject *ev) {
    PyObject *dev = SLOT(ev, O.ev_device);
    if (dev == NULL) {
        PyErr_SetString(PyExc_AttributeError, "_hotpath: an event without a device");
        return -1;
    }
    Py_INCREF(dev);
    int p = call_true(dev, s_poll, ev);
    Py_DECREF(dev);
    if (p == 1 && count_fast_path() < 0) return -1;
    return p;
}

/* StreamPoolRoundRobin.submission_stream() (_scheduling) where ``pick`` is that method
 * bound to a pool of exactly that class and the pool's last stream is known idle
 * (``last.seq <= last.done_seq``): that stream, borrowed. NULL (no error) for every
 * other case, which calls ``pick``. */
static PyObject *py_pool_submission, *Pool_T, *s__last;
static unsigned long long n_pool_picks;

static PyObject *pool_last(PyObject *pick) {
    if (py_pool_submission == NULL || Pool_T == NULL || !PyMethod_Check(pick) ||
        PyMethod_GET_FUNCTION(pick) != py_pool_submission)
        return NULL;
    PyObject *self = PyMethod_GET_SELF(pick);
    if (!IS(self, Pool_T) || _PyType_Lookup((PyTypeObject *)Pool_T, s__last) != NULL) return NULL;
    PyObject *d = PyObject_GenericGetDict(self, NULL);
    if (d == NULL) {
        PyErr_Clear();
        return NULL;
    }
    PyObject *last = PyDict_GetItemWithError(d, s__last); /* (the pool's dict keeps it) */
    Py_DECREF(d);
    if (last == NULL || !IS(last, Stream_T)) {
        PyErr_Clear();
        return NULL;
    }
    PyObject *seq = SLOT(last, O.s_seq), *done = SLOT(last, O.s_done_seq);
    if (seq == NULL || done == NULL || !PyLong_CheckExact(seq) || !PyLong_CheckExact(done)) return NULL;
    int le = PyObject_RichCompareBool(seq, done, Py_LE);
    if (le <= 0) {
        PyErr_Clear();
        return NULL;
    }
    n_pool_picks++;
    return last;
}

/* current_device()._submission_stream() (_registry.current_device, _device.Device.
 * _submission_stream): the task's device from the context variable, else device 0; the
 * policy's pick. The Python functions where there is no pick yet, or where
 * _submission_stream is replaced (on the class or the instance). */
static PyObject *submission_stream(void) {
    PyObject *var = registry_globals == NULL ? NULL : PyDict_GetItemWithError(registry_globals, s__current);
    PyObject *dev = NULL;
    if (var != NULL && PyContextVar_CheckExact(var)) {
        if (PyContextVar_Get(var, NULL, &dev) < 0) return NULL;
        if (dev == Py_None) {
            Py_CLEAR(dev);
            PyObject *all = PyDict_GetItemWithError(registry_globals, s__devices);
            if (all != NULL && PyList_CheckExact(all) && PyList_GET_SIZE(all) > 0)
                dev = Py_NewRef(PyList_GET_ITEM(all, 0));
        }
    }
    if (dev == NULL) {
        if (PyErr_Occurred()) return NULL;
        if ((dev = PyObject_CallNoArgs(py_current_device)) == NULL) return NULL;
    }
    PyObject *s = NULL, *pick = NULL;
    if (IS(dev, Device_T) && py_submission_stream != NULL &&
        _PyType_Lookup(Py_TYPE(dev), s__submission_stream) == py_submission_stream) {
        PyObject *d = device_dict(dev);
        if (d == NULL) {
            Py_DECREF(dev);
            return NULL;
        }
        if (PyDict_GetItemWithError(d, s__submission_stream) == NULL && !PyErr_Occurred())
            pick = Py_XNewRef(PyDict_GetItemWithError(d, s__pick));
        Py_DECREF(d);
        if (PyErr_Occurred()) {
            Py_XDECREF(pick);
            Py_DECREF(dev);
            return NULL;
        }
    }
    if (pick != NULL && pick != Py_None) {
        PyObject *last = pool_last(pick);
        s = last != NULL ? Py_NewRef(last) : PyObject_CallNoArgs(pick);
    } else {
        s = PyObject_CallMethodNoArgs(dev, s__submission_stream);
    }
    Py_XDECREF(pick);
    Py_DECREF(dev);
    return s;
}

/* Event.__del__ (_stream.Event): the device takes the handle back, lock-free
 * (_device.Device._recycle_event, or what replaced it); an error is ignored (at the
 * interpreter's shutdown), as the Python's ``except Exception`` does. */
static PyObject *event_del(PyObject *ev, PyObject *unused) {
    PyObject *dev = SLOT(ev, O.ev_device), *gen = SLOT(ev, O.ev_generation), *h = SLOT(ev, O.ev_handle);
    if (dev == NULL || gen == NULL || h == NULL) Py_RETURN_NONE; /* (an AttributeError there) */
    Py_INCREF(dev);
    PyObject *r = NULL;
    if (IS(dev, Device_T)) {
        PyObject *d = device_dict(dev);
        PyObject *pool = NULL;
        if (d != NULL && method_replaced(dev, d, s__recycle_event, py_recycle_event) == 0)
            pool = Py_XNewRef(PyDict_GetItemWithError(d, s__event_pool));
        Py_XDECREF(d);
        if (pool != NULL) {
            PyObject *item = PyTuple_Pack(2, gen, h);
            if (item != NULL) r = PyObject_CallMethodOneArg(pool, s_append, item);
            Py_XDECREF(item);
            Py_DECREF(pool);
        } else if (!PyErr_Occurred()) {
            r = PyObject_CallMethodObjArgs(dev, s__recycle_event, gen, h, NULL);
        }
    } else {
        r = PyObject_CallMethodObjArgs(dev, s__recycle_event, gen, h, NULL);
    }
    Py_DECREF(dev);
    if (r == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_Exception)) return NULL;
        PyErr_Clear();
    }
    Py_XDECREF(r);
    Py_RETURN_NONE;
}

static PyMethodDef event_del_def = {"__del__", event_del, METH_NOARGS,
                                    "__del__($self, /)\n--\n\nThe device takes the handle back (compiled: "
                                    "trio_cuda/_hotpath.c; TRIO_CUDA_HOTPATH=0 runs the Python method)."};

/* Kernel.__call__ (_kernel.Kernel.__call__) where each argument is exactly a Partition,
 * Tensor, float or int: the _Launch made here as its __init__ makes it. Anything else
 * (op inputs, other scalars, keywords, a wrong count, a replaced _Launch.__init__) goes
 * to the Python method, which also raises its errors. */
static PyObject *Kernel_T, *py_kernel_call, *py_launch_init, *s_nparams, *s___init__;
static Py_ssize_t op_arity_off;
static unsigned long long n_calls, n_calls_python;

static PyObject *kernel_call_python(PyObject *k, PyObject *const *args, Py_ssize_t n, PyObject *kwnames) {
    n_calls_python++;
    Py_ssize_t nk = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    PyObject *small[17];
    PyObject **stack = n + nk < 16 ? small : PyMem_Malloc((size_t)(n + nk + 1) * sizeof(PyObject *));
    if (stack == NULL) return PyErr_NoMemory();
    stack[0] = k;
    for (Py_ssize_t i = 0; i < n + nk; i++) stack[i + 1] = args[i];
    PyObject *r = PyObject_Vectorcall(py_kernel_call, stack, n + 1, kwnames);
    if (stack != small) PyMem_Free(stack);
    return r;
}

static PyObject *kernel_call(PyObject *k, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    if ((kwnames != NULL && PyTuple_GET_SIZE(kwnames) > 0) || !IS(k, Kernel_T) ||
        _PyType_Lookup((PyTypeObject *)Launch_T, s___init__) != py_launch_init)
        return kernel_call_python(k, args, nargs, kwnames);
    PyObject *np = PyObject_GetAttr(k, s_nparams);
    if (np == NULL) return NULL;
    Py_ssize_t want = PyLong_Check(np) ? PyLong_AsSsize_t(np) : -1;
    Py_DECREF(np);
    if (want == -1 && PyErr_Occurred()) PyErr_Clear();
    if (want != nargs) return kernel_call_python(k, args, nargs, kwnames);
    for (Py_ssize_t i = 0; i < nargs; i++) {
        PyObject *t = (PyObject *)Py_TYPE(args[i]);
        if (t != Partition_T && t != Tensor_T && t != (PyObject *)&PyFloat_Type && t != (PyObject *)&PyLong_Type)
            return kernel_call_python(k, args, nargs, kwnames);
    }
    PyObject *tup = PyTuple_New(nargs), *arity = PyLong_FromSsize_t(nargs);
    if (tup == NULL || arity == NULL) {
        Py_XDECREF(tup);
        Py_XDECREF(arity);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) PyTuple_SET_ITEM(tup, i, Py_NewRef(args[i]));
    PyTypeObject *lt = (PyTypeObject *)Launch_T;
    PyObject *op = lt->tp_alloc(lt, 0);
    if (op == NULL) {
        Py_DECREF(tup);
        Py_DECREF(arity);
        return NULL;
    }
    SLOT(op, O.op_inputs) = Py_NewRef(empty_tuple);
    SLOT(op, O.op_state) = Py_NewRef(Py_None);
    SLOT(op, op_arity_off) = arity;
    SLOT(op, O.op_kernel) = Py_NewRef(k);
    SLOT(op, O.op_args) = tup;
    SLOT(op, O.launch_inputs_at) = Py_NewRef(empty_tuple);
    n_calls++;
    return op;
}

static PyObject *kernel_call_method(PyObject *k, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    return kernel_call(k, args, PyVectorcall_NARGS(nargsf), kwnames);
}

static PyMethodDef kernel_call_def = {
    "__call__", (PyCFunction)(void (*)(void))kernel_call_method, METH_FASTCALL | METH_KEYWORDS,
    "__call__($self, /, *args)\n--\n\nA DeviceOp that launches this kernel on ``args`` (compiled: "
    "trio_cuda/_hotpath.c; TRIO_CUDA_HOTPATH=0 runs the Python method)."};

static PySendResult await_start(Await *a, PyObject **result) {
    T_START;
    int on = global_true(traps_globals, s_on);
    if (on < 0) return await_fail(a);
    if (!on) return to_python(a, result);
    int c = cancel_check();
    if (c < 0) return await_fail(a);
    if (c) return to_python(a, result); /* it raises Cancelled, or decides */
    T_MARK(23);
    if (a->stream == Py_None) {
        PyObject *s = submission_stream();
        if (s == NULL) return await_fail(a);
        Py_SETREF(a->stream, s);
    }
    T_MARK(24);
    /* op._submit_now: the compiled method of the op's class, where no instance dict can
     * hold another, is called as the function it is (no bound method made) */
    PyObject *(*own)(PyObject *, PyObject *const *, Py_ssize_t) = NULL;
    PyObject *sn;
    {
        PyTypeObject *t = Py_TYPE(a->op);
        PyObject *m = t->tp_dictoffset == 0 && !(t->tp_flags & Py_TPFLAGS_MANAGED_DICT) &&
                              t->tp_getattro == PyObject_GenericGetAttr
                          ? _PyType_Lookup(t, s__submit_now)
                          : NULL;
        /* (a descriptor another class made applies to its instances only: getattr
         * refuses it for others, and so does the call made then) */
        if (m != NULL && Py_IS_TYPE(m, &PyMethodDescr_Type) && PyObject_TypeCheck(a->op, PyDescr_TYPE(m))) {
            PyMethodDef *md = ((PyMethodDescrObject *)m)->d_method;
            if (md == &submit_def) own = submit_method;
            else if (md == &op_submit_def) own = op_submit_method;
        }
    }
    sn = own != NULL ? Py_NewRef(Py_True) : PyObject_GetAttr(a->op, s__submit_now);
    if (sn == NULL) return await_fail(a);
    int direct = global_true(submit_globals, s_direct_on);
    PyObject *active = direct <= 0 ? NULL : module_global(trace_globals, s_active);
    if (direct < 0 || (direct && active == NULL)) {
        Py_DECREF(sn);
        return await_fail(a);
    }
    if (sn == Py_None || !direct || active != Py_None) { /* a trace sees every plan */
        Py_DECREF(sn);
        return to_planned(a, result);
    }
    T_MARK(25);
    PyObject *done = own != NULL ? own(a->op, &a->stream, 1) : PyObject_CallOneArg(sn, a->stream);
    Py_DECREF(sn);
    if (done == NULL) return await_fail(a);
    if (done == Py_None) {
        Py_DECREF(done);
        return to_planned(a, result);
    }
    T_MARK(26);
    n_awaits++;
    PyObject *t = PyTuple_CheckExact(done) ? Py_NewRef(done) : PySequence_Tuple(done);
    if (t == NULL && PyErr_ExceptionMatches(PyExc_TypeError) && !PyIter_Check(done) &&
        Py_TYPE(done)->tp_iter == NULL && !PySequence_Check(done)) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "cannot unpack non-iterable %.200s object", Py_TYPE(done)->tp_name);
    }
    Py_DECREF(done);
    if (t == NULL) return await_fail(a);
    if (PyTuple_GET_SIZE(t) != 3) {
        if (PyTuple_GET_SIZE(t) < 3)
            PyErr_Format(PyExc_ValueError, "not enough values to unpack (expected 3, got %zd)", PyTuple_GET_SIZE(t));
        else
            PyErr_SetString(PyExc_ValueError, "too many values to unpack (expected 3)");
        Py_DECREF(t);
        return await_fail(a);
    }
    a->value = Py_NewRef(PyTuple_GET_ITEM(t, 0));
    a->ev = Py_NewRef(PyTuple_GET_ITEM(t, 1));
    a->names = Py_NewRef(PyTuple_GET_ITEM(t, 2));
    Py_DECREF(t);
    PyObject *ev = a->ev;
    if (ev == Py_None) return yield_trap(a, A_FINAL, result);
    PyObject *budget = module_global(notifier_globals, s__budget_ns);
    if (budget == NULL) return await_fail(a);
    if (budget == Py_None) return to_rest(a, Py_None, 0, result); /* the first wait reads the budget */
    if ((a->started = PyObject_CallNoArgs(py_clock)) == NULL) return await_fail(a);
    a->named = 1;
    if (!IS(ev, Event_T)) return to_rest(a, a->started, 0, result);
    PyObject *ev_done = SLOT(ev, O.ev_done), *flag = SLOT(ev, O.ev_flag), *dev = SLOT(ev, O.ev_device);
    if (ev_done == NULL || flag == NULL || dev == NULL) return to_rest(a, a->started, 0, result);
    int known = PyObject_IsTrue(ev_done);
    if (known == 0) {
        known = PyObject_RichCompareBool(flag, zero, Py_GE);
        if (known == 1) {
            Py_INCREF(dev);
            known = call_true(dev, s_reached, ev);
            Py_DECREF(dev);
        }
    }
    if (known < 0) return await_fail(a);
    T_MARK(27);
    if (!known) return yield_trap(a, A_PASSED, result); /* the first poll after trio's pass */
    int p = poll_counted(ev); /* known complete: the first poll now */
    if (p < 0) return await_fail(a);
    if (p) return yield_trap(a, A_FINAL, result);
    return to_rest(a, a->started, 0, result);
}

/* ``outcome.unwrap()`` of what trio sends back from the trap: a Value (trio's own, made
 * for this send and dropped after it) only says to go on. */
static int unwrap(PyObject *outcome) {
    if (IS(outcome, Value_T)) return 0;
    PyObject *r = PyObject_CallMethodNoArgs(outcome, s_unwrap);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

/* _notifier.spin_poll(ev, started), inlined: after the first poll after trio's pass
 * found the event pending, and that pass came back within the spin time (_spin_ns),
 * poll again without yielding for up to the spin time. 1: done (counted as the fast
 * path), 0: not, -1: error. */
static PyObject *s__spin_ns, *s_spin_poll;
static unsigned long long n_spins, n_spins_done;

static int clock_ns(long long *out) {
    PyObject *t = PyObject_CallNoArgs(py_clock);
    if (t == NULL) return -1;
    *out = PyLong_AsLongLong(t);
    Py_DECREF(t);
    return *out == -1 && PyErr_Occurred() ? -1 : 0;
}

static int spin_held(PyObject *ev, PyObject *dev, long long end);

/* An int of nanoseconds as a C long long, clamped to +-2**61 (73 years: the sums below
 * cannot overflow; the Python's unbounded ints compare the same for any real clock). */
static int clamped_ns(PyObject *v, long long *out) {
    int overflow = 0;
    long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (x == -1 && PyErr_Occurred()) return -1;
    const long long lim = 1LL << 61;
    *out = overflow > 0 || x > lim ? lim : overflow < 0 || x < -lim ? -lim : x;
    return 0;
}

static PyObject *py_spin_poll; /* _notifier.spin_poll as bound by setup_calls: a replacement is called instead */

static int spin_counted(Await *a) {
    PyObject *spin = module_global(notifier_globals, s__spin_ns);
    if (spin == NULL) return -1;
    int on = spin == Py_None ? 0 : PyObject_IsTrue(spin); /* (the Python: ``_spin_ns and ...``) */
    if (on <= 0) return on;
    PyObject *b = module_global(notifier_globals, s__budget_ns);
    if (b == NULL) return -1;
    PyObject *sp = module_global(notifier_globals, s_spin_poll);
    if (sp == NULL) return -1;
    if (sp != py_spin_poll) { /* replaced: call it, as the Python does */
        PyObject *deadline = PyNumber_Add(a->started, b);
        if (deadline == NULL) return -1;
        PyObject *r = PyObject_CallFunctionObjArgs(sp, a->ev, a->started, deadline, NULL);
        Py_DECREF(deadline);
        if (r == NULL) return -1;
        int done = PyObject_IsTrue(r);
        Py_DECREF(r);
        if (done == 1 && count_fast_path() < 0) return -1;
        return done;
    }
    long long ns, started, now, budget;
    if (clamped_ns(spin, &ns) < 0 || clamped_ns(b, &budget) < 0 || clamped_ns(a->started, &started) < 0) return -1;
    if (clock_ns(&now) < 0) return -1;
    long long deadline = started + budget;
    if (now - started >= ns || now >= deadline) return 0;
    PyObject *ev = a->ev, *dev = SLOT(ev, O.ev_device);
    if (dev == NULL) {
        PyErr_SetString(PyExc_AttributeError, "_hotpath: an event without a device");
        return -1;
    }
    n_spins++;
    Py_INCREF(ev);
    Py_INCREF(dev);
    int done = spin_held(ev, dev, now + ns < deadline ? now + ns : deadline);
    Py_DECREF(ev);
    Py_DECREF(dev);
    if (done == 1) {
        n_spins_done++;
        if (count_fast_path() < 0) return -1;
    }
    return done;
}

static int spin_held(PyObject *ev, PyObject *dev, long long end) {
    long long now;
    PyObject *flag = SLOT(ev, O.ev_flag);
    if (flag == NULL) {
        PyErr_SetString(PyExc_AttributeError, "_hotpath: an event without its flag");
        return -1;
    }
    int word = PyObject_RichCompareBool(flag, zero, Py_GE);
    if (word < 0) return -1;
    /* (signals are checked each round, as the Python loop's bytecode would: a
     * KeyboardInterrupt is not held back for the spin's length) */
    if (word) {
        for (;;) {
            if (PyErr_CheckSignals() < 0 || clock_ns(&now) < 0) return -1;
            if (now >= end) break;
            int r = call_true(dev, s_reached, ev);
            if (r < 0) return -1;
            if (r) break;
        }
        return call_true(dev, s_poll, ev);
    }
    for (;;) {
        if (PyErr_CheckSignals() < 0 || clock_ns(&now) < 0) return -1;
        if (now >= end) return 0;
        int r = call_true(dev, s_poll, ev);
        if (r) return r;
    }
}

static PySendResult await_passed(Await *a, PyObject *arg, PyObject **result) {
    T_START;
    if (unwrap(arg) < 0) return await_fail(a);
    int c = cancel_check();
    if (c < 0) return await_fail(a);
    if (c) return to_rest(a, a->started, 2, result); /* the Python counts, checks and raises */
    T_MARK(28);
    int p = poll_counted(a->ev);
    T_MARK(29);
    if (p == 0) p = spin_counted(a);
    if (p < 0) return await_fail(a);
    if (p) {
        PySendResult r_ = give_value(a, result);
        T_MARK(30);
        return r_;
    }
    return to_rest(a, a->started, 0, result);
}

static PySendResult await_send(PyObject *self, PyObject *arg, PyObject **result) {
    Await *a = (Await *)self;
    if (a->running) {
        PyErr_SetString(PyExc_ValueError, "generator already executing");
        return PYGEN_ERROR;
    }
    PySendResult r;
    a->running = 1;
    switch (a->state) {
    case A_START:
        if (arg != Py_None) {
            PyErr_SetString(PyExc_TypeError, "can't send non-None value to a just-started generator");
            r = PYGEN_ERROR;
        } else {
            r = await_start(a, result);
        }
        break;
    case A_FINAL:
        r = unwrap(arg) < 0 ? await_fail(a) : give_value(a, result);
        break;
    case A_PASSED:
        r = await_passed(a, arg, result);
        break;
    case A_SUB:
        r = sub_send(a, arg, result);
        break;
    default: /* exhausted, as a generator is */
        *result = Py_NewRef(Py_None);
        r = PYGEN_RETURN;
    }
    a->running = 0;
    return r;
}

static void set_stop(PyObject *v) {
    if (v == Py_None) {
        PyErr_SetNone(PyExc_StopIteration);
        return;
    }
    PyObject *e = PyObject_CallOneArg(PyExc_StopIteration, v); /* (a tuple is one value) */
    if (e != NULL) {
        PyErr_SetObject(PyExc_StopIteration, e);
        Py_DECREF(e);
    }
}

static PyObject *await_next(PyObject *self) {
    PyObject *r;
    PySendResult s = await_send(self, Py_None, &r);
    if (s == PYGEN_NEXT) return r;
    if (s == PYGEN_RETURN) {
        if (r != Py_None) set_stop(r); /* (NULL without an error: StopIteration(None)) */
        Py_DECREF(r);
    }
    return NULL;
}

static PyObject *await_send_method(PyObject *self, PyObject *arg) {
    PyObject *r;
    PySendResult s = await_send(self, arg, &r);
    if (s == PYGEN_NEXT) return r;
    if (s == PYGEN_RETURN) {
        set_stop(r);
        Py_DECREF(r);
    }
    return NULL;
}

/* throw(exc) / throw(type[, value[, traceback]]): into the Python handed over to, else
 * raised where the await stands (a DeviceError inside await_op's ``try`` is named). */
static PyObject *await_throw(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    Await *a = (Await *)self;
    if (n < 1 || n > 3) {
        PyErr_SetString(PyExc_TypeError, "throw expected 1 to 3 arguments");
        return NULL;
    }
    if (a->running) {
        PyErr_SetString(PyExc_ValueError, "generator already executing");
        return NULL;
    }
    if (a->state == A_SUB) {
        a->running = 1;
        PyObject *meth = PyObject_GetAttr(a->sub, s_throw);
        PyObject *r = meth == NULL ? NULL : PyObject_Vectorcall(meth, args, n, NULL);
        Py_XDECREF(meth);
        a->running = 0;
        if (r == NULL) await_finish(a); /* (its StopIteration is this await's return) */
        return r;
    }
    PyObject *typ = args[0], *val = n > 1 ? args[1] : Py_None, *tb = n > 2 ? args[2] : Py_None;
    if (tb != Py_None && !PyTraceBack_Check(tb)) { /* refused, the await goes on (as a generator's) */
        PyErr_SetString(PyExc_TypeError, "throw() third argument must be a traceback object");
        return NULL;
    }
    if (PyExceptionInstance_Check(typ)) {
        if (val != Py_None) {
            PyErr_SetString(PyExc_TypeError, "instance exception may not have a separate value");
            return NULL;
        }
        PyErr_SetObject((PyObject *)Py_TYPE(typ), typ);
    } else if (PyExceptionClass_Check(typ)) {
        PyErr_SetObject(typ, val);
    } else {
        PyErr_Format(PyExc_TypeError, "exceptions must be classes or instances deriving from BaseException, not %.200s",
                     Py_TYPE(typ)->tp_name);
        return NULL;
    }
    if (tb != Py_None) {
        PyObject *t, *v, *old;
        PyErr_Fetch(&t, &v, &old);
        PyErr_NormalizeException(&t, &v, &old);
        Py_XDECREF(old);
        PyException_SetTraceback(v, tb);
        PyErr_Restore(t, v, Py_NewRef(tb));
    }
    if (a->state != A_PASSED && a->state != A_FINAL) a->named = 0;
    await_fail(a);
    return NULL;
}

static PyObject *await_close(PyObject *self, PyObject *unused) {
    Await *a = (Await *)self;
    if (a->running) {
        PyErr_SetString(PyExc_ValueError, "generator already executing");
        return NULL;
    }
    PyObject *r = Py_None;
    if (a->state == A_SUB) {
        a->running = 1;
        r = PyObject_CallMethodNoArgs(a->sub, s_close);
        a->running = 0;
        if (r == NULL) {
            await_finish(a);
            return NULL;
        }
        Py_DECREF(r);
    }
    await_finish(a);
    Py_RETURN_NONE;
}

static int await_traverse(PyObject *self, visitproc visit, void *arg) {
    Await *a = (Await *)self;
    Py_VISIT(a->op);
    Py_VISIT(a->stream);
    Py_VISIT(a->value);
    Py_VISIT(a->ev);
    Py_VISIT(a->names);
    Py_VISIT(a->started);
    Py_VISIT(a->sub);
    return 0;
}

static int await_clear(PyObject *self) {
    await_finish((Await *)self);
    return 0;
}

static void await_dealloc(PyObject *self) {
    PyObject_GC_UnTrack(self);
    await_finish((Await *)self);
    PyObject_GC_Del(self);
}

/* For introspection (trio's Task.iter_await_frames yields an awaited object's gi_frame,
 * then walks on into its gi_yieldfrom; trio before 0.32 reads gi_frame.f_lineno without
 * a None check). This await runs in no frame of its own: until it hands over, it has
 * neither attribute, so a walk ends at the frame that awaits it. Once it drives a
 * Python generator or coroutine, its frame is where the await stands and what that one
 * awaits is what this one waits on: the walk goes on as if the caller awaited it. */
static PyObject *await_sub_attr(PyObject *self, PyObject *gen_name, PyObject *coro_name) {
    Await *a = (Await *)self;
    if (a->state != A_SUB || a->sub == NULL) {
        PyErr_SetObject(PyExc_AttributeError, gen_name);
        return NULL;
    }
    return PyObject_GetAttr(a->sub, PyCoro_CheckExact(a->sub) ? coro_name : gen_name);
}

static PyObject *await_frame(PyObject *self, void *unused) { return await_sub_attr(self, s_gi_frame, s_cr_frame); }

static PyObject *await_yieldfrom(PyObject *self, void *unused) {
    return await_sub_attr(self, s_gi_yieldfrom, s_cr_await);
}

static PyMethodDef await_methods[] = {
    {"send", await_send_method, METH_O, "send(value): as a generator's."},
    {"throw", (PyCFunction)(void (*)(void))await_throw, METH_FASTCALL, "throw(exc): as a generator's."},
    {"close", await_close, METH_NOARGS, "close(): as a generator's."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef await_getset[] = {
    {"gi_frame", await_frame, NULL, "The frame of the Python generator or coroutine handed over to (absent before).", NULL},
    {"gi_yieldfrom", await_yieldfrom, NULL, "What the Python handed over to awaits (absent before).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyAsyncMethods await_async = {NULL, NULL, NULL, await_send};

static PyTypeObject Await_T = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "trio_cuda._hotpath.Await",
    .tp_basicsize = sizeof(Await),
    .tp_dealloc = await_dealloc,
    .tp_as_async = &await_async,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The await of a DeviceOp (trio_cuda/_submit.py, await_op), compiled.",
    .tp_traverse = await_traverse,
    .tp_clear = await_clear,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = await_next,
    .tp_methods = await_methods,
    .tp_getset = await_getset,
};

static PyObject *await_method(PyObject *op, PyObject *unused) {
    Await *a = PyObject_GC_New(Await, &Await_T);
    if (a == NULL) return NULL;
    a->state = A_START;
    a->running = a->named = 0;
    a->op = Py_NewRef(op);
    a->stream = Py_NewRef(Py_None);
    a->value = a->ev = a->names = a->started = a->sub = NULL;
    PyObject_GC_Track((PyObject *)a);
    return (PyObject *)a;
}

static PyMethodDef await_def = {"__await__", await_method, METH_NOARGS,
                                "__await__($self, /)\n--\n\nSubmit and wait in trio (compiled: trio_cuda/_hotpath.c; "
                                "TRIO_CUDA_HOTPATH=0 runs the Python generator)."};

/* setup_calls(dict): bind what the per-call path works on (trio's run context, its trap
 * and classes, with their slots' offsets; the runtime's modules; the Python methods it
 * hands over to or checks are not replaced); all or nothing. Returns the methods to
 * install as DeviceOp.__await__, Event.__del__ and Kernel.__call__. */
static PyObject *setup_calls(PyObject *module, PyObject *kw) {
    static const char *names[] = {"run_context", "trap", "Value", "DeviceOp", "DeviceError", "Task", "CancelStatus", "Runner",
                                  "traps_globals", "submit_globals", "trace_globals", "notifier_globals",
                                  "current_device", "await", "await_rest", "raise_named", "run_planned", "clock",
                                  "registry_globals", "event_handle", "recycle_event", "submission_stream",
                                  "Kernel", "kernel_call", "launch_init"};
    PyObject **vars[] = {&run_context, &trap, &Value_T, &DeviceOp_T, &DeviceError_T, &Task_T, &CancelStatus_T, &Runner_T,
                         &traps_globals, &submit_globals, &trace_globals, &notifier_globals, &py_current_device,
                         &py_await, &py_await_rest, &py_raise_named, &py_run_planned, &py_clock,
                         &registry_globals, &py_event_handle, &py_recycle_event, &py_submission_stream,
                         &Kernel_T, &py_kernel_call, &py_launch_init};
    enum { N = sizeof(names) / sizeof(names[0]) };
    PyObject *got[N];
    Py_ssize_t offs[6];
    if (!PyDict_Check(kw)) {
        PyErr_SetString(PyExc_TypeError, "setup_calls(dict)");
        return NULL;
    }
    for (int i = 0; i < N; i++) {
        got[i] = PyDict_GetItemString(kw, names[i]);
        if (got[i] == NULL) {
            PyErr_Format(PyExc_KeyError, "_hotpath.setup_calls needs %s", names[i]);
            return NULL;
        }
    }
    for (int i = 8; i < 19; i += (i == 11 ? 7 : 1)) { /* the modules' dicts: 8-11 and 18 */
        if (!PyDict_Check(got[i])) {
            PyErr_Format(PyExc_TypeError, "_hotpath: %s is not a dict", names[i]);
            return NULL;
        }
    }
    if (!PyType_Check(got[2]) || !PyType_Check(got[3]) || !PyExceptionClass_Check(got[4])) {
        PyErr_SetString(PyExc_TypeError, "_hotpath: Value and DeviceOp must be classes, DeviceError an exception class");
        return NULL;
    }
    if (slot_offset(got[5], "_cancel_status", &offs[0]) < 0 || slot_offset(got[5], "_runner", &offs[1]) < 0 ||
        slot_offset(got[5], "_cancel_points", &offs[2]) < 0 ||
        slot_offset(got[6], "effectively_cancelled", &offs[3]) < 0 || slot_offset(got[7], "ki_pending", &offs[4]) < 0 ||
        slot_offset(got[7], "main_task", &offs[5]) < 0)
        return NULL;
    Py_ssize_t arity_off;
    if (!PyType_Check(got[22]) || Launch_T == NULL || slot_offset(Launch_T, "_arity", &arity_off) < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "_hotpath: Kernel must be a class (and setup() first)");
        return NULL;
    }
    PyObject *m = PyDescr_NewMethod((PyTypeObject *)got[3], &await_def);
    if (m == NULL) return NULL;
    PyObject *kc = PyDescr_NewMethod((PyTypeObject *)got[22], &kernel_call_def);
    if (kc == NULL) {
        Py_DECREF(m);
        return NULL;
    }
    if (Event_T == NULL || !PyType_Check(Event_T)) {
        Py_DECREF(m);
        Py_DECREF(kc);
        PyErr_SetString(PyExc_TypeError, "_hotpath: setup() first");
        return NULL;
    }
    PyObject *d = PyDescr_NewMethod((PyTypeObject *)Event_T, &event_del_def);
    if (d == NULL) {
        Py_DECREF(m);
        Py_DECREF(kc);
        return NULL;
    }
    for (int i = 0; i < N; i++) Py_XSETREF(*vars[i], Py_NewRef(got[i]));
    Py_XSETREF(py_spin_poll, Py_XNewRef(PyDict_GetItemString(notifier_globals, "spin_poll")));
    /* (optional: without them every pick is called) */
    Py_XSETREF(py_pool_submission, Py_XNewRef(PyDict_GetItemString(kw, "pool_submission")));
    Py_XSETREF(Pool_T, Py_XNewRef(PyDict_GetItemString(kw, "Pool")));
    task_status_off = offs[0];
    task_runner_off = offs[1];
    task_points_off = offs[2];
    status_cancelled_off = offs[3];
    runner_ki_off = offs[4];
    runner_main_off = offs[5];
    op_arity_off = arity_off;
    return Py_BuildValue("(NNN)", m, d, kc);
}

/* ---- setup ------------------------------------------------------------------------ */

/* var = kw[name] (a new reference), or KeyError naming the setup function ``who``. */
#define GET_FROM(who, var, name)                                                     \
    do {                                                                             \
        PyObject *v_ = PyDict_GetItemString(kw, name);                               \
        if (v_ == NULL) {                                                            \
            PyErr_Format(PyExc_KeyError, "_hotpath.%s needs %s", who, name);         \
            return NULL;                                                             \
        }                                                                            \
        Py_INCREF(v_);                                                               \
        Py_XSETREF(var, v_);                                                         \
    } while (0)

static PyObject *setup_inner(PyObject *kw) {
    /* setup(dict): the classes and objects this file works on, by name */
#define GET(var, name) GET_FROM("setup", var, name)
#define OFF(cls, name, field) \
    if (slot_offset((PyObject *)(cls), name, &O.field) < 0) return NULL
    if (!PyDict_Check(kw)) {
        PyErr_SetString(PyExc_TypeError, "setup(dict)");
        return NULL;
    }
    GET(Launch_T, "Launch");
    GET(Partition_T, "Partition");
    GET(Tensor_T, "Tensor");
    GET(Stream_T, "Stream");
    GET(Config_T, "Config");
    GET(Counters_T, "Counters");
    GET(Buffer_T, "Buffer");
    GET(Event_T, "Event");
    GET(Device_T, "Device");
    GET(py_poll, "poll");
    GET(device_globals, "device_globals");
    GET(py_submit, "submit");
    GET(lock_obj, "lock");
#ifdef RLOCK_INLINE
    {
        rlock_type = NULL;
        int ok = rlock_check(lock_obj);
        if (ok < 0) return NULL;
        rlock_type = ok ? Py_TYPE(lock_obj) : NULL;
    }
#endif
    GET(tls, "tls");
    GET(executing, "executing");
    GET(direct_failed, "direct_failed");
    GET(py_direct_enqueue, "direct_enqueue");
    GET(py_enqueue_prepared, "enqueue_prepared");
    GET(Lane_T, "Lane");
    GET(Select_T, "Select");
    GET(Continue_T, "Continue");
    GET(py_plan, "plan");
    GET(py_select_plan, "select_plan");
    GET(py_prepared_step, "prepared_step");
    GET(py_enqueue_launch, "enqueue_launch");
    GET(kernel_globals, "kernel_globals");
    if (!PyDict_Check(kernel_globals)) {
        PyErr_SetString(PyExc_TypeError, "_hotpath: kernel_globals is not a dict");
        return NULL;
    }
    OFF(Launch_T, "_inputs", op_inputs);
    OFF(Launch_T, "_state", op_state);
    OFF(Launch_T, "_args", op_args);
    OFF(Launch_T, "_kernel", op_kernel);
    OFF(Partition_T, "_k", part_k);
    OFF(Partition_T, "tensor", part_tensor);
    OFF(Partition_T, "tile_shape", part_tile);
    OFF(Tensor_T, "_args", tensor_args);
    OFF(Tensor_T, "_buffer", tensor_buffer);
    OFF(Tensor_T, "_tracked", tensor_tracked);
    OFF(Buffer_T, "capture", buf_capture);
    OFF(Buffer_T, "writer", buf_writer);
    OFF(Buffer_T, "readers", buf_readers);
    OFF(Buffer_T, "lifetime", buf_lifetime);
    OFF(Buffer_T, "ptr", buf_ptr);
    OFF(Stream_T, "device", s_device);
    OFF(Stream_T, "generation", s_generation);
    OFF(Stream_T, "capture", s_capture);
    OFF(Stream_T, "_dropped", s_dropped);
    OFF(Stream_T, "_keep", s_keep);
    OFF(Stream_T, "seq", s_seq);
    OFF(Stream_T, "done_seq", s_done_seq);
    OFF(Stream_T, "handle", s_handle);
    OFF(Config_T, "writes", cfg_writes);
    OFF(Config_T, "reads", cfg_reads);
    OFF(Config_T, "grid", cfg_grid);
    OFF(Stream_T, "_last_event", s_last_event);
    OFF(Stream_T, "_flag", s_flag);
    OFF(Stream_T, "_wref", s_wref);
    OFF(Stream_T, "_ok_seq", s_ok_seq);
    OFF(Stream_T, "_newest_pending", s_newest_pending);
    OFF(Event_T, "device", ev_device);
    OFF(Event_T, "_stream", ev_stream);
    OFF(Event_T, "stream_handle", ev_stream_handle);
    OFF(Event_T, "seq", ev_seq);
    OFF(Event_T, "handle", ev_handle);
    OFF(Event_T, "done", ev_done);
    OFF(Event_T, "error", ev_error);
    OFF(Event_T, "generation", ev_generation);
    OFF(Event_T, "flag", ev_flag);
    OFF(Event_T, "ticket", ev_ticket);
    OFF(Counters_T, "launches", ctr_launches);
    OFF(Counters_T, "submissions", ctr_submissions);
    {
        PyObject *ea = PyObject_GetAttr(Stream_T, s_event_at);
        if (ea == NULL) return NULL;
        Py_XSETREF(py_event_at, ea);
    }
    OFF(Launch_T, "_inputs_at", launch_inputs_at);
    OFF(Select_T, "_index", sel_index);
    OFF(Select_T, "_expect", sel_expect);
    {
        /* a DeviceOp's slots: the same offsets as the launch's */
        Py_ssize_t inputs_off, state_off;
        if (slot_offset(Select_T, "_inputs", &inputs_off) < 0 || slot_offset(Select_T, "_state", &state_off) < 0)
            return NULL;
        if (inputs_off != O.op_inputs || state_off != O.op_state) {
            PyErr_SetString(PyExc_TypeError, "_hotpath: _Select's op slots differ from _Launch's");
            return NULL;
        }
    }
    OFF(Lane_T, "device", lane_device);
    OFF(Lane_T, "stream", lane_stream);
    OFF(Continue_T, "op", cont_op);
    OFF(Buffer_T, "generation", buf_generation);
    OFF(Buffer_T, "device", buf_device);
    /* the walk enters these ops' inputs on the same lane: they must not fork */
    for (int i = 0; i < 2; i++) {
        PyObject *forks = PyObject_GetAttrString(i ? Select_T : Launch_T, "_forks");
        if (forks == NULL) return NULL;
        int no = forks == Py_False;
        Py_DECREF(forks);
        if (!no) {
            PyErr_SetString(PyExc_TypeError, "_hotpath: an op the walk handles forks");
            return NULL;
        }
    }
    if (!PyDict_Check(device_globals)) {
        PyErr_SetString(PyExc_TypeError, "_hotpath: device_globals is not a dict");
        return NULL;
    }
    /* the methods to install as _Launch._submit_now and Device.poll */
    PyObject *m1 = PyDescr_NewMethod((PyTypeObject *)Launch_T, &submit_def);
    PyObject *m2 = m1 == NULL ? NULL : PyDescr_NewMethod((PyTypeObject *)Device_T, &poll_def);
    PyObject *m3 = m2 == NULL ? NULL : PyDescr_NewMethod((PyTypeObject *)Launch_T, &plan_def);
    if (m3 == NULL) {
        Py_XDECREF(m1);
        Py_XDECREF(m2);
        return NULL;
    }
    Py_XSETREF(plan_descr, Py_NewRef(m3));
    return Py_BuildValue("(NNN)", m1, m2, m3);
#undef GET
#undef OFF
}

/* setup() all or nothing: a refused call leaves the module as it was (the runtime may
 * be using it). */
static PyObject *setup(PyObject *module, PyObject *kw) {
    PyObject **globals[] = {&Launch_T, &Partition_T, &Tensor_T, &Stream_T, &Config_T, &Counters_T, &Buffer_T,
                            &Event_T, &Device_T, &py_poll, &device_globals, &py_submit, &lock_obj, &tls,
                            &executing, &direct_failed, &py_direct_enqueue, &py_enqueue_prepared,
                            &Lane_T, &Select_T, &Continue_T, &py_plan, &py_select_plan, &py_prepared_step,
                            &py_enqueue_launch, &kernel_globals, &plan_descr};
    enum { N = sizeof(globals) / sizeof(globals[0]) };
    PyObject *saved[N];
    for (int i = 0; i < N; i++) saved[i] = Py_XNewRef(*globals[i]);
    __typeof__(O) saved_offsets = O;
#ifdef RLOCK_INLINE
    PyTypeObject *saved_rlock = rlock_type;
#endif
    PyObject *r = setup_inner(kw);
    for (int i = 0; i < N; i++) {
        if (r == NULL) Py_XSETREF(*globals[i], saved[i]);
        else Py_XDECREF(saved[i]);
    }
    if (r == NULL) {
        O = saved_offsets;
#ifdef RLOCK_INLINE
        rlock_type = saved_rlock;
#endif
    }
    return r;
}

/* setup_ops(objects): bind what the ops' direct submission works on (after setup());
 * returns the compiled TensorOp._submit_now. All or nothing, as setup(). */
static PyObject *setup_ops_inner(PyObject *module, PyObject *kw) {
#define GET(var, name) GET_FROM("setup_ops", var, name)
#define OFF(cls, name, field) \
    if (slot_offset((PyObject *)(cls), name, &Q.field) < 0) return NULL
    if (!PyDict_Check(kw)) {
        PyErr_SetString(PyExc_TypeError, "setup_ops(dict)");
        return NULL;
    }
    if (Tensor_T == NULL || Stream_T == NULL || Buffer_T == NULL || lock_obj == NULL || py_direct_enqueue == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "_hotpath.setup_ops: setup() first");
        return NULL;
    }
    GET(TensorOp_T, "TensorOp");
    GET(Recipe_T, "Recipe");
    GET(Step_T, "Step");
    GET(py_op_submit, "submit");
    GET(core_counts, "counts");
    GET(py_make, "make");
    GET(py_direct_tidy, "direct_tidy");
    GET(py_op_key, "op_key");
    GET(core_globals, "core_globals");
    GET(submit_globals, "submit_globals");
    GET(py_direct_ready, "direct_ready");
    GET(py_buffers, "buffers");
    if (!PyDict_Check(core_globals) || !PyDict_Check(submit_globals) || kernel_globals == NULL) {
        PyErr_SetString(PyExc_TypeError, "_hotpath.setup_ops: core_globals or submit_globals is not a dict");
        return NULL;
    }
    {
        PyObject *own = PyObject_GetAttrString(module, "enqueue_direct");
        if (own == NULL) return NULL;
        Py_XSETREF(hot_enqueue_direct, own);
    }
    if (!PyType_Check(TensorOp_T) || !PyDict_CheckExact(core_counts)) {
        PyErr_SetString(PyExc_TypeError, "_hotpath.setup_ops: TensorOp is not a class or counts not a dict");
        return NULL;
    }
    OFF(TensorOp_T, "_args", top_args);
    OFF(TensorOp_T, "_hit", top_hit);
    OFF(Recipe_T, "device", rec_device);
    OFF(Recipe_T, "direct", rec_direct);
    OFF(Recipe_T, "generation", rec_generation);
    OFF(Recipe_T, "ops", rec_ops);
    OFF(Recipe_T, "result", rec_result);
    OFF(Recipe_T, "uses", rec_uses);
    OFF(Step_T, "kernel", st_kernel);
    OFF(Step_T, "prepared", st_prepared);
    OFF(Step_T, "cfg", st_cfg);
    OFF(Step_T, "writes", st_writes);
    OFF(Step_T, "reads", st_reads);
    OFF(Step_T, "ready", st_ready);
    {
        Py_ssize_t state_off;
        if (slot_offset(TensorOp_T, "_state", &state_off) < 0) return NULL;
        if (state_off != O.op_state) {
            PyErr_SetString(PyExc_TypeError, "_hotpath: TensorOp's _state slot differs from _Launch's");
            return NULL;
        }
    }
    return PyDescr_NewMethod((PyTypeObject *)TensorOp_T, &op_submit_def);
#undef GET
#undef OFF
}

static PyObject *setup_ops(PyObject *module, PyObject *kw) {
    PyObject **globals[] = {&TensorOp_T,     &Recipe_T,       &Step_T,          &py_op_submit, &core_counts,
                            &py_make,        &py_direct_tidy, &py_op_key,       &core_globals, &submit_globals,
                            &py_direct_ready, &py_buffers,    &hot_enqueue_direct};
    enum { N = sizeof(globals) / sizeof(globals[0]) };
    PyObject *saved[N];
    for (int i = 0; i < N; i++) saved[i] = Py_XNewRef(*globals[i]);
    __typeof__(Q) saved_offsets = Q;
    PyObject *r = setup_ops_inner(module, kw);
    for (int i = 0; i < N; i++) {
        if (r == NULL) Py_XSETREF(*globals[i], saved[i]);
        else Py_XDECREF(saved[i]);
    }
    if (r == NULL) Q = saved_offsets;
    return r;
}

static PyObject *counters(PyObject *module, PyObject *unused) {
#ifndef DIRECT_CACHE
    unsigned long long n_direct_cached = 0;
#endif
#ifndef RLOCK_INLINE
    unsigned long long n_lock_inline = 0, n_lock_waits = 0;
    void *rlock_type = NULL;
#endif
    return Py_BuildValue("{sKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsK}", "submits", n_submits, "submits_python", n_submits_python,
                         "polls", n_polls, "polls_python", n_polls_python, "launches", n_launches, "records", n_records,
                         "queries", n_queries, "enqueues", n_enqueues, "plans", n_plans, "plans_python",
                         n_plans_python, "walk_handbacks", n_handbacks, "steps", n_steps, "steps_python",
                         n_steps_python, "awaits", n_awaits, "awaits_python", n_awaits_python, "awaits_rest",
                         n_awaits_rest, "calls", n_calls, "calls_python", n_calls_python, "op_submits", n_op_submits,
                         "op_submits_python", n_op_submits_python, "spins", n_spins, "spins_done", n_spins_done, "gemms", n_gemms,
                         "gemm_replays", n_gemm_replays, "pool_picks", n_pool_picks, "event_reuses", n_event_reuses,
                         "direct_cached", n_direct_cached, "lock_inline", n_lock_inline, "lock_waits", n_lock_waits,
                         "lock_inline_on", (unsigned long long)(rlock_type != NULL));
}

/* timing(reset=False): {section: (ticks, count)} of a -DHOTPATH_TIMING build (None in
 * a normal one), and the time stamp counter now, for the probe's calibration. */
static PyObject *timing(PyObject *module, PyObject *const *argv, Py_ssize_t argc) {
#ifdef HOTPATH_TIMING
    PyObject *d = PyDict_New();
    if (d == NULL) return NULL;
    for (int i = 0; i < N_TIMED; i++) {
        if (tick_n[i] == 0) continue;
        PyObject *k = PyLong_FromLong(i), *v = Py_BuildValue("(KK)", tick_sum[i], tick_n[i]);
        int e = k == NULL || v == NULL || PyDict_SetItem(d, k, v) < 0;
        Py_XDECREF(k);
        Py_XDECREF(v);
        if (e) {
            Py_DECREF(d);
            return NULL;
        }
    }
    if (argc > 0 && PyObject_IsTrue(argv[0]) == 1) {
        memset(tick_sum, 0, sizeof(tick_sum));
        memset(tick_n, 0, sizeof(tick_n));
    }
    PyObject *r = Py_BuildValue("(NK)", d, (unsigned long long)__rdtsc());
    return r;
#else
    (void)argv;
    (void)argc;
    Py_RETURN_NONE;
#endif
}

/* Test hooks (no GPU needed: a test gives a driver fake entry points): each direct call
 * as the hot path makes it. None: not made here (the Python method would be used). */
static PyObject *direct_call(PyObject *module, PyObject *const *argv, Py_ssize_t argc) {
    if (argc < 2 || !PyUnicode_Check(argv[0])) {
        PyErr_SetString(PyExc_TypeError, "direct_call(what, driver, ...)");
        return NULL;
    }
    Direct d;
    int dc = direct_calls(argv[1], &d);
    if (dc < 0) return NULL;
    if (dc == 0) Py_RETURN_NONE;
    int r;
    if (PyUnicode_CompareWithASCIIString(argv[0], "launch") == 0 && argc == 4) {
        r = launch_direct(argv[1], &d, argv[2], argv[3]);
    } else if (PyUnicode_CompareWithASCIIString(argv[0], "record") == 0 && argc == 4) {
        r = record_direct(argv[1], &d, argv[2], argv[3]);
    } else if (PyUnicode_CompareWithASCIIString(argv[0], "query") == 0 && argc == 3) {
        r = query_direct(&d, argv[2]);
    } else if (PyUnicode_CompareWithASCIIString(argv[0], "gemm_replay") == 0 && argc == 4) {
        r = gemm_replay(argv[1], &d, argv[2], argv[3]);
    } else if (PyUnicode_CompareWithASCIIString(argv[0], "event_reuse") == 0 && argc == 4 && IS(argv[2], Stream_T)) {
        /* event_reuse(driver, stream, seq): the stream's last event recorded again, or None */
        PyObject *s = argv[2], *last = SLOT(s, O.s_last_event), *dev = SLOT(s, O.s_device);
        PyObject *ev = last == NULL || last == Py_None || dev == NULL ? NULL : event_reuse(s, dev, argv[1], argv[3], &d, last);
        Py_DECREF(d.hot);
        if (ev == NULL && PyErr_Occurred()) return NULL;
        return ev == NULL ? Py_NewRef(Py_None) : ev;
    } else {
        Py_DECREF(d.hot);
        PyErr_SetString(PyExc_ValueError, "direct_call: launch(driver, prepared, stream), record(driver, event, stream), "
                                          "query(driver, event), gemm_replay(driver, (desc, a, b, d, bias), stream) or "
                                          "event_reuse(driver, stream, seq)");
        return NULL;
    }
    Py_DECREF(d.hot);
    if (r < 0) return NULL;
    return PyLong_FromLong(r);
}

static PyMethodDef methods[] = {
    {"enqueue_direct", (PyCFunction)(void (*)(void))enqueue_direct, METH_FASTCALL,
     "enqueue_direct(stream, cfg, prepared, writes, reads): _submit.direct_enqueue of _kernel.enqueue_prepared, compiled."},
    {"walk", (PyCFunction)(void (*)(void))walk, METH_FASTCALL,
     "walk(plan, work, values): _submit.Plan._walk's loop for launches and selects; False: the top frame is the Python's."},
    {"run_steps", run_steps, METH_O, "run_steps(steps): _submit.Plan._run_steps (no trace), prepared launches compiled."},
    {"timing", (PyCFunction)(void (*)(void))timing, METH_FASTCALL, "timing(reset=False): section ticks of a -DHOTPATH_TIMING build (benchmarks/probes/probe_sections.py), else None."},
    {"direct_counted", direct_counted, METH_NOARGS, "direct_counted(): the direct submissions made here (planned, enqueued and direct each; not in _submit._counts)."},
    {"counters", counters, METH_NOARGS, "counters(): what ran here (submissions, polls, direct driver calls) and what went to the Python."},
    {"direct_call", (PyCFunction)(void (*)(void))direct_call, METH_FASTCALL, "direct_call(what, driver, ...): a test hook (see the source)."},
    {"setup_calls", (PyCFunction)setup_calls, METH_O,
     "setup_calls(objects): bind what the per-call path works on; returns DeviceOp.__await__, Event.__del__ and Kernel.__call__."},
    {"op_key", (PyCFunction)(void (*)(void))op_key, METH_FASTCALL,
     "op_key(op, args): _ops._core._op_key, compiled for the common arguments (setup_ops first)."},
    {"set_gemm_step", (PyCFunction)(void (*)(void))set_gemm_step, METH_FASTCALL,
     "set_gemm_step(fn, module_globals): the GEMM step whose direct submissions are made here."},
    {"setup_ops", (PyCFunction)setup_ops, METH_O,
     "setup_ops(objects): bind what the ops' direct submission works on; returns the compiled TensorOp._submit_now."},
    {"setup", (PyCFunction)setup, METH_O,
     "setup(objects): bind the runtime's classes and objects; returns the compiled _Launch._submit_now, Device.poll and _Launch._plan."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_hotpath", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__hotpath(void) {
#define NAME(var, text) \
    if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL
    NAME(s_submitting, "submitting");
    NAME(s_acquire, "acquire");
    NAME(s_release, "release");
    NAME(s_generation, "generation");
    NAME(s_resetting, "_resetting");
    NAME(s_driver, "_driver");
    NAME(s_fault, "_fault");
    NAME(s_dead_buffers, "_dead_buffers");
    NAME(s_dead_streams, "_dead_streams");
    NAME(s_lingering, "_lingering");
    NAME(s_dead_graphs, "_dead_graphs");
    NAME(s_stats, "_stats");
    NAME(s_fast, "_fast");
    NAME(s_name, "name");
    NAME(s_launch, "launch");
    NAME(s__key, "_key");
    NAME(s_retire, "retire");
    NAME(s_event_at, "event_at");
    NAME(s__arg, "_arg");
    NAME(s_event_handle, "_event_handle");
    NAME(s_record, "record");
    NAME(s_ticket, "_ticket");
    NAME(s_wait_for, "wait_for");
    NAME(s_query, "query");
    NAME(s_hot_calls, "hot_calls");
    NAME(s__fast, "_fast");
    NAME(s_token, "token");
    NAME(s__token, "_token");
    NAME(s_launch_failed, "_launch_failed");
    NAME(s_record_failed, "_record_failed");
    NAME(s_cross_device, "_cross_device");
    NAME(s_poll_by_stream, "poll_by_stream");
    NAME(s_claimed, "claimed");
    NAME(s_steps, "steps");
    NAME(s_ops, "ops");
    NAME(s_capture, "capture");
    NAME(s__plan, "_plan");
    NAME(s_launches, "launches");
    NAME(s__prepared_step, "_prepared_step");
    NAME(s__enqueue_launch, "_enqueue_launch");
    NAME(s__event_pool, "_event_pool");
    NAME(s_pop, "pop");
    NAME(s_append, "append");
    NAME(s__create_event, "create_event");
    NAME(s__current, "_current");
    NAME(s__devices, "_devices");
    NAME(s__pick, "_pick");
    NAME(s__recycle_event, "_recycle_event");
    NAME(s_nparams, "nparams");
    NAME(s___init__, "__init__");
    NAME(s___del__, "__del__");
    NAME(s_task, "task");
    NAME(s_unwrap, "unwrap");
    NAME(s_on, "on");
    NAME(s_direct_on, "direct_on");
    NAME(s_active, "active");
    NAME(s__budget_ns, "_budget_ns");
    NAME(s__spin_ns, "_spin_ns");
    NAME(s_spin_poll, "spin_poll");
    NAME(s_submissions, "submissions");
    NAME(s__paths, "_paths");
    NAME(s__submit_now, "_submit_now");
    NAME(s__submission_stream, "_submission_stream");
    NAME(s__last, "_last");
    NAME(s_reached, "reached");
    NAME(s_poll, "poll");
    NAME(s_throw, "throw");
    NAME(s_close, "close");
    NAME(s_gi_frame, "gi_frame");
    NAME(s_cr_frame, "cr_frame");
    NAME(s_gi_yieldfrom, "gi_yieldfrom");
    NAME(s_cr_await, "cr_await");
    NAME(s_hits, "hits");
    NAME(s__foreign_streams, "_foreign_streams");
    NAME(s__foreign, "_foreign");
    NAME(s_matmul, "matmul");
    NAME(s__gemms, "_gemms");
    NAME(s_replay, "replay");
    NAME(s_graphs, "graphs");
    NAME(s__graph_pfn, "_graph_pfn");
    NAME(s_replays, "replays");
#undef NAME
    if ((empty_tuple = PyTuple_New(0)) == NULL) return NULL;
    if ((one = PyLong_FromLong(1)) == NULL || (zero = PyLong_FromLong(0)) == NULL) return NULL;
    if (PyType_Ready(&Await_T) < 0) return NULL;
    return PyModule_Create(&module);
}
