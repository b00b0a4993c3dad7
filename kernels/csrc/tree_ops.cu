// CUDA kernels of the tree ops: build_tree, verify_tree_greedy, verify_tree_sampling,
// move_accepted_kv.
//
// Semantics, shapes and dtypes are those of spec_tree_kernels/reference.py
// (the executable specification); tree_ops.h documents the C interface.
// Plain CUDA C++ without torch headers: tree_ops_binding.cpp (torch) and
// cuda_ops.py (ctypes) call the extern "C" launchers at the bottom.
//
// With -DSPEC_TREE_EMULATE the same source compiles as host C++ against
// cuda_emulation.h (one std::thread per CUDA thread), which is how the CPU
// test suite checks these kernels bit for bit against the reference. So the
// kernels use only __syncthreads / __syncthreads_and for cooperation (no warp
// intrinsics, no atomics), and launches go through SPEC_TREE_LAUNCH.
#include "tree_ops.h"

#include <stddef.h>
#include <stdint.h>

#include <vector>

#ifdef SPEC_TREE_EMULATE
#include "cuda_emulation.h"
#define SPEC_TREE_LAUNCH(kernel, grid, block, smem, stream, ...)            \
  do {                                                                        \
    (void)(stream); /* the emulation runs synchronously on the host */        \
    spec_emu::launch((grid), (block), (smem), [&] { kernel(__VA_ARGS__); }); \
  } while (0)
#define SPEC_TREE_DYNAMIC_SMEM(name) unsigned char* name = spec_emu::dynamic_smem()
#else
#include <cuda_runtime.h>
#define SPEC_TREE_LAUNCH(kernel, grid, block, smem, stream, ...) \
  kernel<<<(grid), (block), (smem), static_cast<cudaStream_t>(stream)>>>(__VA_ARGS__)
#define SPEC_TREE_DYNAMIC_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#endif

namespace spec_tree_cuda {

// ------------------------------------------------------------------ helpers

constexpr int kMaxThreads = 1024;
// uint32 words of ancestor bitmask rows held in shared memory per row tile of
// the build kernel (8 KiB): all T rows at once up to T = 128, 64-row tiles at
// T = 1024.
constexpr int kTileBitWords = 2048;
// Caches per move-KV launch: their base pointers travel by value in the
// kernel's parameters (1 KiB), so a launch needs no device-side pointer array
// (which would need a host-to-device copy, not graph capturable).
constexpr int kMaxCachesPerLaunch = 128;
// Depths whose KV rows one thread loads before it stores any of them.
constexpr int kMoveDepthGroup = 8;
// Most threads of a sampled verify block (the race over V); 1024 would cap a
// thread at 64 registers, which spills the walk.
constexpr int kSamplingThreads = 512;

__host__ __device__ __forceinline__ int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
__host__ __device__ __forceinline__ int64_t align_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }
__host__ __device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// Python's floor division (torch's `//` on int64), for possibly negative a.
__device__ __forceinline__ int64_t floor_div(int64_t a, int64_t b) {
  int64_t q = a / b;
  return (q * b != a && ((a < 0) != (b < 0))) ? q - 1 : q;
}

// Store `value` into element `index` of a buffer of `elem_size`-byte elements,
// truncated to that width (what a Triton store through an integer view does).
__device__ __forceinline__ void store_element(void* base, int64_t index, int elem_size, uint64_t value) {
  switch (elem_size) {
    case 1: static_cast<uint8_t*>(base)[index] = static_cast<uint8_t>(value); break;
    case 2: static_cast<uint16_t*>(base)[index] = static_cast<uint16_t>(value); break;
    case 4: static_cast<uint32_t*>(base)[index] = static_cast<uint32_t>(value); break;
    default: static_cast<uint64_t*>(base)[index] = value; break;
  }
}

// ------------------------------------------------------------------- build

// Byte offsets of the build kernel's dynamic shared memory regions.
struct BuildSmemLayout {
  int64_t cand;     // int64[T]  pool index of every node, -1 for the root
  int64_t parent;   // int32[T]  parent node: -1 root, -2 parent candidate not selected
  int64_t rowbits;  // uint32[rows_per_tile * W32]  ancestor-or-self bitmask of each tile row
  int64_t reduce;   // int64[blockDim]  scratch of the FULL_MASK prefix-sum reduction
  int64_t total;

  __host__ __device__ BuildSmemLayout(int64_t nodes, int64_t rows_per_tile, int64_t threads) {
    const int64_t words = ceil_div(nodes, 32);
    cand = 0;
    parent = cand + 8 * nodes;
    rowbits = align_up(parent + 4 * nodes, 8);
    reduce = align_up(rowbits + 4 * rows_per_tile * words, 8);
    total = reduce + 8 * threads;
  }
};

