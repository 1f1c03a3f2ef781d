// The CUDA launcher of multi-tensor apply. Everything except the launch itself is shared with
// the CPU emulation of the grid (see grid_block.h and NOTE: [Chunking] in launch_plan.h).
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include <cub/block/block_reduce.cuh>
#include <type_traits>
#include <vector>

#include "elementwise_ops.h"
#include "grid_block.h"
#include "launch_plan.h"

namespace peak {
namespace cuda {

// NOTE: [Two blocks per SM]
// A memory-bound step needs bytes in flight: at 512 threads a block, two blocks an SM (64
// registers a thread at most) is half the threads an SM holds; at 65 registers or more one block
// fits, a quarter. The fused optimizer steps took 50 to 70 registers unbounded, so the bound
// asks for two. The 8-bit steps keep a lane's eight elements of every list in registers between
// their two phases (NOTE: [8-bit moments on the grid]) and take one block an SM rather than
// spill them.
template <typename... T>
constexpr int kMinBlocksPerSM = q8_count<T...> > 0 ? 1 : 2;

template <typename Op, typename... T>
__global__ void __launch_bounds__(kThreadsPerBlock, kMinBlocksPerSM<T...>)
    multi_tensor_kernel(const __grid_constant__ MetadataFor<Op, T...> meta, int64_t chunk_size,
                        Op op, BlockSink sink) {
  using State = typename Op::State;
  op.load_scalars();
  State state{};
  grid_block_thread<Op, T...>(meta, blockIdx.x, threadIdx.x, blockDim.x, chunk_size, op, state);
  if constexpr (std::is_same_v<State, FiniteState>) {
    // Every writer stores the same 1.0f, so the race is benign (as in ATen and Apex).
    if (state.nonfinite && sink.found_inf != nullptr) *sink.found_inf = 1.0f;
    if (state.nonfinite && sink.per_tensor_flags != nullptr) {
      sink.per_tensor_flags[meta.tensor_index[block_slot(meta, static_cast<int>(blockIdx.x))]] = 1.0f;
    }
  } else if constexpr (std::is_same_v<State, SumSquaresState>) {
    using Reduce = cub::BlockReduce<float, kThreadsPerBlock>;
    __shared__ typename Reduce::TempStorage scratch;
    const float block_sum = Reduce(scratch).Sum(state.sumsq);
    if (threadIdx.x == 0) sink.partials[meta.first_global_chunk + blockIdx.x] = block_sum;
  }
}

template <typename Op, typename... T>
void apply(const HostTensorLists<sizeof...(T), Op::tensor_scalars>& lists, int64_t chunk_size,
           const Op& op, const BlockSink& sink) {
  using Metadata = MetadataFor<Op, T...>;
  // The whole argument list within the 4 KB CUDA allows before 12.1 (NOTE: [Launch metadata
  // budget]): a failure here is an op that grew, not a runtime error.
  static_assert(sizeof(Metadata) + sizeof(int64_t) + sizeof(Op) + sizeof(BlockSink) <= 4096,
                "kernel arguments over 4 KB: see NOTE: [Launch metadata budget]");
  const std::vector<Launch> launches =
      plan_launches(lists.numels, chunk_size, {Metadata::kMaxTensors, kMaxBlocksPerLaunch});
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  Metadata meta;
  for (const Launch& launch : launches) {
    fill_metadata(launch, lists, meta);
    multi_tensor_kernel<Op, T...><<<static_cast<unsigned>(launch.blocks.size()),
                                    kThreadsPerBlock, 0, stream>>>(meta, chunk_size, op, sink);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

}  // namespace cuda
}  // namespace peak
