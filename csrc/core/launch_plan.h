// Host-side chunking and launch packing for multi-tensor apply: plain C++, no torch, no CUDA.
//
// NOTE: [Chunking]
// A multi-tensor op walks a list of tensors (up to a few thousand, from a few elements to
// hundreds of millions each). Every tensor is cut into chunks of `chunk_size` elements; one
// chunk is the unit of work: one CUDA block, one CPU task. Chunks are numbered globally in
// tensor order, skipping empty tensors (they contribute nothing and must not occupy a slot;
// Apex's packer lost pending work behind a trailing empty tensor).
//
// On CUDA the launch metadata (tensor addresses and sizes, each slot's first block and chunk)
// travels by value as a kernel argument, which is limited to 4 KB; so one launch holds at most
// `max_tensors` tensors (NOTE: [Launch metadata budget]) and `max_blocks` blocks (2^20 on CUDA;
// small in the emulated grid's tests). A launch closes when it has max_blocks blocks, or when its
// tensor slots are full after a tensor's last chunk, or at the very end. A tensor cut mid-way by
// the block limit moves to slot 0 of the next launch and continues there.
// Because blocks are emitted strictly in tensor order, block b of launch L is global chunk
// `launch.first_global_chunk + b`: per-chunk results (l2norm partials) land in tensor order and
// per-tensor reductions are plain segmented sums over `chunk_offsets`.
//
// The CUDA launcher and the CPU emulation of its grid (tests) both use this plan, so the packing
// logic is tested on machines without a GPU; only the `<<<>>>` itself is CUDA-only.
#pragma once

#include <cstdint>
#include <vector>

namespace peak {

struct LaunchLimits {
  int max_tensors;  // tensor slots per launch (depends on the number of lists)
  int max_blocks;   // blocks per launch
};

struct BlockAssignment {
  int slot;       // index into the launch's tensor table
  int64_t chunk;  // chunk index within that tensor
};

struct Launch {
  int64_t first_global_chunk = 0;
  std::vector<int64_t> slot_tensor;  // slot -> index of the tensor in the caller's lists
  std::vector<BlockAssignment> blocks;
};

int64_t num_chunks(int64_t numel, int64_t chunk_size);

// chunk_offsets[t] .. chunk_offsets[t+1] are tensor t's global chunk indices (size n+1).
std::vector<int64_t> chunk_offsets(const std::vector<int64_t>& numels, int64_t chunk_size);

// chunk -> index of the tensor that owns it, from chunk_offsets. Built here, in code compiled at
// the baseline level, and not in the CPU launcher: a std::vector constructor instantiated in a
// level's object is a link-once copy with that level's instructions (NOTE: [CPU levels]).
std::vector<int32_t> chunk_owners(const std::vector<int64_t>& offsets);

std::vector<Launch> plan_launches(const std::vector<int64_t>& numels, int64_t chunk_size,
                                  LaunchLimits limits);

}  // namespace peak