// One block per request, one thread per node (blockDim >= max(T, 128), a multiple of 32).
//
// 1. every node's parent: the selected node holding the pool index that
//    parent_list names for the node's expansion group (first match);
// 2. per node: depth by climbing at most num_steps + 1 levels (the last one
//    leaves the root), positions, retrieve links, closedness;
// 3. the mask, row tile by row tile: ancestor-or-self bitmasks of the tile's
//    rows in shared memory, then all threads write the tile's cells in the
//    mode's layout (consecutive threads, consecutive columns).
__global__ void __launch_bounds__(kMaxThreads)
    build_kernel(const int64_t* selected, const int64_t* parent_list, const int64_t* seq_lens, int nodes,
                 int64_t topk, int64_t num_steps, int64_t parent_width, int mode, int rows_per_tile, void* mask,
                 int mask_elem_size, int64_t* positions, int64_t* retrieve_index, int64_t* next_token,
                 int64_t* next_sibling, uint8_t* ok) {
  SPEC_TREE_DYNAMIC_SMEM(smem);
  const int T = nodes;
  const int tid = static_cast<int>(threadIdx.x);
  const int nthreads = static_cast<int>(blockDim.x);
  const int64_t b = blockIdx.x;
  const int words = (T + 31) / 32;
  const BuildSmemLayout layout(T, rows_per_tile, nthreads);
  int64_t* cand = reinterpret_cast<int64_t*>(smem + layout.cand);
  int* parent = reinterpret_cast<int*>(smem + layout.parent);
  uint32_t* rowbits = reinterpret_cast<uint32_t*>(smem + layout.rowbits);
  int64_t* reduce = reinterpret_cast<int64_t*>(smem + layout.reduce);

  const int64_t seq_len = seq_lens[b];
  for (int i = tid; i < T; i += nthreads) cand[i] = i == 0 ? -1 : selected[b * (T - 1) + i - 1];
  int64_t prefix = 0;  // FULL_MASK: sum of the earlier requests' seq_lens
  if (mode == 0) {
    int64_t part = 0;
    for (int64_t k = tid; k < b; k += nthreads) part += seq_lens[k];
    reduce[tid] = part;
  }
  __syncthreads();
  if (mode == 0) {
    int width = 1;
    while (width < nthreads) width <<= 1;
    for (int stride = width >> 1; stride > 0; stride >>= 1) {
      if (tid < stride && tid + stride < nthreads) reduce[tid] += reduce[tid + stride];
      __syncthreads();
    }
    prefix = reduce[0];
  }

  // 1. parents (reference.node_parents)
  for (int i = tid; i < T; i += nthreads) {
    int p = -1;
    if (i > 0) {
      const int64_t group = floor_div(cand[i], topk);
      if (group == 0) {
        p = 0;  // a child of the root
      } else {
        p = -2;
        if (group > 0 && parent_width > 0) {
          // parent_list has one entry per group; the reference clamps the group
          const int64_t want = parent_list[b * parent_width + min64(group, parent_width - 1)];
          for (int j = 1; j < T; ++j) {
            if (cand[j] == want) {
              p = j;
              break;
            }
          }
        }
      }
    }
    parent[i] = p;
  }
  __syncthreads();

  // 2. depth, positions, links, closedness (reference.ancestor_matrix / tree_links)
  int my_ok = 1;
  for (int i = tid; i < T; i += nthreads) {
    int cur = i;
    int depth = 0;
    for (int64_t s = 0; s <= num_steps && cur >= 0; ++s) {
      cur = parent[cur];
      depth += cur >= 0;
    }
    my_ok &= (cur == -1) && (i == 0 || parent[i] >= 0);
    positions[b * T + i] = seq_len + depth;
    retrieve_index[b * T + i] = b * T + i;
    int first_child = -1;
    for (int j = 1; j < T; ++j) {
      if (parent[j] == i) {
        first_child = j;
        break;
      }
    }
    int sibling = -1;
    if (i > 0) {  // the next higher node with the same parent value (-2 included, like the reference)
      for (int j = i + 1; j < T; ++j) {
        if (parent[j] == parent[i]) {
          sibling = j;
          break;
        }
      }
    }
    next_token[b * T + i] = first_child;
    next_sibling[b * T + i] = sibling;
    if (mode == 4) {  // PARENT_POINTER: [B, 2, T] parent then depth
      store_element(mask, b * 2 * T + i, mask_elem_size, static_cast<uint64_t>(static_cast<int64_t>(parent[i])));
      store_element(mask, b * 2 * T + T + i, mask_elem_size, static_cast<uint64_t>(depth));
    }
  }
  const int all_ok = __syncthreads_and(my_ok);

  // 3. the mask, one tile of rows at a time
  if (mode <= 3) {
    const int words64 = (T + 63) / 64;
    for (int r0 = 0; r0 < T; r0 += rows_per_tile) {
      const int rows = T - r0 < rows_per_tile ? T - r0 : rows_per_tile;
      for (int k = tid; k < rows * words; k += nthreads) rowbits[k] = 0;
      __syncthreads();
      for (int r = tid; r < rows; r += nthreads) {
        uint32_t* bits = rowbits + r * words;
        int cur = r0 + r;
        bits[cur >> 5] |= 1u << (cur & 31);
        for (int64_t s = 0; s <= num_steps && cur >= 0; ++s) {
          cur = parent[cur];
          if (cur >= 0) bits[cur >> 5] |= 1u << (cur & 31);
        }
      }
      __syncthreads();
      if (mode == 0 || mode == 1) {  // one byte-like cell per (row, column), four columns per thread
        const int quads = (T + 3) / 4;
        for (int k = tid; k < rows * quads; k += nthreads) {
          const int r = k / quads;
          const int j = 4 * (k - r * quads);
          const int n = T - j < 4 ? T - j : 4;
          const int64_t i = r0 + r;
          const int64_t cell = mode == 0 ? T * T * b + T * prefix + (seq_len + T) * i + seq_len + j  // FULL_MASK
                                         : (b * T + i) * T + j;                                       // QLEN_ONLY
          // columns j..j+3 share one bitmask word (j is a multiple of 4); spread their bits to bytes
          const uint32_t nibble = (rowbits[r * words + (j >> 5)] >> (j & 31)) & ((1u << n) - 1u);
          const uint32_t bytes = (nibble & 1u) | ((nibble & 2u) << 7) | ((nibble & 4u) << 14) | ((nibble & 8u) << 21);
          unsigned char* dst = static_cast<unsigned char*>(mask) + cell;
          if (mask_elem_size == 1 && n == 4 && reinterpret_cast<uintptr_t>(dst) % 4 == 0) {
            *reinterpret_cast<uint32_t*>(dst) = bytes;  // little endian: byte q is column j + q
          } else {
            for (int q = 0; q < n; ++q) store_element(mask, cell + q, mask_elem_size, (nibble >> q) & 1u);
          }
        }
      } else if (mode == 2) {  // QLEN_ONLY_BITPACKING: T <= 32, one word per row
        for (int r = tid; r < rows; r += nthreads) store_element(mask, b * T + r0 + r, mask_elem_size, rowbits[r]);
      } else {  // ANCESTOR_BITMASK: [B, T, ceil(T/64)] 64-bit words
        for (int k = tid; k < rows * words64; k += nthreads) {
          const int r = k / words64;
          const int w = k - r * words64;
          const uint64_t lo = rowbits[r * words + 2 * w];
          const uint64_t hi = 2 * w + 1 < words ? rowbits[r * words + 2 * w + 1] : 0u;
          store_element(mask, (b * T + r0 + r) * words64 + w, mask_elem_size, lo | (hi << 32));
        }
      }
      __syncthreads();  // the next tile reuses rowbits
    }
  }
  if (tid == 0) ok[b] = static_cast<uint8_t>(all_ok != 0);
}

