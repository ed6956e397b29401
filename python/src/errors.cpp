// msa::Error surfaces in Python as msa.MsaError carrying the library's message:
//   InvalidArgumentError(MsaError, ValueError)  - bad shape, dtype, value, combination
//   UnsupportedError(MsaError, RuntimeError)    - valid request this build cannot serve
//   MsaRuntimeError(MsaError, RuntimeError)     - failure while running (CUDA error, ...)
#include <Python.h>

#include "bindings.h"
#include "msa/error.h"

namespace nb = nanobind;

namespace msa::python {

namespace {

// Owned for the life of the process (exception types are never freed).
PyObject* g_invalid_argument = nullptr;
PyObject* g_unsupported = nullptr;
PyObject* g_runtime = nullptr;

PyObject* new_error_type(nb::module_& m, const char* name, PyObject* base, PyObject* builtin, const char* doc) {
  PyObject* bases = builtin ? PyTuple_Pack(2, base, builtin) : PyTuple_Pack(1, base);
  PyObject* type = PyErr_NewExceptionWithDoc((std::string("msa.") + name).c_str(), doc, bases, nullptr);
  Py_XDECREF(bases);
  if (!type) throw nb::python_error();
  m.attr(name) = nb::borrow(type);
  return type;
}

}  // namespace

void bind_errors(nb::module_& m) {
  PyObject* base = new_error_type(m, "MsaError", PyExc_Exception, nullptr,
                                  "Base class of the errors raised by msa; the message names the argument, "
                                  "what was expected and what came.");
  g_invalid_argument = new_error_type(m, "InvalidArgumentError", base, PyExc_ValueError,
                                      "Bad shape, dtype, stride, value or combination of arguments.");
  g_unsupported = new_error_type(m, "UnsupportedError", base, PyExc_RuntimeError,
                                 "A valid request that this build or backend cannot serve.");
  g_runtime = new_error_type(m, "MsaRuntimeError", base, PyExc_RuntimeError,
                             "A failure while running (CUDA error, allocation failure).");
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const Error& e) {
      PyObject* type = e.kind() == ErrorKind::invalid_argument ? g_invalid_argument
                       : e.kind() == ErrorKind::unsupported   ? g_unsupported
                                                              : g_runtime;
      PyErr_SetString(type, e.what());
    }
  });
}

}  // namespace msa::python
