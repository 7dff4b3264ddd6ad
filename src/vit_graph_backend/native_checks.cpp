// The per-call checks of native_checks.py, one C call each instead of one Python-level C call
// per tensor or module. Each answers only "is everything as it was?": False sends the caller to
// the Python check, which finds what changed and says so, so these never decide anything the
// Python path would decide otherwise. Built by torch.utils.cpp_extension.load with
// TORCH_EXTENSION_NAME set to a name of this source and the running torch (native_checks.py).
//
// Everything runs under the GIL, and no Python code runs between a borrowed reference's lookup
// and its last use.

#include <Python.h>

#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>

namespace {

// The object under names[i] in the dict tables[i], borrowed; nullptr with an error set for a
// table that is no dict, nullptr without one for a missing name.
PyObject* lookup(PyObject* tables, PyObject* names, Py_ssize_t i) {
  PyObject* table = PyTuple_GET_ITEM(tables, i);
  if (!PyDict_Check(table)) {
    PyErr_SetString(PyExc_TypeError, "a table is not a dict");
    return nullptr;
  }
  return PyDict_GetItemWithError(table, PyTuple_GET_ITEM(names, i));
}

bool same_length(PyObject* a, PyObject* b) {
  if (PyTuple_GET_SIZE(a) != PyTuple_GET_SIZE(b)) {
    PyErr_SetString(PyExc_ValueError, "tuples of different lengths");
    return false;
  }
  return true;
}

// Two tuples of one length as args; false with an error set otherwise.
bool two_tuples(PyObject* args, PyObject** a, PyObject** b) {
  return PyArg_ParseTuple(args, "O!O!", &PyTuple_Type, a, &PyTuple_Type, b) &&
         same_length(*a, *b);
}

// Three tuples of one length as args; false with an error set otherwise.
bool three_tuples(PyObject* args, PyObject** a, PyObject** b, PyObject** c) {
  return PyArg_ParseTuple(args, "O!O!O!", &PyTuple_Type, a, &PyTuple_Type, b, &PyTuple_Type,
                          c) &&
         same_length(*a, *b) && same_length(*a, *c);
}

bool equals(PyObject* saved, std::int64_t value) {
  // a saved value that is no int, or out of range, is never equal
  int overflow = 0;
  long long expected = PyLong_AsLongLongAndOverflow(saved, &overflow);
  if (expected == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  return overflow == 0 && expected == value;
}

// same_tensors(tables, names, addresses, versions) -> bool
//
// True if every tables[i][names[i]] is a tensor whose storage address is addresses[i] and, when
// versions is a tuple, whose version counter reads versions[i]. With versions, None in a table
// matches an address and a version of -1 (a projection without a bias); without, None matches
// nothing. An inference tensor has no version counter: it matches nothing when versions are
// asked. Anything else that is not as saved (a missing name, another object, a tensor without
// storage) gives False.
PyObject* same_tensors(PyObject*, PyObject* args) {
  PyObject *tables, *names, *addresses, *versions;
  if (!PyArg_ParseTuple(args, "O!O!O!O", &PyTuple_Type, &tables, &PyTuple_Type, &names,
                        &PyTuple_Type, &addresses, &versions)) {
    return nullptr;
  }
  const bool with_versions = versions != Py_None;
  if (with_versions && !PyTuple_Check(versions)) {
    PyErr_SetString(PyExc_TypeError, "versions must be a tuple or None");
    return nullptr;
  }
  if (!same_length(tables, names) || !same_length(tables, addresses) ||
      (with_versions && !same_length(tables, versions))) {
    return nullptr;
  }
  const Py_ssize_t n = PyTuple_GET_SIZE(tables);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* value = lookup(tables, names, i);
    if (value == nullptr) {
      if (PyErr_Occurred()) {
        return nullptr;
      }
      Py_RETURN_FALSE;
    }
    if (value == Py_None) {
      if (with_versions && equals(PyTuple_GET_ITEM(addresses, i), -1) &&
          equals(PyTuple_GET_ITEM(versions, i), -1)) {
        continue;
      }
      Py_RETURN_FALSE;
    }
    if (!THPVariable_Check(value)) {
      Py_RETURN_FALSE;
    }
    try {
      const at::Tensor& tensor = THPVariable_Unpack(value);
      const auto address = reinterpret_cast<std::intptr_t>(tensor.const_data_ptr());
      if (!equals(PyTuple_GET_ITEM(addresses, i), static_cast<std::int64_t>(address))) {
        Py_RETURN_FALSE;
      }
      if (with_versions) {
        if (tensor.is_inference() ||
            !equals(PyTuple_GET_ITEM(versions, i), static_cast<std::int64_t>(tensor._version()))) {
          Py_RETURN_FALSE;
        }
      }
    } catch (...) {  // no storage, or no version counter: the Python check says what it is
      Py_RETURN_FALSE;
    }
  }
  Py_RETURN_TRUE;
}

// any_has_key(dicts, key) -> bool: whether key is in any of the dicts (dict.__contains__).
PyObject* any_has_key(PyObject*, PyObject* args) {
  PyObject *dicts, *key;
  if (!PyArg_ParseTuple(args, "O!O", &PyTuple_Type, &dicts, &key)) {
    return nullptr;
  }
  const Py_ssize_t n = PyTuple_GET_SIZE(dicts);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* d = PyTuple_GET_ITEM(dicts, i);
    if (!PyDict_Check(d)) {
      PyErr_SetString(PyExc_TypeError, "not a dict");
      return nullptr;
    }
    const int found = PyDict_Contains(d, key);
    if (found < 0) {
      return nullptr;
    }
    if (found) {
      Py_RETURN_TRUE;
    }
  }
  Py_RETURN_FALSE;
}