// FULL_MASK prefix fill for masks whose elements are wider than a byte (a
// byte mask takes cudaMemsetAsync): every element of the buffer's first
// `count` elements becomes 1.
__global__ void fill_ones_kernel(void* mask, int elem_size, int64_t count) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < count; k += step)
    store_element(mask, k, elem_size, 1u);
}

// ------------------------------------------------------------------ verify

// Node j of request b's tree, staged in shared memory by both verify kernels:
// its token, and its links as int16 (T <= 1024). An out-of-range link (only
// in invalid input) ends the list.
__device__ __forceinline__ void stage_tree_node(const int64_t* candidates, const int64_t* next_token,
                                                const int64_t* next_sibling, int64_t b, int T, int j, int64_t* cand,
                                                int16_t* child_of, int16_t* sibling_of) {
  const int64_t node = b * T + j;
  cand[j] = candidates[node];
  const int64_t c = next_token[node];
  const int64_t s = next_sibling[node];
  child_of[j] = static_cast<int16_t>(c >= 0 && c < T ? c : -1);
  sibling_of[j] = static_cast<int16_t>(s >= 0 && s < T ? s : -1);
}

// Per-warp shared memory of the verify kernel: a request's candidates and
// target tokens (int64) and its links (int16: T <= 1024).
__host__ __device__ __forceinline__ int64_t verify_warp_smem(int64_t nodes) { return align_up(20 * nodes, 16); }

// One warp per request: the lanes stage the request's four [T] rows in shared
// memory (coalesced), then lane 0 walks the tree there (reference.verify_tree_greedy):
// from the root, scan the first child and its siblings (at most T - 1 of them)
// for the target's argmax at the current node; accept the first match, repeat.
__global__ void __launch_bounds__(256)
    verify_kernel(const int64_t* candidates, const int64_t* next_token, const int64_t* next_sibling,
                  const int64_t* target_predict, int64_t batch, int nodes, int64_t width, int32_t* accept_index,
                  int32_t* accept_length, int64_t* accept_tokens) {
  SPEC_TREE_DYNAMIC_SMEM(smem);
  const int T = nodes;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t b = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + warp;
  unsigned char* mine = smem + warp * verify_warp_smem(T);
  int64_t* cand = reinterpret_cast<int64_t*>(mine);
  int64_t* target = cand + T;
  int16_t* child_of = reinterpret_cast<int16_t*>(target + T);
  int16_t* sibling_of = child_of + T;
  if (b < batch) {
    for (int j = lane; j < T; j += 32) {
      stage_tree_node(candidates, next_token, next_sibling, b, T, j, cand, child_of, sibling_of);
      target[j] = target_predict[b * T + j];
    }
  }
  __syncthreads();
  if (b >= batch || lane != 0) return;
  int32_t* out_index = accept_index + b * width;
  int64_t* out_tokens = accept_tokens + b * width;
  out_index[0] = 0;
  out_tokens[0] = target[0];
  int cur = 0;
  int length = 0;
  bool alive = true;
  for (int64_t d = 1; d < width; ++d) {
    int chosen = -1;
    if (alive) {
      const int64_t wanted = target[cur];
      int child = child_of[cur];
      for (int step = 0; step < T - 1 && child >= 0; ++step) {  // a node has at most T - 1 children
        if (cand[child] == wanted) {
          chosen = child;
          break;
        }
        child = sibling_of[child];
      }
      alive = chosen >= 0;
    }
    if (alive) {
      cur = chosen;
      ++length;
    }
    out_index[d] = alive ? chosen : -1;
    out_tokens[d] = alive ? target[chosen] : -1;
  }
  accept_length[b] = length;
}

