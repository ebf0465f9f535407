// _kiln_weight_watch: has any weight slot of a model changed since a snapshot? One C loop over the
// slots, for KilnModule's per-call check (torchkiln/watch.py holds the Python form and says what
// counts as a change: another object in the slot, a version bump, a new storage pointer).
//
// Why hand-written: the Python form reads three things per tensor through the interpreter, one
// after another, and right after a model call each read misses the cache. mobilenet-v2's 312
// weights took 144-240 us a call that way, 4-7% of its 3.4-ms bf16 call, on a 2-core Zen 5; this loop
// lets the CPU overlap those misses: 30-47 us, 39 with the TensorImpl prefetch below (which the
// dictionary lookups, ~28 us of it, then hide); ~50 us once its 210 submodule slots were watched
// too. RESULTS.md, twenty-seventh session.
#include <Python.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <cstring>
#include <exception>
#include <vector>

namespace {

// Inference tensors (made under torch.inference_mode()) have no version counter: reading it throws,
// and a C++ exception must not cross into Python. One fixed value for them (watch.py says what that
// leaves unseen).
int64_t version(const c10::TensorImpl* impl) {
  const auto& counter = impl->version_counter();  // none on an inference tensor, nor on one whose .data was
  return counter.enabled() ? static_cast<int64_t>(counter.current_version()) : -1;  // swapped for a normal one
}

int64_t storage_ptr(const c10::TensorImpl* impl) {
  try {  // sparse and some subclass tensors have no storage to read: one fixed value for them
    return impl->has_storage() ? reinterpret_cast<intptr_t>(impl->storage().data()) : -1;
  } catch (const std::exception&) {
    return -1;
  }
}

bool is_list(PyObject* o, const char* what) {
  if (PyList_Check(o)) return true;
  PyErr_Format(PyExc_TypeError, "%s must be a list", what);
  return false;
}

// snapshot(tensors: list[Tensor]) -> bytes: (version, storage pointer) of each, as int64 pairs
PyObject* snapshot_(PyObject* tensors) {
  if (!is_list(tensors, "tensors")) return nullptr;
  Py_ssize_t n = PyList_GET_SIZE(tensors);
  PyObject* out = PyBytes_FromStringAndSize(nullptr, n * 2 * sizeof(int64_t));
  if (!out) return nullptr;
  auto* s = reinterpret_cast<int64_t*>(PyBytes_AS_STRING(out));
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* t = PyList_GET_ITEM(tensors, i);
    if (!THPVariable_Check(t)) {
      Py_DECREF(out);
      PyErr_Format(PyExc_TypeError, "tensors[%zd] is not a tensor", i);
      return nullptr;
    }
    const c10::TensorImpl* impl = THPVariable_Unpack(t).unsafeGetTensorImpl();
    s[2 * i] = version(impl);
    s[2 * i + 1] = storage_ptr(impl);
  }
  return out;
}

// Dictionary version tags (PEP 509): CPython bumps a dict's ma_version_tag on every insert,
// replacement and deletion, so "no watched dict's tag moved" proves every slot still holds what it
// held, without the per-slot lookups. Right after a call, bert-base's 1095 slots (its 692 plain
// attributes included) took 46-57 us with the lookups and 15 us reading its 912 dicts' tags instead;
// mobilenet-v2 30-33 against 10 (2-core Zen 5, RESULTS.md, twenty-eighth session). The field is deprecated in
// 3.12 and gone from 3.14 (and the 3.13 inline-values stores were not checked here): used on
// 3.10-3.12 only, where tests/test_watch.py checks that every kind of slot change moves a tag; other
// Pythons do the lookups every call.
#if PY_VERSION_HEX >= 0x030A0000 && PY_VERSION_HEX < 0x030D0000
#define KILN_DICT_TAGS 1
uint64_t tag(PyObject* d) { return reinterpret_cast<PyDictObject*>(d)->ma_version_tag; }
#else
#define KILN_DICT_TAGS 0
#endif

bool all_dicts(PyObject* dicts) {
  if (!is_list(dicts, "tag_dicts")) return false;
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(dicts); ++i)
    if (!PyDict_Check(PyList_GET_ITEM(dicts, i))) {
      PyErr_Format(PyExc_TypeError, "tag_dicts[%zd] is not a dict", i);
      return false;
    }
  return true;
}

// tags(dicts: list[dict]) -> bytearray | None: each dict's version tag (None where not available)
PyObject* tags_(PyObject* dicts) {
  if (!all_dicts(dicts)) return nullptr;
#if KILN_DICT_TAGS
  const Py_ssize_t n = PyList_GET_SIZE(dicts);
  PyObject* out = PyByteArray_FromStringAndSize(nullptr, n * sizeof(uint64_t));
  if (!out) return nullptr;
  auto* s = reinterpret_cast<uint64_t*>(PyByteArray_AS_STRING(out));
  for (Py_ssize_t i = 0; i < n; ++i) s[i] = tag(PyList_GET_ITEM(dicts, i));
  return out;
#else
  Py_RETURN_NONE;
#endif
}

#if KILN_DICT_TAGS
// Do all these dicts still carry the tags in ``saved``? With ``fresh`` given, their current tags
// are written there first (read before the caller's lookups, so a change made after the read still
// moves a tag against what is saved later).
bool same_tags(PyObject* dicts, const uint64_t* saved, uint64_t* fresh) {
  const Py_ssize_t n = PyList_GET_SIZE(dicts);
  for (Py_ssize_t i = 0; i < n; ++i) __builtin_prefetch(PyList_GET_ITEM(dicts, i));  // independent misses
  bool same = true;
  for (Py_ssize_t i = 0; i < n; ++i) {
    const uint64_t now = tag(PyList_GET_ITEM(dicts, i));
    if (fresh) fresh[i] = now;
    if (now != saved[i]) {
      if (!fresh) return false;
      same = false;
    }
  }
  return same;
}
#endif

