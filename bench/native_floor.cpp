/* The floors of bench/floor.py in native code: what the same per-op work would cost a watch
 * whose hot path is native (bench/native.py builds and loads it), in two builds of this file:
 *
 * - native_floor: only the CPython API. torch is reached through its Python objects (the
 *   tensors' getters, calls of its Python functions), as an extension built without torch's
 *   headers, for any torch, would reach it.
 * - native_floor_torch (OPWATCH_TORCH_API defined): torch's C++ API where it has one (a
 *   tensor's sizes, dtype and device, the autograd node and sequence number, aminmax_out), as
 *   an extension built against one torch's headers (one build per torch version) would.
 *
 * One C function per op, bound to its state (a Floor object): called by torch as the mode's
 * __torch_dispatch__(func, types, args, kwargs), with no Python frame of its own. Per op, as
 * RecordsFloor: the caller's code and instruction offset, the autograd node and sequence
 * number, the (shape, dtype, device, ident) of every tensor argument and result (shapes
 * interned), one entry in a ring of max_records entries. ReadsFloor's extra: one aminmax of
 * the first floating result of an op the nan/inf check reads, into two slots of a reusable
 * buffer (float32) or a new pair (other dtypes), and a weak reference to it.
 *
 * The torch build also holds three parts of the real watch's per-op work, ported as they are
 * (watch_metas, watch_reduce, watch_head: opwatch's tensor_metas, NonFiniteTracker._reduce and
 * OpInterceptor._head), which bench.native.native_parts swaps in to measure what porting them
 * buys; they read and write opwatch's private attributes by name, like bench.ablate's stubs.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <frameobject.h>

#ifdef OPWATCH_TORCH_API
#include <ATen/ATen.h>
#include <ATen/SequenceNumber.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/node.h>
#include <torch/csrc/autograd/python_variable.h>
#include <unordered_map>
#include <vector>
#define MODULE_NAME "native_floor_torch"
#define MODULE_INIT PyInit_native_floor_torch
#else
#define MODULE_NAME "native_floor"
#define MODULE_INIT PyInit_native_floor
#endif

typedef struct {
    PyObject_HEAD
    int reads;
    PyObject *tensor_type;   /* torch.Tensor */
    PyObject *make_plan;     /* func -> (kernel, reads) */
    PyObject *plans;         /* dict: id(func) -> plan */
    PyObject *shapes;        /* dict: torch.Size -> tuple */
    PyObject *current_node;  /* torch._C._current_autograd_node */
    PyObject *sequence_nr;   /* torch._C._autograd._get_sequence_nr */
    PyObject *aminmax;       /* torch.aminmax */
    PyObject *read_dtypes;   /* tuple of the dtypes read */
    PyObject *float32;
    PyObject *out_pairs;     /* tuple of (slot, slot) tuples */
    PyObject *out_name;      /* ("out",) */
    PyObject *entries;       /* list: the ring */
    PyObject *refs;          /* list: the ring of weak references */
    Py_ssize_t capacity, next_entry, next_ref, next_pair, pairs;
    PyObject *s_shape, *s_dtype, *s_device;
} Floor;