// --------------------------------------------------------- sampled verify

// torch.argmax's order on (value, index) pairs: NaN above everything, then
// the larger value, then the lower index (-0.0 == +0.0); index -1 is "none
// yet" and loses to everything. A strict total order, so any reduction tree
// finds the first maximum, as torch does.
template <typename Real>
__device__ __forceinline__ bool first_max_better(Real v1, int64_t i1, Real v2, int64_t i2) {
  if (i1 < 0) return false;
  if (i2 < 0) return true;
  const bool nan1 = v1 != v1, nan2 = v2 != v2;
  if (nan1 || nan2) return nan1 && (!nan2 || i1 < i2);
  return v1 > v2 || (v1 == v2 && i1 < i2);
}

// Byte offsets of the sampled verify kernel's dynamic shared memory. The
// walk's arrays and the race's reduction arrays share the front (the walk is
// over before the race writes); the rejected tokens stay live throughout.
struct SamplingSmemLayout {
  int64_t cand;        // int64[T]  node tokens
  int64_t coin;        // Real[T]   node coins
  int64_t child_of;    // int16[T]  first child, -1 none
  int64_t sibling_of;  // int16[T]  next sibling, -1 none
  int64_t red_index;   // int64[2 * threads]  race winners: residual, then the fallback over p
  int64_t red_value;   // Real[2 * threads]
  int64_t rejected;    // int64[T]  tokens rejected so far at the walk's current node (sorted at the end)
  int64_t state;       // int32[3]  stop node, children rejected there, accepted length
  int64_t total;
  __host__ __device__ SamplingSmemLayout(int64_t nodes, int64_t threads, int64_t real_size) {
    cand = 0;
    coin = align_up(8 * nodes, 16);
    child_of = align_up(coin + real_size * nodes, 16);
    sibling_of = align_up(child_of + 2 * nodes, 16);
    const int64_t walk_end = align_up(sibling_of + 2 * nodes, 16);
    red_index = 0;
    red_value = align_up(16 * threads, 16);
    const int64_t race_end = align_up(red_value + 2 * real_size * threads, 16);
    rejected = walk_end > race_end ? walk_end : race_end;
    state = align_up(rejected + 8 * nodes, 16);
    total = state + 16;
  }
};

