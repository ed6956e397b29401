// Python callables as the library's device allocator: msa.torch points it at PyTorch's
// caching allocator, so plans, workspaces and scratch come from PyTorch's memory pools (and
// from a CUDA graph's private pool while a graph is being captured).
#include <nanobind/stl/tuple.h>

#include <cstdint>

#include "bindings.h"
#include "msa/tensor.h"

namespace nb = nanobind;

namespace msa::python {

namespace {

// The callables of one set_device_allocator call. Never freed: memory it gave out may be
// given back through it at any later time, even after another allocator was installed.
struct PyAllocator {
  nb::object allocate, deallocate;
};

void* py_allocate(int64_t bytes, int device, void* stream, void* context) {
  const auto* a = static_cast<const PyAllocator*>(context);
  nb::gil_scoped_acquire gil;
  // A Python exception (e.g. torch.OutOfMemoryError) travels to the caller unchanged.
  nb::object ptr = a->allocate(bytes, device, reinterpret_cast<uintptr_t>(stream));
  return reinterpret_cast<void*>(nb::cast<uintptr_t>(ptr));
}

void py_deallocate(void* ptr, int64_t bytes, int device, void* stream, void* context) {
  if (!nb::is_alive()) return;  // the interpreter has shut down: the process is ending
  const auto* a = static_cast<const PyAllocator*>(context);
  nb::gil_scoped_acquire gil;
  try {
    a->deallocate(reinterpret_cast<uintptr_t>(ptr), bytes, device, reinterpret_cast<uintptr_t>(stream));
  } catch (nb::python_error& e) {
    e.discard_as_unraisable("msa: the device allocator's deallocate");
  } catch (...) {
  }
}

void set_allocator(nb::object allocate, nb::object deallocate) {
  if (allocate.is_none() != deallocate.is_none())
    throw nb::value_error("set_device_allocator: give both allocate and deallocate, or neither (the built-in allocator)");
  if (allocate.is_none()) {
    reset_device_allocator();
    return;
  }
  if (!PyCallable_Check(allocate.ptr()) || !PyCallable_Check(deallocate.ptr()))
    throw nb::type_error("set_device_allocator: allocate and deallocate must be callables");
  auto* a = new PyAllocator{std::move(allocate), std::move(deallocate)};
  set_device_allocator({&py_allocate, &py_deallocate, a});
}

nb::object get_allocator() {
  const DeviceAllocator a = device_allocator();
  if (a.is_default()) return nb::none();
  if (a.allocate != &py_allocate) return nb::str("native");
  const auto* p = static_cast<const PyAllocator*>(a.context);
  return nb::make_tuple(p->allocate, p->deallocate);
}

}  // namespace

void bind_allocator(nb::module_& m) {
  m.def("set_device_allocator", &set_allocator, nb::arg("allocate").none(), nb::arg("deallocate").none(),
        "Routes every CUDA allocation of msa (plans, their workspace, temporary scratch) through "
        "allocate(nbytes, device, stream) -> int pointer and deallocate(ptr, nbytes, device, stream), "
        "stream-ordered on `stream` (a cudaStream_t as int). None, None restores the built-in "
        "allocator (cudaMalloc / cudaMallocAsync). Memory goes back to the allocator that gave it.");
  m.def("device_allocator", &get_allocator,
        "None for the built-in allocator, else the (allocate, deallocate) pair installed from Python "
        "(or 'native' for one installed from C++).");
}

}  // namespace msa::python