// changed(dicts, keys, objs, state[, tag_dicts, tags]) -> bool: does dicts[i][keys[i]] still hold
// objs[i] (identity), and are the first len(state)/16 of them (the tensors ``snapshot`` read) at the
// version and storage pointer it recorded? The rest are other slots watched for identity only
// (submodules, plain attributes). ``tags`` (from ``tags(tag_dicts)``, every dict in ``dicts``
// among tag_dicts): when no tag moved, the identity lookups are skipped; when one moved and the
// lookups find every slot as it was, ``tags`` is brought up to date, so the next call is quick again.
PyObject* changed_(PyObject* args) {
  PyObject *dicts, *keys, *tensors, *state, *tag_dicts = nullptr, *saved = Py_None;
  if (!PyArg_ParseTuple(args, "OOOO!|OO", &dicts, &keys, &tensors, &PyBytes_Type, &state, &tag_dicts, &saved))
    return nullptr;
  if (!is_list(dicts, "dicts") || !is_list(keys, "keys") || !is_list(tensors, "objs")) return nullptr;
  const Py_ssize_t n = PyList_GET_SIZE(tensors);
  const Py_ssize_t pair = 2 * static_cast<Py_ssize_t>(sizeof(int64_t));
  const Py_ssize_t t = PyBytes_GET_SIZE(state) / pair;
  if (PyList_GET_SIZE(dicts) != n || PyList_GET_SIZE(keys) != n || t > n || PyBytes_GET_SIZE(state) % pair) {
    PyErr_SetString(PyExc_ValueError, "dicts, keys, objs and state must describe the same slots");
    return nullptr;
  }
  // objs[:t] are the very list snapshot() checked to hold tensors (watch.py passes them back
  // unchanged): not checked again here, where an isinstance per tensor would cost more than the rest.
  // The reads below miss the cache right after a model call; issue the TensorImpl loads first (they
  // are independent, so the CPU overlaps them) and do the dictionary lookups while they land.
  constexpr Py_ssize_t kAhead = 1024;
  const c10::TensorImpl* impls[kAhead];
  const Py_ssize_t m = t < kAhead ? t : kAhead;
  for (Py_ssize_t i = 0; i < m; ++i) {
    impls[i] = THPVariable_Unpack(PyList_GET_ITEM(tensors, i)).unsafeGetTensorImpl();
    __builtin_prefetch(impls[i]);
  }
  bool lookups = true;
#if KILN_DICT_TAGS
  std::vector<uint64_t> fresh;  // allocated only when a tag moved
  if (saved != Py_None) {
    if (!tag_dicts || !PyByteArray_Check(saved) || !all_dicts(tag_dicts) ||
        PyByteArray_GET_SIZE(saved) != PyList_GET_SIZE(tag_dicts) * static_cast<Py_ssize_t>(sizeof(uint64_t))) {
      PyErr_SetString(PyExc_ValueError, "tags must be tags(tag_dicts)");
      return nullptr;
    }
    auto* s = reinterpret_cast<uint64_t*>(PyByteArray_AS_STRING(saved));
    if (same_tags(tag_dicts, s, nullptr)) {
      lookups = false;
    } else {
      fresh.resize(PyList_GET_SIZE(tag_dicts));
      same_tags(tag_dicts, s, fresh.data());
    }
  }
#endif
  for (Py_ssize_t i = 0; lookups && i < n; ++i) {  // identity only: no object is read here
    PyObject* d = PyList_GET_ITEM(dicts, i);
    if (!PyDict_Check(d)) {
      PyErr_Format(PyExc_TypeError, "dicts[%zd] is not a dict", i);
      return nullptr;
    }
    PyObject* now = PyDict_GetItemWithError(d, PyList_GET_ITEM(keys, i));
    if (now == nullptr && PyErr_Occurred()) return nullptr;
    if (now != PyList_GET_ITEM(tensors, i)) Py_RETURN_TRUE;
  }
  const auto* s = reinterpret_cast<const int64_t*>(PyBytes_AS_STRING(state));
  for (Py_ssize_t i = 0; i < t; ++i) {
    const c10::TensorImpl* impl =
        i < m ? impls[i] : THPVariable_Unpack(PyList_GET_ITEM(tensors, i)).unsafeGetTensorImpl();
    if (version(impl) != s[2 * i] ||
        storage_ptr(impl) != s[2 * i + 1])
      Py_RETURN_TRUE;
  }
#if KILN_DICT_TAGS
  if (!fresh.empty())  // every slot as it was: remember the tags they have now
    memcpy(PyByteArray_AS_STRING(saved), fresh.data(), PyByteArray_GET_SIZE(saved));
#endif
  Py_RETURN_FALSE;
}

// A C++ exception must never reach Python's C API (it would abort the process): it becomes a RuntimeError.
template <typename F>
PyObject* guarded(F f) {
  try {
    return f();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

PyObject* snapshot(PyObject*, PyObject* tensors) { return guarded([&] { return snapshot_(tensors); }); }

PyObject* changed(PyObject*, PyObject* args) { return guarded([&] { return changed_(args); }); }

PyObject* tags(PyObject*, PyObject* dicts) { return guarded([&] { return tags_(dicts); }); }

PyMethodDef methods[] = {
    {"snapshot", snapshot, METH_O, "(version, storage pointer) of each tensor, as int64 pairs"},
    {"changed", changed, METH_VARARGS, "has any slot changed since the snapshot?"},
    {"tags", tags, METH_O, "the dicts' version tags, or None where this Python has none to read"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kiln_weight_watch", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__kiln_weight_watch() { return PyModule_Create(&module); }