static void floor_dealloc(Floor *self) {
    Py_XDECREF(self->tensor_type); Py_XDECREF(self->make_plan); Py_XDECREF(self->plans);
    Py_XDECREF(self->shapes); Py_XDECREF(self->current_node); Py_XDECREF(self->sequence_nr);
    Py_XDECREF(self->aminmax); Py_XDECREF(self->read_dtypes); Py_XDECREF(self->float32);
    Py_XDECREF(self->out_pairs); Py_XDECREF(self->out_name); Py_XDECREF(self->entries);
    Py_XDECREF(self->refs); Py_XDECREF(self->s_shape); Py_XDECREF(self->s_dtype); Py_XDECREF(self->s_device);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject FloorType = {PyVarObject_HEAD_INIT(NULL, 0)};  /* its fields set in the module's init */

#ifdef OPWATCH_TORCH_API
/* Interned shapes and device objects, keyed by their C++ values (one process, one floor at a time). */
static std::unordered_map<size_t, std::vector<std::pair<std::vector<int64_t>, PyObject *>>> shape_cache;
static std::unordered_map<int64_t, PyObject *> device_cache;
static std::vector<at::Tensor> slot_tensors;  /* the reusable (min, max) slots, as C++ tensors */

static int is_tensor(Floor *self, PyObject *value) {
    return THPVariable_Check(value);
}

static PyObject *interned_shape(at::IntArrayRef sizes) {
    size_t hash = sizes.size();
    for (int64_t size : sizes) hash = hash * 1000003u ^ (size_t)size;
    auto &bucket = shape_cache[hash];
    for (auto &known : bucket)
        if (at::IntArrayRef(known.first) == sizes) return known.second;
    PyObject *shape = PyTuple_New((Py_ssize_t)sizes.size());
    if (shape == NULL) return NULL;
    for (size_t i = 0; i < sizes.size(); i++) PyTuple_SET_ITEM(shape, i, PyLong_FromLongLong(sizes[i]));
    bucket.emplace_back(sizes.vec(), shape);  /* kept for the process */
    return shape;
}

static PyObject *interned_device(const at::Device &device) {
    int64_t key = ((int64_t)device.type() << 16) | (uint16_t)device.index();
    auto found = device_cache.find(key);
    if (found != device_cache.end()) return found->second;
    PyObject *object = THPDevice_New(device);
    if (object != NULL) device_cache.emplace(key, object);
    return object;
}

static PyObject *meta_of(Floor *self, PyObject *tensor, Py_ssize_t *count) {
    const at::Tensor &value = THPVariable_Unpack(tensor);
    PyObject *shape = interned_shape(value.sizes());
    PyObject *device = shape == NULL ? NULL : interned_device(value.device());
    if (device == NULL) return NULL;
    if (count != NULL) *count = (Py_ssize_t)value.numel();
    PyObject *dtype = (PyObject *)torch::getTHPDtype(value.scalar_type());
    PyObject *ident = PyLong_FromVoidPtr(tensor);
    if (ident == NULL) return NULL;
    PyObject *meta = PyTuple_Pack(4, shape, dtype, device, ident);  /* new references to the rest */
    Py_DECREF(ident);
    return meta;
}

static int reduce(Floor *self, PyObject *value, PyObject *meta) {
    const at::Tensor &tensor = THPVariable_Unpack(value);
    if (PyTuple_GET_ITEM(meta, 1) == self->float32) {
        Py_ssize_t pair = self->next_pair;
        at::aminmax_out(slot_tensors[2 * pair], slot_tensors[2 * pair + 1], tensor);
        self->next_pair = (pair + 1) % self->pairs;
    } else {
        at::aminmax(tensor);
    }
    PyObject *ref = PyWeakref_NewRef(value, NULL);
    if (ref == NULL) return -1;
    PyList_SetItem(self->refs, self->next_ref, ref);  /* steals ref */
    self->next_ref = (self->next_ref + 1) % self->capacity;
    return 0;
}

/* watch_metas(tensors, shapes): opwatch.core.records.tensor_metas for an op with no tensor
 * subclass of its own (the watch's common case), through torch's C++ API: [(shape, dtype,
 * device, ident), ...] with each shape interned in the watch's own table (``shapes``, a dict
 * whose __missing__ interns a shape), or None where a tensor is not a plain one or has
 * symbolic sizes (the caller then takes the Python path). bench.native.native_metadata. */
static PyObject *watch_metas(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !(PyList_Check(args[0]) || PyTuple_Check(args[0]))) {
        PyErr_SetString(PyExc_TypeError, "watch_metas(tensors: list or tuple, shapes)");
        return NULL;
    }
    PyObject *shapes = args[1];
    Py_ssize_t count = PySequence_Fast_GET_SIZE(args[0]);
    PyObject **tensors = PySequence_Fast_ITEMS(args[0]);
    PyObject *metas = PyList_New(count);
    if (metas == NULL) return NULL;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *tensor = tensors[i];
        if (!THPVariable_Check(tensor)) { Py_DECREF(metas); Py_RETURN_NONE; }
        const at::Tensor &value = THPVariable_Unpack(tensor);
        if (value.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) { Py_DECREF(metas); Py_RETURN_NONE; }
        at::IntArrayRef sizes = value.sizes();
        PyObject *key = PyTuple_New((Py_ssize_t)sizes.size());
        if (key == NULL) { Py_DECREF(metas); return NULL; }
        for (size_t j = 0; j < sizes.size(); j++) PyTuple_SET_ITEM(key, j, PyLong_FromLongLong(sizes[j]));
        PyObject *shape = PyDict_GetItemWithError(shapes, key);
        if (shape != NULL) Py_INCREF(shape);
        else if (!PyErr_Occurred()) shape = PyObject_GetItem(shapes, key);  /* interned by __missing__ */
        Py_DECREF(key);
        PyObject *device = shape == NULL ? NULL : interned_device(value.device());
        PyObject *ident = device == NULL ? NULL : PyLong_FromVoidPtr(tensor);
        if (ident == NULL) { Py_XDECREF(shape); Py_DECREF(metas); return NULL; }
        PyObject *meta = PyTuple_Pack(4, shape, (PyObject *)torch::getTHPDtype(value.scalar_type()), device, ident);
        Py_DECREF(shape); Py_DECREF(ident);
        if (meta == NULL) { Py_DECREF(metas); return NULL; }
        PyList_SET_ITEM(metas, i, meta);
    }
    return metas;
}

/* watch_reduce(tracker, index, outputs, metas): opwatch's NonFiniteTracker._reduce (queue each
 * checked output's (min, max) into its buffer's next two slots, remember the output) with the
 * kernels called through torch's C++ API and the bookkeeping through the CPython API. The
 * tracker's constants come from watch_reduce_setup; outputs that are no plain tensor, or of a
 * dtype read through a conversion, go to the tracker's own _reduce_other. bench.native. */
static struct {
    PyObject *checked, *plain_types, *converted, *split_dtypes, *float16;
    Py_ssize_t chunk, split_from, split_strided_from;
    PyObject *s_known, *s_known_limit, *s_stats, *s_stats_key, *s_buffer_for, *s_reduce_other, *s_drop_dead_known;
    PyObject *s_used, *s_base, *s_views, *s_slots, *s_indices, *s_positions, *s_refs, *s_half;
} reducing;

static PyObject *watch_reduce_setup(PyObject *module, PyObject *args) {
    if (!PyArg_ParseTuple(args, "OOOOOnnn", &reducing.checked, &reducing.plain_types, &reducing.converted, &reducing.split_dtypes,
                          &reducing.float16, &reducing.chunk, &reducing.split_from, &reducing.split_strided_from))
        return NULL;
    PyObject *held[] = {reducing.checked, reducing.plain_types, reducing.converted, reducing.split_dtypes, reducing.float16};
    for (PyObject *object : held) Py_INCREF(object);  /* kept for the process */
    const char *names[] = {"_known", "_known_limit", "_stats", "_stats_key", "_buffer_for", "_reduce_other", "_drop_dead_known",
                           "used", "base", "views", "_slots", "_indices", "_positions", "_refs", "_half"};
    PyObject **slots[] = {&reducing.s_known, &reducing.s_known_limit, &reducing.s_stats, &reducing.s_stats_key, &reducing.s_buffer_for,
                          &reducing.s_reduce_other, &reducing.s_drop_dead_known, &reducing.s_used, &reducing.s_base, &reducing.s_views,
                          &reducing.s_slots, &reducing.s_indices, &reducing.s_positions, &reducing.s_refs, &reducing.s_half};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        if ((*slots[i] = PyUnicode_InternFromString(names[i])) == NULL) return NULL;
    Py_RETURN_NONE;
}

