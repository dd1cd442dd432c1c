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
