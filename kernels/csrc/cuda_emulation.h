// A tiny host-side emulation of the CUDA features tree_ops.cu uses, so the
// kernels' logic can be tested bit for bit against the torch reference on a
// machine without a GPU (tests/test_cuda_emulated.py).
//
// Compiled only with -DSPEC_TREE_EMULATE by a host C++ compiler. Every CUDA
// thread of a block is one std::thread; blocks run one after another, so a
// function-scope `__shared__` variable may simply be `static`. Supported:
// threadIdx/blockIdx/blockDim/gridDim, __syncthreads, __syncthreads_and,
// dynamic shared memory, cudaMemsetAsync and the vector types uint2/uint4.
// Not supported (and not used by the kernels): warp intrinsics, atomics.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

using cudaError_t = int;
using cudaStream_t = void*;
constexpr cudaError_t cudaSuccess = 0;

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct alignas(8) uint2 {
  unsigned x, y;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};

inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline const char* cudaGetErrorString(cudaError_t) { return "emulated CUDA error"; }
inline cudaError_t cudaMemsetAsync(void* ptr, int value, size_t bytes, cudaStream_t = nullptr) {
  std::memset(ptr, value, bytes);
  return cudaSuccess;
}

namespace spec_emu {

// A reusable barrier that also ANDs one int per thread (__syncthreads_and).
class Barrier {
 public:
  explicit Barrier(unsigned count) : count_(count) {}
  int arrive_and_wait(int value) {
    std::unique_lock<std::mutex> lock(mutex_);
    unsigned gen = generation_;
    acc_ = acc_ && value;
    if (++arrived_ == count_) {
      result_ = acc_;
      acc_ = 1;
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return result_;
    }
    cv_.wait(lock, [&] { return generation_ != gen; });
    return result_;  // stays valid: nobody can finish the next phase before we read it
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  unsigned count_, arrived_ = 0, generation_ = 0;
  int acc_ = 1, result_ = 1;
};

inline Barrier*& block_barrier() {
  static Barrier* barrier = nullptr;
  return barrier;
}
inline std::vector<unsigned char>& smem_buffer() {
  static std::vector<unsigned char> buffer;
  return buffer;
}
inline unsigned char* dynamic_smem() { return smem_buffer().data(); }

}  // namespace spec_emu

inline thread_local dim3 threadIdx;
inline thread_local dim3 blockIdx;
inline dim3 blockDim;
inline dim3 gridDim;

inline void __syncthreads() { spec_emu::block_barrier()->arrive_and_wait(1); }
inline int __syncthreads_and(int predicate) { return spec_emu::block_barrier()->arrive_and_wait(predicate != 0); }

namespace spec_emu {

// Run `body` as every thread of every block of the grid, block after block.
inline void launch(dim3 grid, dim3 block, size_t smem_bytes, const std::function<void()>& body) {
  gridDim = grid;
  blockDim = block;
  const unsigned threads = block.x * block.y * block.z;
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        // Fresh, poisoned shared memory per block: reading before writing shows up as garbage.
        smem_buffer().assign(smem_bytes + 16, 0xA5);
        Barrier barrier(threads);
        block_barrier() = &barrier;
        std::vector<std::thread> workers;
        workers.reserve(threads);
        for (unsigned t = 0; t < threads; ++t)
          workers.emplace_back([&, t] {
            blockIdx = dim3(bx, by, bz);
            threadIdx = dim3(t % block.x, (t / block.x) % block.y, t / (block.x * block.y));
            body();
          });
        for (auto& w : workers) w.join();
        block_barrier() = nullptr;
      }
}

}  // namespace spec_emu