/* Append to the list attribute ``name`` of ``owner``. */
static int append_to(PyObject *owner, PyObject *name, PyObject *value) {
    PyObject *list = PyObject_GetAttr(owner, name);
    if (list == NULL) return -1;
    int failed = PyList_Append(list, value);
    Py_DECREF(list);
    return failed;
}

static Py_ssize_t int_attr(PyObject *owner, PyObject *name) {
    PyObject *value = PyObject_GetAttr(owner, name);
    if (value == NULL) return -1;
    Py_ssize_t number = PyLong_AsSsize_t(value);
    Py_DECREF(value);
    return number;
}

/* Whether the tracker's buffer in use is ``buffer`` for (device, dtype) with a free pair. */
static int buffer_fits(PyObject *tracker, PyObject *buffer, PyObject *device, PyObject *dtype) {
    if (buffer == Py_None) return 0;
    Py_ssize_t used = int_attr(buffer, reducing.s_used);
    if (used < 0) return -1;
    if (used == reducing.chunk) return 0;
    PyObject *key = PyObject_GetAttr(tracker, reducing.s_stats_key);
    if (key == NULL) return -1;
    int fits = PyTuple_Check(key) && PyTuple_GET_SIZE(key) == 2 && PyTuple_GET_ITEM(key, 1) == dtype;
    if (fits) fits = PyObject_RichCompareBool(PyTuple_GET_ITEM(key, 0), device, Py_EQ);
    Py_DECREF(key);
    return fits;
}

static int queue_one(PyObject *tracker, PyObject *index, Py_ssize_t position, PyObject *tensor, const at::Tensor &value,
                     PyObject *device, PyObject *dtype, PyObject **known) {
    PyObject *buffer = PyObject_GetAttr(tracker, reducing.s_stats);
    if (buffer == NULL) return -1;
    int fits = buffer_fits(tracker, buffer, device, dtype);
    if (fits <= 0) {
        Py_DECREF(buffer);
        if (fits < 0) return -1;
        buffer = PyObject_CallMethodObjArgs(tracker, reducing.s_buffer_for, device, dtype, NULL);
        if (buffer == NULL) return -1;
    }
    Py_ssize_t used = int_attr(buffer, reducing.s_used), base = used < 0 ? -1 : int_attr(buffer, reducing.s_base);
    PyObject *views = base < 0 ? NULL : PyObject_GetAttr(buffer, reducing.s_views);
    if (views == NULL) { Py_DECREF(buffer); return -1; }
    const at::Tensor &low = THPVariable_Unpack(PyTuple_GET_ITEM(views, used));
    const at::Tensor &high = THPVariable_Unpack(PyTuple_GET_ITEM(views, used + 1));
    int64_t count = value.numel();
    try {
        if (PySet_Contains(reducing.split_dtypes, dtype) == 1 && value.device().is_cpu()
            && (count >= reducing.split_from || (count >= reducing.split_strided_from && !value.is_contiguous()))) {
            at::Tensor low_out = low, high_out = high;
            at::amin_out(low_out, value, {}, false);
            at::amax_out(high_out, value, {}, false);
        } else {
            at::Tensor low_out = low, high_out = high;
            at::aminmax_out(low_out, high_out, value, c10::nullopt, false);
        }
    } catch (const std::exception &error) {
        Py_DECREF(views); Py_DECREF(buffer);
        PyErr_SetString(PyExc_RuntimeError, error.what());
        return -1;
    }
    Py_DECREF(views);
    PyObject *now_used = PyLong_FromSsize_t(used + 2), *slot = PyLong_FromSsize_t(base + used);
    PyObject *where = PyLong_FromSsize_t(position), *ref = PyWeakref_NewRef(tensor, NULL), *ident = PyLong_FromVoidPtr(tensor);
    int failed = now_used == NULL || slot == NULL || where == NULL || ref == NULL || ident == NULL
        || PyObject_SetAttr(buffer, reducing.s_used, now_used) < 0
        || append_to(tracker, reducing.s_slots, slot) < 0 || append_to(tracker, reducing.s_indices, index) < 0
        || append_to(tracker, reducing.s_positions, where) < 0 || append_to(tracker, reducing.s_refs, ref) < 0
        || PyDict_SetItem(*known, ident, ref) < 0;
    if (!failed && dtype == reducing.float16) {
        PyObject *half = PyObject_GetAttr(tracker, reducing.s_half);
        PyObject *key = half == NULL ? NULL : PyLong_FromLongLong((PyLong_AsLongLong(index) << 32) | position);
        failed = key == NULL || PySet_Add(half, key) < 0;
        Py_XDECREF(half); Py_XDECREF(key);
    }
    Py_XDECREF(now_used); Py_XDECREF(slot); Py_XDECREF(where); Py_XDECREF(ref); Py_XDECREF(ident);
    Py_DECREF(buffer);
    if (failed) return -1;
    Py_ssize_t limit = int_attr(tracker, reducing.s_known_limit);
    if (limit < 0) return -1;
    if (PyDict_GET_SIZE(*known) > limit) {
        PyObject *done = PyObject_CallMethodNoArgs(tracker, reducing.s_drop_dead_known);
        if (done == NULL) return -1;
        Py_DECREF(done);
        Py_DECREF(*known);
        if ((*known = PyObject_GetAttr(tracker, reducing.s_known)) == NULL) return -1;
    }
    return 0;
}

