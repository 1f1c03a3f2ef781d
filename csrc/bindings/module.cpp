// peak._C: importing it registers the dispatcher ops (TORCH_LIBRARY blocks linked into this
// module). The pybind11 part holds what must touch Python objects: build facts, the caster, and
// views into the core for tests (the launch plan; the emulated CUDA grid when built with
// PEAK_TEST_TWINS=ON).
#include <torch/extension.h>

#include "../caster/caster.h"
#include "../core/grid_block.h"
#include "../core/launch_plan.h"
#include "../ops/cpu_dispatch.h"
#include "param_grads.h"
#if PEAK_TEST_TWINS
#include "../testing/emulated_ops.h"
#endif

#ifndef PEAK_VERSION
#error "PEAK_VERSION must be defined by the build"
#endif

namespace py = pybind11;

namespace {

py::dict build_info() {
  py::dict d;
  d["peak_version"] = PEAK_VERSION;
  d["torch_version"] = PEAK_TORCH_VERSION;
  d["with_cuda"] = static_cast<bool>(PEAK_WITH_CUDA);
  d["cuda_version"] = PEAK_CUDA_VERSION;
  d["cuda_archs"] = PEAK_CUDA_ARCHS;
  d["cxx_compiler"] = PEAK_CXX_COMPILER;
  d["cpu_isa"] = PEAK_CPU_ISA;
  d["cpu_levels_compiled"] = PEAK_CPU_LEVELS;
  d["test_twins"] = static_cast<bool>(PEAK_TEST_TWINS);
  return d;
}

// The CPU level in use and the others (NOTE: [CPU levels]); selects it if nothing has yet, so
// an impossible PEAK_CPU_LEVEL raises here (peak's import calls this).
py::dict cpu_levels() {
  const peak::cpu_dispatch::LevelReport r = peak::cpu_dispatch::report();
  py::dict d;
  d["active"] = r.active;
  d["compiled"] = r.compiled;
  d["supported"] = r.supported;
  d["forced"] = r.forced.empty() ? py::object(py::none()) : py::object(py::str(r.forced));
  return d;
}

py::list plan_launches(const std::vector<int64_t>& numels, int64_t chunk_size, int max_tensors,
                       int max_blocks) {
  py::list out;
  for (const peak::Launch& l : peak::plan_launches(numels, chunk_size, {max_tensors, max_blocks})) {
    py::list blocks;
    for (const auto& b : l.blocks) blocks.append(py::make_tuple(b.slot, b.chunk));
    py::dict d;
    d["first_global_chunk"] = l.first_global_chunk;
    d["slot_tensor"] = l.slot_tensor;
    d["blocks"] = blocks;
    out.append(d);
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "peak's C++ core: dispatcher ops (torch.ops.peak.*) and build facts";
  m.def("build_info", &build_info, "Facts recorded when this extension was built");
  m.def("max_tensors_per_launch", &peak::max_tensors_per_launch, py::arg("depth"),
        py::arg("tensor_scalars") = 0);
  m.attr("max_blocks_per_launch") = peak::kMaxBlocksPerLaunch;
  m.attr("threads_per_block") = peak::kThreadsPerBlock;
  m.def("plan_launches", &plan_launches, py::arg("numels"), py::arg("chunk_size"),
        py::arg("max_tensors"), py::arg("max_blocks"),
        "The CUDA launcher's packing of chunks into launches (for tests and inspection)");

  m.def("cpu_levels", &cpu_levels,
        "The CPU kernels' level in use ('active'), the levels compiled in, those this CPU runs, "
        "and the PEAK_CPU_LEVEL value that forced the choice (None: the best supported)");
  m.def("_set_cpu_level", &peak::cpu_dispatch::set_level, py::arg("level"),
        "Tests only: switch the CPU kernels to `level` ('auto': the best supported) in this "
        "process; returns the previous level");

  peak::caster::register_bindings(m);
  peak::bindings::register_param_grads(m);

#if PEAK_TEST_TWINS
  peak::emulated_ops::register_bindings(m);
#endif
}
