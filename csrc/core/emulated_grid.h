// A CPU emulation of the CUDA launcher: the same launch plan, the same metadata, the same
// per-thread block code (grid_block_thread), with the grid, the block and the block-level
// combine run serially. It exists so that the CUDA path's host packing and indexing are tested
// on machines without a GPU; it is not a production backend.
#pragma once

#include <algorithm>
#include <vector>

#include "elementwise_ops.h"
#include "grid_block.h"
#include "launch_plan.h"

namespace peak {
namespace emulated {

struct GridShape {
  int max_tensors;  // <= TensorListMetadata<depth>::kMaxTensors
  int max_blocks;   // <= kMaxBlocksPerLaunch
  int threads_per_block;
};

template <typename Op, typename... T>
void apply(const HostTensorLists<sizeof...(T), Op::tensor_scalars>& lists, int64_t chunk_size,
           Op op, const BlockSink& sink, GridShape shape, int64_t* vectorised_blocks = nullptr) {
  using State = typename Op::State;
  const std::vector<Launch> launches =
      plan_launches(lists.numels, chunk_size, {shape.max_tensors, shape.max_blocks});
  MetadataFor<Op, T...> meta;
  op.load_scalars();
  for (const Launch& launch : launches) {
    fill_metadata(launch, lists, meta);  // the kernel argument
    for (int block = 0; block < static_cast<int>(launch.blocks.size()); ++block) {
      if (vectorised_blocks != nullptr && block_vectorises<Op, T...>(meta, block, chunk_size)) {
        ++*vectorised_blocks;  // NOTE: [Aligned vector access]: which path the tests took
      }
      State block_state{};
      if constexpr (q8_count<T...> > 0) {
        // By warps, a warp's lanes one after another (NOTE: [8-bit moments on the grid]); a
        // block of fewer threads than a warp still has one warp.
        const int nwarps = std::max(1, shape.threads_per_block / kWarpSize);
        for (int warp = 0; warp < nwarps; ++warp) {
          State lane_states[kWarpSize] = {};
          grid_block_q8<kWarpSize, Op, T...>(meta, block, warp, nwarps, 0, chunk_size, op,
                                             lane_states);
          for (const State& s : lane_states) block_state.merge(s);
        }
      } else {
        for (int thread = 0; thread < shape.threads_per_block; ++thread) {
          State thread_state{};
          grid_block_thread<Op, T...>(meta, block, thread, shape.threads_per_block, chunk_size,
                                      op, thread_state);
          block_state.merge(thread_state);
        }
      }
      if constexpr (std::is_same_v<State, FiniteState>) {
        if (block_state.nonfinite && sink.found_inf != nullptr) *sink.found_inf = 1.0f;
        if (block_state.nonfinite && sink.per_tensor_flags != nullptr) {
          sink.per_tensor_flags[meta.tensor_index[block_slot(meta, block)]] = 1.0f;
        }
      } else if constexpr (std::is_same_v<State, SumSquaresState>) {
        sink.partials[meta.first_global_chunk + block] = block_state.sumsq;
      }
    }
  }
}

}  // namespace emulated
}  // namespace peak