static PyObject *watch_reduce(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 || !PyTuple_Check(args[2]) || !PyList_Check(args[3]) || reducing.checked == NULL) {
        PyErr_SetString(PyExc_TypeError, "watch_reduce(tracker, index, outputs: tuple, metas: list), after watch_reduce_setup");
        return NULL;
    }
    PyObject *tracker = args[0], *index = args[1], *outputs = args[2], *metas = args[3];
    PyObject *known = PyObject_GetAttr(tracker, reducing.s_known);
    if (known == NULL) return NULL;
    for (Py_ssize_t position = 0; position < PyTuple_GET_SIZE(outputs); position++) {
        PyObject *tensor = PyTuple_GET_ITEM(outputs, position), *meta = PyList_GET_ITEM(metas, position);
        PyObject *dtype = PyTuple_GET_ITEM(meta, 1);
        int checked = PySet_Contains(reducing.checked, dtype);
        int plain = checked == 1 ? PySet_Contains(reducing.plain_types, (PyObject *)Py_TYPE(tensor)) : 0;
        int converted = plain == 1 ? PySet_Contains(reducing.converted, dtype) : 0;
        if (checked < 0 || plain < 0 || converted < 0) { Py_DECREF(known); return NULL; }
        if (!checked) continue;  /* integers, booleans */
        if (!plain || converted) {
            PyObject *where = PyLong_FromSsize_t(position);
            PyObject *done = where == NULL ? NULL : PyObject_CallMethodObjArgs(tracker, reducing.s_reduce_other, index, where, tensor, meta, NULL);
            Py_XDECREF(where);
            Py_DECREF(known);
            if (done == NULL) return NULL;
            Py_DECREF(done);
            if ((known = PyObject_GetAttr(tracker, reducing.s_known)) == NULL) return NULL;
            continue;
        }
        const at::Tensor &value = THPVariable_Unpack(tensor);
        if (value.is_meta() || value.layout() != at::kStrided || value.is_nested() || value._is_zerotensor() || value.numel() == 0) continue;
        if (queue_one(tracker, index, position, tensor, value, PyTuple_GET_ITEM(meta, 2), dtype, &known) < 0) { Py_XDECREF(known); return NULL; }
    }
    Py_DECREF(known);
    Py_RETURN_NONE;
}

/* watch_head(interceptor, plan, others): opwatch's OpInterceptor._head (the start of an op's
 * entry: index, op, site, module, phase, forward op, other arguments; the check context told the
 * site and phase) with the frame walk, the autograd node and the sequence number read natively
 * and the tables (the watch's own dicts) through the CPython API. Called from a Python method
 * standing in for _head, so the op's caller is two frames up, as for _head. The constants come
 * from watch_head_setup. bench.native. */
static struct {
    long user, engine;
    PyObject *classify_code, *forward, *backward, *no_site, *drop_oldest_half;
    PyObject *s_modules, *s_call_frame, *s_call_answer, *s_current, *s_forward_sites, *s_log, *s_site_ids, *s_site_id;
    PyObject *s_last_seq, *s_site_tuples, *s_table_limit, *s_context, *s_site, *s_phase, *s_args, *s_next_index, *s_func_id, *s_f_lasti;
} heading;
static std::unordered_map<PyObject *, long> code_kinds;  /* code object (held) -> its kind */

static PyObject *watch_head_setup(PyObject *module, PyObject *args) {
    if (!PyArg_ParseTuple(args, "llOOOOO", &heading.user, &heading.engine, &heading.classify_code, &heading.forward, &heading.backward,
                          &heading.no_site, &heading.drop_oldest_half))
        return NULL;
    PyObject *held[] = {heading.classify_code, heading.forward, heading.backward, heading.no_site, heading.drop_oldest_half};
    for (PyObject *object : held) Py_INCREF(object);  /* kept for the process */
    const char *names[] = {"_modules", "call_frame", "call_answer", "current", "forward_sites", "_log", "site_ids", "site_id", "_last_seq",
                           "_site_tuples", "_table_limit", "_context", "site", "phase", "args", "next_index", "func_id", "f_lasti"};
    PyObject **slots[] = {&heading.s_modules, &heading.s_call_frame, &heading.s_call_answer, &heading.s_current, &heading.s_forward_sites,
                          &heading.s_log, &heading.s_site_ids, &heading.s_site_id, &heading.s_last_seq, &heading.s_site_tuples,
                          &heading.s_table_limit, &heading.s_context, &heading.s_site, &heading.s_phase, &heading.s_args,
                          &heading.s_next_index, &heading.s_func_id, &heading.s_f_lasti};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        if ((*slots[i] = PyUnicode_InternFromString(names[i])) == NULL) return NULL;
    Py_RETURN_NONE;
}

static long kind_of(PyObject *code) {
    auto found = code_kinds.find(code);
    if (found != code_kinds.end()) return found->second;
    PyObject *kind = PyObject_CallOneArg(heading.classify_code, code);
    if (kind == NULL) return -1;
    long value = PyLong_AsLong(kind);
    Py_DECREF(kind);
    Py_INCREF(code);
    code_kinds.emplace(code, value);
    return value;
}

/* sites.user_frame from the op's caller: a new reference to (code, lasti, reached_engine). */
static PyObject *user_frame_of(PyObject *stop_frame, PyObject *stop_answer) {
    PyFrameObject *frame = PyEval_GetFrame();  /* the method standing in for _head */
    Py_XINCREF(frame);
    for (int up = 0; up < 2 && frame != NULL; up++) {  /* past it and __torch_dispatch__ */
        PyFrameObject *back = PyFrame_GetBack(frame);
        Py_DECREF(frame);
        frame = back;
    }
    while (frame != NULL) {
        if ((PyObject *)frame == stop_frame) { Py_DECREF(frame); return Py_NewRef(stop_answer); }
        PyCodeObject *code = PyFrame_GetCode(frame);
        long kind = kind_of((PyObject *)code);
        if (kind < 0) { Py_DECREF(code); Py_DECREF(frame); return NULL; }
        if (kind == heading.user) {
            PyObject *lasti = PyObject_GetAttr((PyObject *)frame, heading.s_f_lasti);
            Py_DECREF(frame);
            if (lasti == NULL) { Py_DECREF(code); return NULL; }
            return Py_BuildValue("(NNO)", (PyObject *)code, lasti, Py_False);
        }
        Py_DECREF(code);
        if (kind == heading.engine) { Py_DECREF(frame); return Py_BuildValue("(OiO)", Py_None, 0, Py_True); }
        PyFrameObject *back = PyFrame_GetBack(frame);
        Py_DECREF(frame);
        frame = back;
    }
    return Py_BuildValue("(OiO)", Py_None, 0, Py_False);
}