// One block per request (reference.verify_tree_sampling). The threads stage
// the request's tokens, links and coins in shared memory; thread 0 walks the
// tree there (recursive rejection: accept child c iff coin * mass < p_res(c),
// else mass = mass - p_res(c)) and sorts the rejected tokens of the node it
// stopped at; then all threads run the exponential race over V (argmax
// p_res / E, and argmax p / E for an empty residual; each thread's tokens
// grow, so it tells the rejected ones by walking the sorted list along) and
// reduce it block-wide with the first index winning ties.
template <typename Real>
__global__ void __launch_bounds__(kSamplingThreads)
    verify_sampling_kernel(const int64_t* candidates, const int64_t* next_token, const int64_t* next_sibling,
                           const Real* probs, const Real* coins, const Real* exponentials, int nodes, int64_t vocab,
                           int64_t width, int32_t* accept_index, int32_t* accept_length, int64_t* accept_tokens) {
  SPEC_TREE_DYNAMIC_SMEM(smem);
  const int T = nodes;
  const int tid = static_cast<int>(threadIdx.x);
  const int threads = static_cast<int>(blockDim.x);
  const int64_t b = blockIdx.x;
  const SamplingSmemLayout layout(T, threads, sizeof(Real));
  int64_t* cand = reinterpret_cast<int64_t*>(smem + layout.cand);
  Real* coin = reinterpret_cast<Real*>(smem + layout.coin);
  int16_t* child_of = reinterpret_cast<int16_t*>(smem + layout.child_of);
  int16_t* sibling_of = reinterpret_cast<int16_t*>(smem + layout.sibling_of);
  int64_t* rejected = reinterpret_cast<int64_t*>(smem + layout.rejected);
  int32_t* state = reinterpret_cast<int32_t*>(smem + layout.state);
  for (int j = tid; j < T; j += threads) {
    stage_tree_node(candidates, next_token, next_sibling, b, T, j, cand, child_of, sibling_of);
    coin[j] = coins[b * T + j];
  }
  __syncthreads();
  int32_t* out_index = accept_index + b * width;
  int64_t* out_tokens = accept_tokens + b * width;
  if (tid == 0) {
    out_index[0] = 0;
    int cur = 0;
    int length = 0;
    int stop_rejected = 0;  // children rejected at the node where the walk stopped
    bool alive = true;
    for (int64_t d = 1; d < width; ++d) {
      int chosen = -1;
      if (alive) {
        const Real* p_node = probs + (b * T + cur) * vocab;
        Real mass = Real(1);
        int num_rejected = 0;
        int child = child_of[cur];
        for (int step = 0; step < T - 1 && child >= 0; ++step) {  // a node has at most T - 1 children
          const int64_t token = cand[child];
          Real p = token >= 0 && token < vocab ? p_node[token] : Real(0);  // p_res(token)
          for (int r = 0; r < num_rejected; ++r) {
            if (rejected[r] == token) {
              p = Real(0);
              break;
            }
          }
          if (coin[child] * mass < p) {
            chosen = child;
            break;
          }
          mass = mass - p;
          rejected[num_rejected++] = token;
          child = sibling_of[child];
        }
        if (chosen < 0) stop_rejected = num_rejected;
        alive = chosen >= 0;
      }
      if (alive) {
        cur = chosen;
        ++length;
      }
      out_index[d] = alive ? chosen : -1;
      out_tokens[d - 1] = alive ? cand[chosen] : -1;
    }
    out_tokens[width - 1] = -1;
    accept_length[b] = length;
    for (int i = 1; i < stop_rejected; ++i) {  // sort the stop node's rejected tokens (a handful: insertion sort)
      const int64_t token = rejected[i];
      int j = i;
      for (; j > 0 && rejected[j - 1] > token; --j) rejected[j] = rejected[j - 1];
      rejected[j] = token;
    }
    state[0] = cur;
    state[1] = stop_rejected;
    state[2] = length;
  }
  __syncthreads();
  const int64_t cur = state[0];
  const int num_rejected = state[1];
  const Real* p_row = probs + (b * T + cur) * vocab;
  const Real* e_row = exponentials + b * vocab;
  Real res_value = Real(0), all_value = Real(0);
  int64_t res_index = -1, all_index = -1;
  int next_rejected = 0;  // into the sorted rejected tokens: this thread's tokens t only grow
  for (int64_t t = tid; t < vocab; t += threads) {
    const Real e = e_row[t];
    const Real q = p_row[t] / e;
    while (next_rejected < num_rejected && rejected[next_rejected] < t) ++next_rejected;
    const bool is_rejected = next_rejected < num_rejected && rejected[next_rejected] == t;
    const Real q_res = is_rejected ? Real(0) / e : q;  // p_res(t) / E(t)
    if (first_max_better(q_res, t, res_value, res_index)) {
      res_value = q_res;
      res_index = t;
    }
    if (first_max_better(q, t, all_value, all_index)) {
      all_value = q;
      all_index = t;
    }
  }
  int64_t* red_index = reinterpret_cast<int64_t*>(smem + layout.red_index);  // over the walk's arrays: done
  Real* red_value = reinterpret_cast<Real*>(smem + layout.red_value);
  red_index[tid] = res_index;
  red_value[tid] = res_value;
  red_index[threads + tid] = all_index;
  red_value[threads + tid] = all_value;
  __syncthreads();
  for (int half = threads / 2; half > 0; half /= 2) {  // threads is a power of two
    if (tid < half) {
      for (int k = tid; k < 2 * threads; k += threads) {
        if (first_max_better(red_value[k + half], red_index[k + half], red_value[k], red_index[k])) {
          red_value[k] = red_value[k + half];
          red_index[k] = red_index[k + half];
        }
      }
    }
    __syncthreads();
  }
  if (tid == 0) {
    const bool empty = !(red_value[0] > Real(0));  // no positive p_res / E (or NaN): race over p
    out_tokens[state[2]] = empty ? red_index[threads] : red_index[0];
  }
}

// ----------------------------------------------------------------- move KV

struct CachePack {
  unsigned char* base[kMaxCachesPerLaunch];
};

// How one launch walks a row (all H * D elements of one slot) of its caches:
// the row is `heads` runs of `units_per_head` units of sizeof(Unit) bytes,
// consecutive runs `head_stride` bytes apart, consecutive units `unit_stride`
// bytes apart (sizeof(Unit) for a contiguous head dim, whose bytes are then
// copied in up to 16-byte vectors; one element otherwise).
struct MoveGeometry {
  int64_t block_size, stride_block, stride_offset;  // strides in bytes
  int64_t heads, head_stride, units_per_head, unit_stride;
};

__device__ __forceinline__ int64_t load_index(const void* p, int is64, int64_t k) {
  return is64 ? static_cast<const int64_t*>(p)[k] : static_cast<const int32_t*>(p)[k];
}

