// peak._C.emulated: the multi-tensor ops through the emulated CUDA grid, for tests (built with
// PEAK_TEST_TWINS=ON only; see emulated_ops.cpp).
#include <torch/extension.h>

#include "emulated_ops.h"

namespace py = pybind11;

namespace peak {
namespace emulated_ops {

void register_bindings(py::module_& parent) {
  py::module_ emu = parent.def_submodule(
      "emulated", "The CUDA launcher's plan and block code run serially on the CPU (tests)");
  emu.def("set_grid_shape", &peak::emulated_ops::set_grid_shape, py::arg("max_tensors"),
          py::arg("max_blocks"), py::arg("threads"),
          "Launch limits and block size of torch.ops.peak_emulated.* (0: the CUDA values)");
  emu.def(
      "multi_tensor_scale_",
      [](std::vector<at::Tensor> inputs, std::vector<at::Tensor> outputs, at::Tensor scale,
         at::Tensor found_inf, int64_t chunk_size, int64_t max_tensors, int64_t max_blocks,
         int64_t threads, std::optional<at::Tensor> per_tensor_found_inf) {
        peak::emulated_ops::scale(inputs, outputs, scale, found_inf, chunk_size, max_tensors,
                                  max_blocks, threads, per_tensor_found_inf);
      },
      py::arg("inputs"), py::arg("outputs"), py::arg("scale"), py::arg("found_inf"),
      py::arg("chunk_size"), py::arg("max_tensors"), py::arg("max_blocks"), py::arg("threads"),
      py::arg("per_tensor_found_inf") = py::none());
  emu.def(
      "multi_tensor_axpby_",
      [](std::vector<at::Tensor> xs, std::vector<at::Tensor> ys, std::vector<at::Tensor> outputs,
         at::Tensor a, at::Tensor b, at::Tensor found_inf, int64_t check, int64_t chunk_size,
         int64_t max_tensors, int64_t max_blocks, int64_t threads) {
        peak::emulated_ops::axpby(xs, ys, outputs, a, b, found_inf, check, chunk_size,
                                  max_tensors, max_blocks, threads);
      },
      py::arg("xs"), py::arg("ys"), py::arg("outputs"), py::arg("a"), py::arg("b"),
      py::arg("found_inf"), py::arg("check"), py::arg("chunk_size"), py::arg("max_tensors"),
      py::arg("max_blocks"), py::arg("threads"));
  emu.def(
      "multi_tensor_l2norm",
      [](std::vector<at::Tensor> tensors, bool per_tensor, int64_t chunk_size,
         int64_t max_tensors, int64_t max_blocks, int64_t threads) {
        return peak::emulated_ops::l2norm(tensors, per_tensor, chunk_size, max_tensors,
                                          max_blocks, threads);
      },
      py::arg("tensors"), py::arg("per_tensor"), py::arg("chunk_size"), py::arg("max_tensors"),
      py::arg("max_blocks"), py::arg("threads"));
}

}  // namespace emulated_ops
}  // namespace peak