static PyObject *watch_head(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || heading.classify_code == NULL) {
        PyErr_SetString(PyExc_TypeError, "watch_head(interceptor, plan, others), after watch_head_setup");
        return NULL;
    }
    PyObject *self = args[0], *plan = args[1], *others = args[2];
    PyObject *result = NULL, *modules = NULL, *stop_frame = NULL, *stop_answer = NULL, *walk = NULL, *module_path = NULL;
    PyObject *site = NULL, *forward_func = NULL, *phase = NULL, *log = NULL, *func_id = NULL, *context = NULL, *index = NULL;
    if ((modules = PyObject_GetAttr(self, heading.s_modules)) == NULL) goto done;
    if ((stop_frame = PyObject_GetAttr(modules, heading.s_call_frame)) == NULL) goto done;
    if ((stop_answer = PyObject_GetAttr(modules, heading.s_call_answer)) == NULL) goto done;
    if ((walk = user_frame_of(stop_frame, stop_answer)) == NULL) goto done;
    if ((module_path = PyObject_GetAttr(modules, heading.s_current)) == NULL) goto done;
    if ((log = PyObject_GetAttr(self, heading.s_log)) == NULL) goto done;
    if ((func_id = PyObject_GetAttr(plan, heading.s_func_id)) == NULL) goto done;
    {
        PyObject *code = PyTuple_GET_ITEM(walk, 0), *lasti = PyTuple_GET_ITEM(walk, 1);
        int reached_engine = PyTuple_GET_ITEM(walk, 2) == Py_True;
        c10::intrusive_ptr<torch::autograd::Node> running = torch::autograd::get_current_node();
        forward_func = PyLong_FromLong(-1);
        if (running && (reached_engine || code == Py_None)) {
            phase = Py_NewRef(heading.backward);
            PyObject *sites = PyObject_GetAttr(self, heading.s_forward_sites);
            PyObject *key = sites == NULL ? NULL : PyLong_FromUnsignedLongLong(running->sequence_nr());
            PyObject *known = key == NULL ? NULL : PyDict_GetItemWithError(sites, key);
            Py_XDECREF(key); Py_XDECREF(sites);
            if (known == NULL && PyErr_Occurred()) goto done;
            if (known == NULL) known = heading.no_site;
            site = Py_NewRef(PyTuple_GET_ITEM(known, 0));
            int has_module = PyObject_IsTrue(module_path);
            if (has_module < 0) goto done;
            if (!has_module) Py_SETREF(module_path, Py_NewRef(PyTuple_GET_ITEM(known, 1)));
            Py_SETREF(forward_func, Py_NewRef(PyTuple_GET_ITEM(known, 2)));
        } else if (reached_engine) {
            phase = Py_NewRef(heading.backward);
            site = PyLong_FromLong(0);
        } else {
            phase = Py_NewRef(!running ? heading.forward : heading.backward);
            PyObject *site_ids = PyObject_GetAttr(log, heading.s_site_ids);
            PyObject *ident = site_ids == NULL ? NULL : PyLong_FromVoidPtr(code);
            PyObject *key = ident == NULL ? NULL : PyTuple_Pack(2, ident, lasti);
            PyObject *known = key == NULL ? NULL : PyDict_GetItemWithError(site_ids, key);
            Py_XDECREF(ident); Py_XDECREF(key); Py_XDECREF(site_ids);
            if (known != NULL) site = Py_NewRef(known);
            else if (PyErr_Occurred()) goto done;
            else if ((site = PyObject_CallMethodObjArgs(log, heading.s_site_id, code, lasti, NULL)) == NULL) goto done;
        }
    }
    {
        uint64_t seq = at::sequence_number::peek();
        PyObject *last = PyObject_GetAttr(self, heading.s_last_seq);
        if (last == NULL) goto done;
        unsigned long long last_seq = PyLong_AsUnsignedLongLong(last);
        Py_DECREF(last);
        if (PyErr_Occurred()) goto done;
        if (seq != last_seq) {
            PyObject *now = PyLong_FromUnsignedLongLong(seq);
            if (now == NULL || PyObject_SetAttr(self, heading.s_last_seq, now) < 0) { Py_XDECREF(now); goto done; }
            Py_DECREF(now);
            int own = PyLong_AsLong(forward_func) < 0;
            PyObject *known = PyTuple_Pack(3, site, module_path, own ? func_id : forward_func);
            PyObject *tuples = known == NULL ? NULL : PyObject_GetAttr(self, heading.s_site_tuples);
            PyObject *kept = tuples == NULL ? NULL : PyDict_SetDefault(tuples, known, known);
            PyObject *sites = kept == NULL ? NULL : PyObject_GetAttr(self, heading.s_forward_sites);
            PyObject *key = sites == NULL ? NULL : PyLong_FromUnsignedLongLong(seq - 1);
            int failed = key == NULL || PyDict_SetItem(sites, key, kept) < 0;
            Py_XDECREF(key); Py_XDECREF(known);
            if (!failed) {
                PyObject *limit = PyObject_GetAttr(self, heading.s_table_limit);
                Py_ssize_t most = limit == NULL ? -1 : PyLong_AsSsize_t(limit);
                Py_XDECREF(limit);
                failed = most < 0;
                if (!failed && PyDict_GET_SIZE(sites) > most) {
                    PyObject *dropped = PyObject_CallOneArg(heading.drop_oldest_half, sites);
                    failed = dropped == NULL;
                    Py_XDECREF(dropped);
                    if (!failed) PyDict_Clear(tuples);
                }
            }
            Py_XDECREF(sites); Py_XDECREF(tuples);
            if (failed) goto done;
        }
    }
    if ((context = PyObject_GetAttr(self, heading.s_context)) == NULL) goto done;
    if (PyObject_SetAttr(context, heading.s_site, site) < 0 || PyObject_SetAttr(context, heading.s_phase, phase) < 0
        || PyObject_SetAttr(context, heading.s_args, others) < 0)
        goto done;
    if ((index = PyObject_GetAttr(log, heading.s_next_index)) == NULL) goto done;
    {
        PyObject *next = PyLong_FromSsize_t(PyLong_AsSsize_t(index) + 1);
        if (next == NULL || PyObject_SetAttr(log, heading.s_next_index, next) < 0) { Py_XDECREF(next); goto done; }
        Py_DECREF(next);
        PyObject *arguments = PySequence_Tuple(others);
        if (arguments == NULL) goto done;
        result = PyTuple_Pack(7, index, func_id, site, module_path, phase, forward_func, arguments);
        Py_DECREF(arguments);
    }
