// megatron_railwave._C: an empty Python module whose import loads this library, which runs the
// TORCH_LIBRARY registrations (bindings/ops.cpp). `with_cuda` says whether CUDA kernels were built.

#include <Python.h>

extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "railwave compiled ops (torch.ops.railwave)",
                                          -1, nullptr};
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
