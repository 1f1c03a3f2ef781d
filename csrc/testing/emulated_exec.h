// The emulated CUDA grid as an Exec (op_entries.h), for the test-only twins. The twins are
// compiled by op family in files of their own (emulated_ops.cpp: the multi-tensor ops, the
// library and LAMB; emulated_adam.cpp, emulated_sgd.cpp, emulated_adagrad_novograd.cpp), so that
// they compile in parallel; each registers its family's peak_emulated kernels.
#pragma once

#include "../core/emulated_grid.h"
#include "../ops/host_exec.h"
#include "../ops/op_entries.h"

namespace peak {
namespace emulated_ops {

// The grid shape the peak_emulated ops use on this thread (0: the real CUDA launcher's value),
// and the counter of blocks that took the vector path (NOTE: [Aligned vector access]).
emulated::GridShape current_grid_shape();
int64_t* vectorised_blocks_counter();

struct EmulatedExec : HostExecBase {
  emulated::GridShape shape = current_grid_shape();
  template <typename Op, typename... T>
  void apply(const HostTensorLists<sizeof...(T), Op::tensor_scalars>& lists, int64_t chunk_size,
             const Op& op, const BlockSink& sink) {
    constexpr int kMax = MetadataFor<Op, T...>::kMaxTensors;
    emulated::GridShape s = shape;
    if (s.max_tensors == 0) s.max_tensors = kMax;
    if (s.max_blocks == 0) s.max_blocks = kMaxBlocksPerLaunch;
    if (s.threads_per_block == 0) s.threads_per_block = kThreadsPerBlock;
    TORCH_CHECK(s.max_tensors >= 1 && s.max_tensors <= kMax,
                "emulated grid: max_tensors must be in [1, ", kMax, "]");
    TORCH_CHECK(s.max_blocks >= 1 && s.max_blocks <= kMaxBlocksPerLaunch,
                "emulated grid: max_blocks must be in [1, ", kMaxBlocksPerLaunch, "]");
    TORCH_CHECK(s.threads_per_block >= 1, "emulated grid: threads_per_block must be >= 1");
    emulated::apply<Op, T...>(lists, chunk_size, op, sink, s, vectorised_blocks_counter());
  }
};

}  // namespace emulated_ops
}  // namespace peak