done:
    Py_XDECREF(modules); Py_XDECREF(stop_frame); Py_XDECREF(stop_answer); Py_XDECREF(walk); Py_XDECREF(module_path);
    Py_XDECREF(site); Py_XDECREF(forward_func); Py_XDECREF(phase); Py_XDECREF(log); Py_XDECREF(func_id); Py_XDECREF(context);
    Py_XDECREF(index);
    return result;
}

/* Whether no autograd node runs now (forward), and the thread's sequence number. */
static int in_forward(Floor *self) { return torch::autograd::get_current_node() == nullptr; }
static PyObject *sequence_number(Floor *self) { return PyLong_FromUnsignedLongLong(at::sequence_number::peek()); }
#else
static int is_tensor(Floor *self, PyObject *value) {
    PyTypeObject *type = Py_TYPE(value);
    return type == (PyTypeObject *)self->tensor_type || PyType_IsSubtype(type, (PyTypeObject *)self->tensor_type);
}

/* (shape, dtype, device, ident) of one tensor, new reference; *count: its number of elements. */
static PyObject *meta_of(Floor *self, PyObject *tensor, Py_ssize_t *count) {
    PyObject *size = PyObject_GetAttr(tensor, self->s_shape);
    if (size == NULL) return NULL;
    PyObject *shape = PyDict_GetItemWithError(self->shapes, size);
    if (shape == NULL) {
        if (PyErr_Occurred()) { Py_DECREF(size); return NULL; }
        shape = PySequence_Tuple(size);
        if (shape == NULL || PyDict_SetItem(self->shapes, size, shape) < 0) { Py_XDECREF(shape); Py_DECREF(size); return NULL; }
        Py_DECREF(shape);  /* the dict holds it */
    }
    if (count != NULL) {
        Py_ssize_t n = 1, length = PyTuple_GET_SIZE(shape);
        for (Py_ssize_t i = 0; i < length; i++) n *= PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, i));
        *count = n;
    }
    Py_DECREF(size);
    PyObject *dtype = PyObject_GetAttr(tensor, self->s_dtype);
    PyObject *device = dtype == NULL ? NULL : PyObject_GetAttr(tensor, self->s_device);
    PyObject *ident = device == NULL ? NULL : PyLong_FromVoidPtr(tensor);
    if (ident == NULL) { Py_XDECREF(dtype); Py_XDECREF(device); return NULL; }
    Py_INCREF(shape);
    PyObject *meta = PyTuple_New(4);
    if (meta == NULL) { Py_DECREF(shape); Py_DECREF(dtype); Py_DECREF(device); Py_DECREF(ident); return NULL; }
    PyTuple_SET_ITEM(meta, 0, shape); PyTuple_SET_ITEM(meta, 1, dtype);
    PyTuple_SET_ITEM(meta, 2, device); PyTuple_SET_ITEM(meta, 3, ident);
    return meta;
}


static int in_forward(Floor *self) {
    PyObject *node = PyObject_CallNoArgs(self->current_node);
    if (node == NULL) return -1;
    int forward = node == Py_None;
    Py_DECREF(node);
    return forward;
}

static PyObject *sequence_number(Floor *self) { return PyObject_CallNoArgs(self->sequence_nr); }

/* The first floating result's (min, max), and a weak reference to it. */
static int reduce(Floor *self, PyObject *value, PyObject *meta) {
    PyObject *dtype = PyTuple_GET_ITEM(meta, 1), *result;
    if (dtype == self->float32) {
        PyObject *call[3] = {NULL, value, PyTuple_GET_ITEM(self->out_pairs, self->next_pair)};
        result = PyObject_Vectorcall(self->aminmax, call + 1, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, self->out_name);
        self->next_pair = (self->next_pair + 1) % self->pairs;
    } else {
        result = PyObject_CallOneArg(self->aminmax, value);
    }
    if (result == NULL) return -1;
    Py_DECREF(result);
    PyObject *ref = PyWeakref_NewRef(value, NULL);
    if (ref == NULL) return -1;
    PyList_SetItem(self->refs, self->next_ref, ref);  /* steals ref */
    self->next_ref = (self->next_ref + 1) % self->capacity;
    return 0;
}
#endif

static int read_dtype(Floor *self, PyObject *dtype) {
    Py_ssize_t n = PyTuple_GET_SIZE(self->read_dtypes);
    for (Py_ssize_t i = 0; i < n; i++) if (PyTuple_GET_ITEM(self->read_dtypes, i) == dtype) return 1;
    return 0;
}

static PyObject *s_state;  /* "_native_state": the mode's attribute holding its Floor */

#define STACK_METAS 32

/* Twice the room in *metas (a heap copy of the stack array the first time); -1 when out of
 * memory, *metas then as it was. */
static int grow(PyObject ***metas, PyObject **stack_metas, Py_ssize_t *capacity) {
    Py_ssize_t larger = 2 * *capacity;
    PyObject **more = *metas == stack_metas ? (PyObject **)PyMem_Malloc(larger * sizeof(PyObject *))
                                            : (PyObject **)PyMem_Realloc(*metas, larger * sizeof(PyObject *));
    if (more == NULL) { PyErr_NoMemory(); return -1; }
    if (*metas == stack_metas) memcpy(more, stack_metas, *capacity * sizeof(PyObject *));
    *metas = more;
    *capacity = larger;
    return 0;
}