// grid.x = B * chunks (request-major), grid.y = cache of the pack. Each thread
// owns one unit of the row and moves it for every accepted depth.
//
// Order safety: the reference reads every source row before writing any
// destination. A thread here loads the units of up to kMoveDepthGroup depths
// and only then stores them, so with W <= kMoveDepthGroup (every EAGLE
// configuration in use) it is the reference's order exactly. Wider paths go
// group after group, in depth order, which is equivalent on any tree that
// build_tree produces (what the Triton kernel's depth loop relies on too):
// depth d reads the slot of node accept_index[d] >= d, and only earlier depths
// d' < d have written, into the slots of nodes d' < d.
template <typename Unit>
__global__ void __launch_bounds__(256)
    move_kv_kernel(CachePack pack, MoveGeometry g, const int64_t* verify_slots, int64_t nodes,
                   const void* accept_index, int index_is64, int64_t width, const void* accept_length,
                   int length_is64, int64_t chunks) {
  SPEC_TREE_DYNAMIC_SMEM(smem);
  int64_t* src_off = reinterpret_cast<int64_t*>(smem);  // [W] byte offset of the source row, -1: no move
  int64_t* dst_off = src_off + width;                   // [W] byte offset of the destination row
  const int64_t b = blockIdx.x / chunks;
  const int64_t chunk = blockIdx.x - b * chunks;
  const int64_t length = load_index(accept_length, length_is64, b);
  for (int64_t d = threadIdx.x; d < width; d += blockDim.x) {
    const int64_t node = load_index(accept_index, index_is64, b * width + d);
    // reference: depth d moves iff d <= accept_length, node >= 0 and node != d
    // (nodes >= T only occur in invalid input; they are not moved)
    const bool moving = d <= length && node >= 0 && node < nodes && node != d;
    int64_t src = -1, dst = -1;
    if (moving) {
      const int64_t s = verify_slots[b * nodes + node];
      const int64_t t = verify_slots[b * nodes + min64(d, nodes - 1)];
      src = (s / g.block_size) * g.stride_block + (s % g.block_size) * g.stride_offset;
      dst = (t / g.block_size) * g.stride_block + (t % g.block_size) * g.stride_offset;
    }
    src_off[d] = src;
    dst_off[d] = dst;
  }
  __syncthreads();
  const int64_t u = chunk * blockDim.x + threadIdx.x;
  if (u >= g.heads * g.units_per_head) return;
  const int64_t head = u / g.units_per_head;
  const int64_t unit = (u - head * g.units_per_head) * g.unit_stride + head * g.head_stride;
  unsigned char* base = pack.base[blockIdx.y] + unit;
  for (int64_t d0 = 0; d0 < width; d0 += kMoveDepthGroup) {
    Unit vals[kMoveDepthGroup];
#pragma unroll
    for (int k = 0; k < kMoveDepthGroup; ++k) {
      if (d0 + k < width && src_off[d0 + k] >= 0) vals[k] = *reinterpret_cast<const Unit*>(base + src_off[d0 + k]);
    }
#pragma unroll
    for (int k = 0; k < kMoveDepthGroup; ++k) {
      if (d0 + k < width && src_off[d0 + k] >= 0) *reinterpret_cast<Unit*>(base + dst_off[d0 + k]) = vals[k];
    }
  }
}