// same_types(objects, types) -> bool: whether type(objects[i]) is types[i] for every i.
PyObject* same_types(PyObject*, PyObject* args) {
  PyObject *objects, *types;
  if (!two_tuples(args, &objects, &types)) {
    return nullptr;
  }
  const Py_ssize_t n = PyTuple_GET_SIZE(objects);
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (reinterpret_cast<PyObject*>(Py_TYPE(PyTuple_GET_ITEM(objects, i))) !=
        PyTuple_GET_ITEM(types, i)) {
      Py_RETURN_FALSE;
    }
  }
  Py_RETURN_TRUE;
}

// same_dicts(dicts, copies) -> bool: whether each dict holds the same keys and values, by
// identity and in the same order, as its copy. A "no" says nothing: a dict whose entries were
// taken out and put back in another order is equal all the same (the caller compares with ==).
PyObject* same_dicts(PyObject*, PyObject* args) {
  PyObject *dicts, *copies;
  if (!two_tuples(args, &dicts, &copies)) {
    return nullptr;
  }
  const Py_ssize_t n = PyTuple_GET_SIZE(dicts);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* a = PyTuple_GET_ITEM(dicts, i);
    PyObject* b = PyTuple_GET_ITEM(copies, i);
    if (!PyDict_Check(a) || !PyDict_Check(b)) {
      PyErr_SetString(PyExc_TypeError, "not a dict");
      return nullptr;
    }
    if (PyDict_GET_SIZE(a) != PyDict_GET_SIZE(b)) {
      Py_RETURN_FALSE;
    }
    Py_ssize_t pa = 0, pb = 0;
    PyObject *ka, *va, *kb, *vb;
    while (PyDict_Next(a, &pa, &ka, &va)) {
      if (!PyDict_Next(b, &pb, &kb, &vb) || ka != kb || va != vb) {
        Py_RETURN_FALSE;
      }
    }
  }
  Py_RETURN_TRUE;
}

// The value under name in the dict table, None for a missing name: a new reference, or nullptr
// with an error set.
PyObject* entry(PyObject* table, PyObject* name) {
  if (!PyDict_Check(table)) {
    PyErr_SetString(PyExc_TypeError, "a table is not a dict");
    return nullptr;
  }
  PyObject* value = PyDict_GetItemWithError(table, name);
  if (value == nullptr) {
    return PyErr_Occurred() ? nullptr : Py_NewRef(Py_None);
  }
  return Py_NewRef(value);
}

// getattr(owner, name, None): a new reference, or nullptr with an error set. An attribute read
// may run Python (a descriptor, a metaclass): its errors other than AttributeError propagate,
// as getattr's would.
PyObject* attribute(PyObject* owner, PyObject* name) {
  PyObject* value = PyObject_GetAttr(owner, name);
  if (value == nullptr && PyErr_ExceptionMatches(PyExc_AttributeError)) {
    PyErr_Clear();
    return Py_NewRef(Py_None);
  }
  return value;
}

// same_reads<read>(holders, names, saved) -> bool: whether read(holders[i], names[i]) is
// saved[i] for every i (same_entries: entry; same_attributes: attribute).
template <PyObject* (*read)(PyObject*, PyObject*)>
PyObject* same_reads(PyObject*, PyObject* args) {
  PyObject *holders, *names, *saved;
  if (!three_tuples(args, &holders, &names, &saved)) {
    return nullptr;
  }
  const Py_ssize_t n = PyTuple_GET_SIZE(holders);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* value = read(PyTuple_GET_ITEM(holders, i), PyTuple_GET_ITEM(names, i));
    if (value == nullptr) {
      return nullptr;
    }
    const bool same = value == PyTuple_GET_ITEM(saved, i);
    Py_DECREF(value);  // compared by address only: no use of it after this
    if (!same) {
      Py_RETURN_FALSE;
    }
  }
  Py_RETURN_TRUE;
}

PyMethodDef methods[] = {
    {"same_tensors", same_tensors, METH_VARARGS,
     "same_tensors(tables, names, addresses, versions) -> bool"},
    {"any_has_key", any_has_key, METH_VARARGS, "any_has_key(dicts, key) -> bool"},
    {"same_types", same_types, METH_VARARGS, "same_types(objects, types) -> bool"},
    {"same_dicts", same_dicts, METH_VARARGS, "same_dicts(dicts, copies) -> bool"},
    {"same_entries", same_reads<entry>, METH_VARARGS,
     "same_entries(tables, names, saved) -> bool: tables[i].get(names[i]) is saved[i]"},
    {"same_attributes", same_reads<attribute>, METH_VARARGS,
     "same_attributes(owners, names, saved) -> bool: getattr(owners[i], names[i], None) is "
     "saved[i]"},
    {nullptr, nullptr, 0, nullptr},
};

#define VITGRAPH_STR_(x) #x
#define VITGRAPH_STR(x) VITGRAPH_STR_(x)
#define VITGRAPH_CAT_(a, b) a##b
#define VITGRAPH_CAT(a, b) VITGRAPH_CAT_(a, b)

PyModuleDef module = {PyModuleDef_HEAD_INIT, VITGRAPH_STR(TORCH_EXTENSION_NAME),
                      "vit_graph_backend's per-call checks (native_checks.py)", -1, methods};

}  // namespace

PyMODINIT_FUNC VITGRAPH_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
  return PyModule_Create(&module);
}
