// GradScaler's unscale of an optimizer's gradients, gathered in C++.
//
// For a model with thousands of small parameters, walking `optimizer.param_groups` in Python
// (reading `p.grad`, grouping by dtype, building the lists the dispatcher then converts back)
// costs more than the multi-tensor pass itself. Here the walk reads the C++ tensors behind the
// Python objects and hands `peak::multi_tensor_scale_` / `peak::multi_tensor_check_finite_` their
// lists directly: one pass per dtype, as before.
//
// Only the common case is taken: every gradient a plain dense tensor (not sparse, not a tensor
// subclass such as FSDP2's DTensor), of a kernel dtype, on found_inf's device. Anything else
// returns -1 before a single gradient is written, and GradScaler gathers the gradients in Python
// (peak.scaling.unscale_grads_). benchmarks/README.md prices this walk against that gather.
#include "param_grads.h"

#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>

#include <ATen/core/dispatch/Dispatcher.h>

#include <array>
#include <vector>

namespace py = pybind11;

namespace peak::bindings {
namespace {

constexpr std::array<at::ScalarType, 3> kKernelDtypes = {
    at::ScalarType::Float, at::ScalarType::Half, at::ScalarType::BFloat16};

int dtype_slot(at::ScalarType s) {
  for (size_t i = 0; i < kKernelDtypes.size(); ++i) {
    if (kKernelDtypes[i] == s) return static_cast<int>(i);
  }
  return -1;
}

// A gradient the kernels take as it is, on `device`.
bool plain_dense_on(const at::Tensor& g, const at::Device& device) {
  return g.layout() == at::kStrided && g.device() == device &&
         !g.key_set().has(c10::DispatchKey::Python) && g.is_non_overlapping_and_dense();
}

int64_t unscale_param_grads(py::handle param_groups, const at::Tensor& inv_scale,
                            const at::Tensor& found_inf, bool check_only, int64_t chunk_size) {
  PyObject* groups = param_groups.ptr();
  if (!PyList_Check(groups)) return -1;
  const at::Device device = found_inf.device();
  std::array<std::vector<at::Tensor>, kKernelDtypes.size()> by_dtype;
  int64_t count = 0;
  for (Py_ssize_t gi = 0; gi < PyList_GET_SIZE(groups); ++gi) {
    PyObject* group = PyList_GET_ITEM(groups, gi);
    if (!PyDict_Check(group)) return -1;
    PyObject* params = PyDict_GetItemString(group, "params");  // borrowed
    if (!params || !PyList_Check(params)) return -1;
    for (Py_ssize_t pi = 0; pi < PyList_GET_SIZE(params); ++pi) {
      PyObject* p = PyList_GET_ITEM(params, pi);
      if (!THPVariable_Check(p)) return -1;
      const at::Tensor& grad = THPVariable_Unpack(p).grad();
      if (!grad.defined()) continue;
      const int slot = dtype_slot(grad.scalar_type());
      if (slot < 0 || !plain_dense_on(grad, device)) return -1;
      by_dtype[slot].push_back(grad);
      ++count;
    }
  }
  if (count == 0) return 0;
  static const auto scale_op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("peak::multi_tensor_scale_", "")
          .typed<void(at::TensorList, const std::optional<at::TensorList>&, const at::Tensor&,
                      const at::Tensor&, int64_t, const std::optional<at::Tensor>&)>();
  static const auto check_op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("peak::multi_tensor_check_finite_", "")
          .typed<void(at::TensorList, const at::Tensor&, int64_t,
                      const std::optional<at::Tensor>&)>();
  const at::NoGradGuard no_grad;  // as torch.no_grad() around GradScaler's own unscale
  py::gil_scoped_release no_gil;  // the pass may take a while; Python threads may run meanwhile
  for (const auto& grads : by_dtype) {
    if (grads.empty()) continue;
    if (check_only) {
      check_op.call(grads, found_inf, chunk_size, std::nullopt);
    } else {
      scale_op.call(grads, std::nullopt, inv_scale, found_inf, chunk_size, std::nullopt);
    }
  }
  return count;
}

}  // namespace

void register_param_grads(py::module_& m) {
  m.def("unscale_param_grads", &unscale_param_grads, py::arg("param_groups"),
        py::arg("inv_scale"), py::arg("found_inf"), py::arg("check_only"), py::arg("chunk_size"),
        "Unscale (or with check_only, only check) the gradients of an optimizer's param_groups "
        "in place, one multi-tensor pass per dtype, accumulating inf/NaN into found_inf. Returns "
        "the number of gradients, or -1 (nothing written) when one needs GradScaler's general "
        "path: sparse, a tensor subclass, non-dense, not fp32/fp16/bf16, or on another device.");
}

}  // namespace peak::bindings
