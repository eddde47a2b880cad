// megatron_railwave._C: the Python module of this library. Importing it registers nothing;
// register_kernels() registers the railwave ops' compiled kernels (bindings/ops.cpp) and returns the
// handle that keeps them registered (a capsule: dropping it takes them out of the dispatcher again).
// `with_cuda` says whether CUDA kernels were built. One plain function besides: layer_descriptors
// (csrc/cpu/descriptors.cpp), host only and called on every MoE layer call, where a torch op's
// dispatch would cost more than the work.

#include <Python.h>

#include <cstdint>
#include <string>

#include "../cpu/descriptors.h"
#include "kernels.h"

namespace {

// A C-contiguous or strided int64 buffer of `ndim` dimensions (numpy arrays; torch tensors via .numpy()).
bool get_int64_buffer(PyObject* obj, Py_buffer* view, int ndim, const char* name) {
  if (PyObject_GetBuffer(obj, view, PyBUF_RECORDS_RO) != 0) return false;
  const char* fmt = view->format != nullptr ? view->format : "B";
  if (*fmt == '<' || *fmt == '=' || *fmt == '@') ++fmt;
  const bool int64 = view->itemsize == 8 && (fmt[0] == 'l' || fmt[0] == 'q') && fmt[1] == '\0';
  if (!int64 || view->ndim != ndim) {
    PyErr_Format(PyExc_ValueError, "layer_descriptors: %s must be a %d-D int64 array, got format '%s' itemsize %zd "
                 "ndim %d", name, ndim, view->format ? view->format : "B", view->itemsize, view->ndim);
    PyBuffer_Release(view);
    return false;
  }
  return true;
}

// layer_descriptors(records [W, N] int64, geometry [3 + G + N * R] int64: N, G, R, rail of each
// GPU, healthy port flags) -> (remote_total, busiest, egress_max, healthy_mean, kappa, records_total)
PyObject* layer_descriptors(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "layer_descriptors(records, geometry) takes 2 arguments");
    return nullptr;
  }
  Py_buffer rec, geo;
  if (!get_int64_buffer(args[0], &rec, 2, "records")) return nullptr;
  if (!get_int64_buffer(args[1], &geo, 1, "geometry")) {
    PyBuffer_Release(&rec);
    return nullptr;
  }
  double out[6];
  const char* problem = nullptr;
  const int64_t* g = static_cast<const int64_t*>(geo.buf);
  const int64_t glen = geo.shape[0], gstride = geo.strides[0];
  if (gstride != 8 || glen < 3) {
    problem = "geometry must be a contiguous [3 + G + N * R] int64 array";
  } else {
    const int64_t N = g[0], G = g[1], R = g[2];
    if (N < 1 || G < 1 || R < 1 || glen != 3 + G + N * R) {
      problem = "geometry's length does not match its N, G, R";
    } else if (rec.shape[0] != N * G || rec.shape[1] != N || rec.strides[0] % 8 || rec.strides[1] % 8) {
      problem = "records must be [N * G, N] int64 (the geometry's N and G)";
    } else {
      for (int64_t o = 0; o < G && problem == nullptr; ++o)
        if (g[3 + o] < 0 || g[3 + o] >= R) problem = "geometry's rail of a GPU is outside [0, R)";
      if (problem == nullptr)
        railwave::cpu::layer_descriptors(static_cast<const int64_t*>(rec.buf), rec.strides[0] / 8, rec.strides[1] / 8,
                                         N, G, R, g + 3, g + 3 + G, out);
    }
  }
  PyBuffer_Release(&rec);
  PyBuffer_Release(&geo);
  if (problem != nullptr) {
    PyErr_Format(PyExc_ValueError, "layer_descriptors: %s", problem);
    return nullptr;
  }
  return Py_BuildValue("(dddddd)", out[0], out[1], out[2], out[3], out[4], out[5]);
}

constexpr const char* kKernelsCapsule = "megatron_railwave._C.kernels";

void release_kernels_capsule(PyObject* capsule) {
  railwave::release_kernels(PyCapsule_GetPointer(capsule, kKernelsCapsule));
}

PyObject* register_kernels(PyObject* /*self*/, PyObject* /*unused*/) {
  std::string error;
  void* handle = railwave::register_kernels(error);
  if (handle == nullptr) {
    PyErr_Format(PyExc_RuntimeError, "register_kernels: %s", error.c_str());
    return nullptr;
  }
  PyObject* capsule = PyCapsule_New(handle, kKernelsCapsule, release_kernels_capsule);
  if (capsule == nullptr) railwave::release_kernels(handle);
  return capsule;
}

PyMethodDef methods[] = {
    {"register_kernels", register_kernels, METH_NOARGS,
     "Register the compiled kernels of torch.ops.railwave; returns the handle that keeps them registered."},
    {"layer_descriptors", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(layer_descriptors)),
     METH_FASTCALL, "The online selector's per-layer sums (csrc/cpu/descriptors.cpp)."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "railwave compiled ops (torch.ops.railwave)",
                                          -1, methods};
  PyObject* module = PyModule_Create(&module_def);
  if (module == nullptr) return nullptr;
#if defined(RAILWAVE_WITH_CUDA)
  const long with_cuda = 1;
#else
  const long with_cuda = 0;
#endif
  if (PyModule_AddIntConstant(module, "with_cuda", with_cuda) != 0) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