static PyObject *dispatch(PyObject *mode, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    /* Every local declared here: the exits below jump to fail. */
    /* The op's tensors' metadata: on the stack, or on the heap past STACK_METAS tensors. */
    PyObject *stack_metas[STACK_METAS], **metas = stack_metas, *single[1], **results = NULL;
    Py_ssize_t nmetas = 0, capacity = STACK_METAS, nresults = 0, count, i;
    PyObject *state, *func, *op_args, *op_kwargs, *kernel, *value, *meta;
    PyObject *out = NULL, *entry = NULL, *seq = NULL, *plan = NULL, *key = NULL;
    PyFrameObject *caller;
    PyCodeObject *code = NULL;
    int lasti, forward, reads, first = 1;
    Floor *self;

    /* torch requires the callable's __self__ to be the mode: the Floor is its attribute. */
    state = PyObject_GetAttr(mode, s_state);
    if (state == NULL) return NULL;
    Py_DECREF(state);  /* the mode holds it */
    if (!PyObject_TypeCheck(state, &FloorType)) { PyErr_SetString(PyExc_TypeError, "_native_state: a Floor"); return NULL; }
    self = (Floor *)state;
    if (nargs < 3 || !PyTuple_Check(args[2])) { PyErr_SetString(PyExc_TypeError, "__torch_dispatch__(func, types, args: tuple, kwargs)"); return NULL; }
    func = args[0]; op_args = args[2]; op_kwargs = nargs > 3 ? args[3] : Py_None;

    caller = PyEval_GetFrame();  /* borrowed: the Python frame that ran the op */
    if (caller != NULL) code = PyFrame_GetCode(caller);
#if PY_VERSION_HEX >= 0x030B0000
    lasti = caller == NULL ? -1 : PyFrame_GetLasti(caller);
#else
    lasti = caller == NULL ? -1 : caller->f_lasti;
#endif
    forward = in_forward(self);
    if (forward < 0) goto fail;
    for (i = 0; i < PyTuple_GET_SIZE(op_args); i++) {
        value = PyTuple_GET_ITEM(op_args, i);
        if (!is_tensor(self, value)) continue;
        if (nmetas == capacity && grow(&metas, stack_metas, &capacity) < 0) goto fail;
        if ((metas[nmetas] = meta_of(self, value, NULL)) == NULL) goto fail;
        nmetas++;
    }
    key = PyLong_FromVoidPtr(func);
    if (key == NULL) goto fail;
    plan = PyDict_GetItemWithError(self->plans, key);
    if (plan != NULL) {
        Py_INCREF(plan);
    } else {
        if (PyErr_Occurred()) goto fail;
        plan = PyObject_CallOneArg(self->make_plan, func);
        if (plan == NULL || PyDict_SetItem(self->plans, key, plan) < 0) goto fail;
    }
    kernel = PyTuple_GET_ITEM(plan, 0);
    reads = self->reads && PyObject_IsTrue(PyTuple_GET_ITEM(plan, 1));
    if (op_kwargs == Py_None || (PyDict_Check(op_kwargs) && PyDict_GET_SIZE(op_kwargs) == 0))
        out = PyObject_Call(kernel, op_args, NULL);
    else
        out = PyObject_Call(kernel, op_args, op_kwargs);
    if (out == NULL) goto fail;

    single[0] = out;
    if (is_tensor(self, out)) { results = single; nresults = 1; }
    else if (PyTuple_CheckExact(out)) { results = &PyTuple_GET_ITEM(out, 0); nresults = PyTuple_GET_SIZE(out); }
    else if (PyList_CheckExact(out)) { results = &PyList_GET_ITEM(out, 0); nresults = PyList_GET_SIZE(out); }
    for (i = 0; i < nresults; i++) {
        value = results[i];
        if (!is_tensor(self, value)) continue;
        count = 0;
        if (nmetas == capacity && grow(&metas, stack_metas, &capacity) < 0) goto fail;
        meta = meta_of(self, value, &count);
        if (meta == NULL) goto fail;
        metas[nmetas++] = meta;
        if (reads && first && count > 0 && read_dtype(self, PyTuple_GET_ITEM(meta, 1)) && reduce(self, value, meta) < 0) goto fail;
        first = 0;
    }
    seq = sequence_number(self);
    if (seq == NULL) goto fail;
    entry = PyTuple_New(5 + nmetas);
    if (entry == NULL) goto fail;
    PyTuple_SET_ITEM(entry, 0, Py_NewRef(func));
    PyTuple_SET_ITEM(entry, 1, code == NULL ? Py_NewRef(Py_None) : (PyObject *)code);
    code = NULL;
    PyTuple_SET_ITEM(entry, 2, PyLong_FromLong(lasti));
    PyTuple_SET_ITEM(entry, 3, Py_NewRef(forward ? Py_True : Py_False));
    PyTuple_SET_ITEM(entry, 4, seq);
    seq = NULL;
    for (i = 0; i < nmetas; i++) PyTuple_SET_ITEM(entry, 5 + i, metas[i]);
    nmetas = 0;
    PyList_SetItem(self->entries, self->next_entry, entry);  /* steals entry */
    self->next_entry = (self->next_entry + 1) % self->capacity;
    Py_DECREF(plan); Py_DECREF(key);
    if (metas != stack_metas) PyMem_Free(metas);
    return out;

fail:
    for (i = 0; i < nmetas; i++) Py_DECREF(metas[i]);
    if (metas != stack_metas) PyMem_Free(metas);
    Py_XDECREF(code); Py_XDECREF(seq); Py_XDECREF(plan); Py_XDECREF(key); Py_XDECREF(out);
    return NULL;
}

static PyMethodDef dispatch_def = {"__torch_dispatch__", (PyCFunction)(void (*)(void))dispatch, METH_FASTCALL | METH_KEYWORDS, NULL};