template <typename Unit>
cudaError_t launch_move(const std::vector<unsigned char*>& bases, const MoveGeometry& g, const int64_t* verify_slots,
                        int64_t batch, int64_t nodes, const void* accept_index, int index_is64, int64_t width,
                        const void* accept_length, int length_is64, void* stream) {
  const int64_t units = g.heads * g.units_per_head;
  const int threads = static_cast<int>(min64(256, align_up(units, 32)));
  const int64_t chunks = ceil_div(units, threads);
  const size_t smem = static_cast<size_t>(16 * width);
  for (size_t first = 0; first < bases.size(); first += kMaxCachesPerLaunch) {
    CachePack pack{};
    const size_t count = bases.size() - first < static_cast<size_t>(kMaxCachesPerLaunch)
                             ? bases.size() - first
                             : static_cast<size_t>(kMaxCachesPerLaunch);
    for (size_t k = 0; k < count; ++k) pack.base[k] = bases[first + k];
    const dim3 grid(static_cast<unsigned>(batch * chunks), static_cast<unsigned>(count));
    SPEC_TREE_LAUNCH(move_kv_kernel<Unit>, grid, dim3(static_cast<unsigned>(threads)), smem, stream, pack, g, verify_slots, nodes,
                     accept_index, index_is64, width, accept_length, length_is64, chunks);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

// The widest copy unit (16, 8, 4, 2 or 1 bytes) that every base pointer,
// every stride that is used, and the contiguous run length are multiples of.
int pick_unit_bytes(const std::vector<unsigned char*>& bases, int64_t run_bytes, const int64_t* strides, int nstrides) {
  int unit = 16;
  while (unit > 1) {
    bool fits = run_bytes % unit == 0;
    for (int k = 0; k < nstrides; ++k) fits = fits && strides[k] % unit == 0;
    for (unsigned char* p : bases) fits = fits && reinterpret_cast<uintptr_t>(p) % unit == 0;
    if (fits) break;
    unit /= 2;
  }
  return unit;
}

}  // namespace spec_tree_cuda

using namespace spec_tree_cuda;

// ---------------------------------------------------------------- launchers

extern "C" int spec_tree_build(const int64_t* selected, const int64_t* parent_list, const int64_t* seq_lens,
                               int64_t batch, int64_t nodes, int64_t topk, int64_t num_steps, int64_t parent_width,
                               int32_t mode, int32_t fill_prefix, int64_t seq_lens_sum, void* mask,
                               int32_t mask_elem_size, int64_t* positions, int64_t* retrieve_index,
                               int64_t* next_token, int64_t* next_sibling, uint8_t* ok, void* stream) {
  if (batch < 0 || nodes < 1 || nodes > SPEC_TREE_MAX_NODES || topk < 1 || num_steps < 1 || parent_width < 0 ||
      mode < 0 || mode > 4 || (mode == 2 && nodes > 32) || seq_lens_sum < 0 ||
      (mask_elem_size != 1 && mask_elem_size != 2 && mask_elem_size != 4 && mask_elem_size != 8))
    return SPEC_TREE_ERR_BAD_ARGUMENT;
  if (batch == 0) return cudaSuccess;
  if (mode == 0 && fill_prefix) {
    // The whole mask first, then the kernel writes the tree cells over it:
    // the result of the reference's fill_(True) + cell writes, at memset speed.
    const int64_t count = seq_lens_sum * nodes + nodes * nodes * batch;
    if (mask_elem_size == 1) {
      const cudaError_t err = cudaMemsetAsync(mask, 1, static_cast<size_t>(count), static_cast<cudaStream_t>(stream));
      if (err != cudaSuccess) return err;
    } else {
      const unsigned blocks = static_cast<unsigned>(min64(ceil_div(count, 256), 4096));
      SPEC_TREE_LAUNCH(fill_ones_kernel, dim3(blocks), dim3(256), 0, stream, mask, mask_elem_size, count);
      const cudaError_t err = cudaGetLastError();
      if (err != cudaSuccess) return err;
    }
  }
  const int words = static_cast<int>(ceil_div(nodes, 32));
  const int rows_per_tile = static_cast<int>(min64(nodes, kTileBitWords / words));
  // At least 128 threads: the mask stage has T * T / 4 cell quads to write.
  const int threads = static_cast<int>(min64(kMaxThreads, align_up(nodes < 128 ? 128 : nodes, 32)));
  const BuildSmemLayout layout(nodes, rows_per_tile, threads);  // at most ~36 KiB: no opt-in needed
  SPEC_TREE_LAUNCH(build_kernel, dim3(static_cast<unsigned>(batch)), dim3(static_cast<unsigned>(threads)), static_cast<size_t>(layout.total),
                   stream, selected, parent_list, seq_lens, static_cast<int>(nodes), topk, num_steps, parent_width,
                   static_cast<int>(mode),
                   rows_per_tile, mask, static_cast<int>(mask_elem_size), positions, retrieve_index, next_token,
                   next_sibling, ok);
  return cudaGetLastError();
}

extern "C" int spec_tree_verify(const int64_t* candidates, const int64_t* next_token, const int64_t* next_sibling,
                                const int64_t* target_predict, int64_t batch, int64_t nodes, int64_t width,
                                int32_t* accept_index, int32_t* accept_length, int64_t* accept_tokens, void* stream) {
  if (batch < 0 || nodes < 1 || nodes > SPEC_TREE_MAX_NODES || width < 1) return SPEC_TREE_ERR_BAD_ARGUMENT;
  if (batch == 0) return cudaSuccess;
  // Small batches: one warp per block, spread over the SMs; large ones: up to
  // 8 warps per block, within 40 KiB of shared memory.
  const int64_t by_smem = (40 * 1024) / verify_warp_smem(nodes);
  const int64_t warps = min64(min64(8, by_smem < 1 ? 1 : by_smem), ceil_div(batch, 264));
  const int64_t blocks = ceil_div(batch, warps);
  SPEC_TREE_LAUNCH(verify_kernel, dim3(static_cast<unsigned>(blocks)), dim3(static_cast<unsigned>(32 * warps)),
                   static_cast<size_t>(warps * verify_warp_smem(nodes)), stream, candidates, next_token, next_sibling,
                   target_predict, batch, static_cast<int>(nodes), width, accept_index, accept_length, accept_tokens);
  return cudaGetLastError();
}

extern "C" int spec_tree_verify_sampling(const int64_t* candidates, const int64_t* next_token,
                                         const int64_t* next_sibling, const void* target_probs, const void* coins,
                                         const void* exponentials, int32_t is_double, int64_t batch, int64_t nodes,
                                         int64_t vocab, int64_t width, int32_t* accept_index, int32_t* accept_length,
                                         int64_t* accept_tokens, void* stream) {
  if (batch < 0 || nodes < 1 || nodes > SPEC_TREE_MAX_NODES || vocab < 1 || width < 1)
    return SPEC_TREE_ERR_BAD_ARGUMENT;
  if (batch == 0) return cudaSuccess;
  // About 8 tokens per thread in the race, 32..kSamplingThreads threads (a power of two).
  int threads = 32;
  while (threads < kSamplingThreads && 8 * static_cast<int64_t>(threads) < vocab) threads *= 2;
  const SamplingSmemLayout layout(nodes, threads, is_double ? 8 : 4);  // at most ~28 KiB: no opt-in needed
  if (is_double) {
    SPEC_TREE_LAUNCH(verify_sampling_kernel<double>, dim3(static_cast<unsigned>(batch)), dim3(static_cast<unsigned>(threads)),
                     static_cast<size_t>(layout.total), stream, candidates, next_token, next_sibling,
                     static_cast<const double*>(target_probs), static_cast<const double*>(coins),
                     static_cast<const double*>(exponentials), static_cast<int>(nodes), vocab, width, accept_index,
                     accept_length, accept_tokens);
  } else {
    SPEC_TREE_LAUNCH(verify_sampling_kernel<float>, dim3(static_cast<unsigned>(batch)), dim3(static_cast<unsigned>(threads)),
                     static_cast<size_t>(layout.total), stream, candidates, next_token, next_sibling,
                     static_cast<const float*>(target_probs), static_cast<const float*>(coins),
                     static_cast<const float*>(exponentials), static_cast<int>(nodes), vocab, width, accept_index,
                     accept_length, accept_tokens);
  }
  return cudaGetLastError();
}

extern "C" int spec_tree_move_kv(void* const* caches, const int64_t* geometry, int32_t num_caches,
                                 const int64_t* verify_slots, int64_t batch, int64_t nodes, const void* accept_index,
                                 int32_t accept_index_is64, int64_t width, const void* accept_length,
                                 int32_t accept_length_is64, void* stream) {
  if (num_caches < 0 || batch < 0 || nodes < 1 || width < 1) return SPEC_TREE_ERR_BAD_ARGUMENT;
  if (batch == 0) return cudaSuccess;
  std::vector<bool> done(static_cast<size_t>(num_caches), false);
  for (int32_t i = 0; i < num_caches; ++i) {
    if (done[i]) continue;
    const int64_t* gi = geometry + SPEC_TREE_MOVE_KV_GEOMETRY * i;
    // Caches with the same geometry (shape, strides, element size) share a launch.
    std::vector<unsigned char*> bases;
    for (int32_t j = i; j < num_caches; ++j) {
      const int64_t* gj = geometry + SPEC_TREE_MOVE_KV_GEOMETRY * j;
      bool same = !done[j];
      for (int k = 0; k < SPEC_TREE_MOVE_KV_GEOMETRY; ++k) same = same && gi[k] == gj[k];
      if (same) {
        done[j] = true;
        bases.push_back(static_cast<unsigned char*>(caches[j]));
      }
    }
    const int64_t block_size = gi[0], heads = gi[1], dim = gi[2], elem = gi[7];
    if (block_size < 1 || heads < 0 || dim < 0 || (elem != 1 && elem != 2 && elem != 4 && elem != 8))
      return SPEC_TREE_ERR_BAD_ARGUMENT;
    if (heads == 0 || dim == 0) continue;  // empty rows: nothing to move
    // Byte strides; a stride of a size-1 dimension is never used, so it must not limit the copy width.
    const int64_t s_block = gi[3] * elem;
    const int64_t s_offset = block_size > 1 ? gi[4] * elem : 0;
    int64_t s_head = heads > 1 ? gi[5] * elem : 0;
    const int64_t s_dim = dim > 1 ? gi[6] * elem : elem;
    MoveGeometry g{block_size, s_block, s_offset, heads, s_head, 0, 0};
    int unit = static_cast<int>(elem);
    if (s_dim == elem) {  // contiguous head dim: copy runs of bytes in wide units
      int64_t run = dim * elem;
      if (heads > 1 && s_head == run) {  // heads back to back too: one run per row
        run *= heads;
        g.heads = 1;
        s_head = 0;
      }
      const int64_t strides[3] = {s_block, s_offset, s_head};
      unit = pick_unit_bytes(bases, run, strides, 3);
      g.head_stride = s_head;
      g.units_per_head = run / unit;
      g.unit_stride = unit;
    } else {  // strided head dim: one element per unit
      g.units_per_head = dim;
      g.unit_stride = s_dim;
    }
    cudaError_t err;
    switch (unit) {
      case 16: err = launch_move<uint4>(bases, g, verify_slots, batch, nodes, accept_index, accept_index_is64, width, accept_length, accept_length_is64, stream); break;
      case 8: err = launch_move<uint2>(bases, g, verify_slots, batch, nodes, accept_index, accept_index_is64, width, accept_length, accept_length_is64, stream); break;
      case 4: err = launch_move<uint32_t>(bases, g, verify_slots, batch, nodes, accept_index, accept_index_is64, width, accept_length, accept_length_is64, stream); break;
      case 2: err = launch_move<uint16_t>(bases, g, verify_slots, batch, nodes, accept_index, accept_index_is64, width, accept_length, accept_length_is64, stream); break;
      default: err = launch_move<uint8_t>(bases, g, verify_slots, batch, nodes, accept_index, accept_index_is64, width, accept_length, accept_length_is64, stream); break;
    }
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

extern "C" const char* spec_tree_error_string(int code) {
  if (code == SPEC_TREE_ERR_BAD_ARGUMENT) return "spec_tree: invalid argument (shape, mode or size out of range)";
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}