/* bind(mode, reads, tensor_type, make_plan, current_node, sequence_nr, aminmax, read_dtypes,
 *      float32, slots, max_records) -> (state, the dispatch function bound to the mode); the
 * mode keeps the state as its _native_state. */
static PyObject *bind(PyObject *module, PyObject *args) {
    int reads;
    Py_ssize_t capacity;
    PyObject *mode, *tensor_type, *make_plan, *current_node, *sequence_nr, *aminmax, *read_dtypes, *float32, *slots;
    if (!PyArg_ParseTuple(args, "OpOOOOOO!OOn", &mode, &reads, &tensor_type, &make_plan, &current_node, &sequence_nr,
                          &aminmax, &PyTuple_Type, &read_dtypes, &float32, &slots, &capacity))
        return NULL;
    if (capacity < 1) { PyErr_SetString(PyExc_ValueError, "max_records must be 1 or more"); return NULL; }
    Floor *self = PyObject_New(Floor, &FloorType);
    if (self == NULL) return NULL;
    self->reads = reads;
    self->tensor_type = Py_NewRef(tensor_type); self->make_plan = Py_NewRef(make_plan);
    self->current_node = Py_NewRef(current_node); self->sequence_nr = Py_NewRef(sequence_nr);
    self->aminmax = Py_NewRef(aminmax); self->read_dtypes = Py_NewRef(read_dtypes); self->float32 = Py_NewRef(float32);
    self->plans = PyDict_New(); self->shapes = PyDict_New();
    self->capacity = capacity; self->next_entry = self->next_ref = self->next_pair = 0;
    self->entries = PyList_New(capacity); self->refs = PyList_New(capacity);
    for (Py_ssize_t i = 0; i < capacity; i++) {
        PyList_SET_ITEM(self->entries, i, Py_NewRef(Py_None));
        PyList_SET_ITEM(self->refs, i, Py_NewRef(Py_None));
    }
    Py_ssize_t nslots = PySequence_Size(slots);
    self->pairs = nslots / 2;
    self->out_pairs = PyTuple_New(self->pairs);
    for (Py_ssize_t i = 0; i < self->pairs; i++) {
        PyObject *low = PySequence_GetItem(slots, 2 * i), *high = PySequence_GetItem(slots, 2 * i + 1);
        PyTuple_SET_ITEM(self->out_pairs, i, PyTuple_Pack(2, low, high));
        Py_DECREF(low); Py_DECREF(high);
    }
#ifdef OPWATCH_TORCH_API
    slot_tensors.clear();
    for (Py_ssize_t i = 0; i < 2 * self->pairs; i++) {
        PyObject *slot = PySequence_GetItem(slots, i);
        if (slot == NULL) break;
        if (THPVariable_Check(slot)) slot_tensors.push_back(THPVariable_Unpack(slot));
        Py_DECREF(slot);
    }
    if (!PyErr_Occurred() && (Py_ssize_t)slot_tensors.size() != 2 * self->pairs) PyErr_SetString(PyExc_TypeError, "slots: tensors");
#endif
    self->out_name = Py_BuildValue("(s)", "out");
    self->s_shape = PyUnicode_InternFromString("shape");
    self->s_dtype = PyUnicode_InternFromString("dtype");
    self->s_device = PyUnicode_InternFromString("device");
    if (self->pairs < 1 || PyErr_Occurred()) { Py_DECREF(self); if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "slots: two or more"); return NULL; }
    PyObject *function = PyCFunction_New(&dispatch_def, mode);
    if (function == NULL) { Py_DECREF(self); return NULL; }
    return Py_BuildValue("(NN)", (PyObject *)self, function);
}

static PyObject *entries(PyObject *module, PyObject *state) {
    if (!PyObject_TypeCheck(state, &FloorType)) { PyErr_SetString(PyExc_TypeError, "a Floor"); return NULL; }
    return Py_NewRef(((Floor *)state)->entries);
}

static PyObject *refs(PyObject *module, PyObject *state) {
    if (!PyObject_TypeCheck(state, &FloorType)) { PyErr_SetString(PyExc_TypeError, "a Floor"); return NULL; }
    return Py_NewRef(((Floor *)state)->refs);
}

static PyMethodDef methods[] = {
    {"bind", bind, METH_VARARGS, "bind(...) -> (state, __torch_dispatch__)"},
    {"entries", entries, METH_O, "the state's ring of entries"},
    {"refs", refs, METH_O, "the state's ring of weak references to the outputs read"},
#ifdef OPWATCH_TORCH_API
    {"watch_metas", (PyCFunction)(void (*)(void))watch_metas, METH_FASTCALL, "opwatch's tensor_metas in torch's C++ API, or None"},
    {"watch_reduce_setup", watch_reduce_setup, METH_VARARGS, "the nan/inf tracker's constants, for watch_reduce"},
    {"watch_reduce", (PyCFunction)(void (*)(void))watch_reduce, METH_FASTCALL, "opwatch's NonFiniteTracker._reduce, natively"},
    {"watch_head_setup", watch_head_setup, METH_VARARGS, "the interceptor's constants, for watch_head"},
    {"watch_head", (PyCFunction)(void (*)(void))watch_head, METH_FASTCALL, "opwatch's OpInterceptor._head, natively"},
#endif
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, MODULE_NAME, NULL, -1, methods};

PyMODINIT_FUNC MODULE_INIT(void) {
    FloorType.tp_name = MODULE_NAME ".Floor";
    FloorType.tp_basicsize = sizeof(Floor);
    FloorType.tp_dealloc = (destructor)floor_dealloc;
    FloorType.tp_flags = Py_TPFLAGS_DEFAULT;
    if (PyType_Ready(&FloorType) < 0) return NULL;
    s_state = PyUnicode_InternFromString("_native_state");
    if (s_state == NULL) return NULL;
    return PyModule_Create(&module_def);
}
