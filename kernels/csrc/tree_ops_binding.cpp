// Torch binding of the CUDA tree kernels: checks what the raw launchers of
// tree_ops.h cannot (devices, dtypes, contiguity), then launches on the
// current CUDA stream of the tensors' device. Outputs are allocated by the
// caller (spec_tree_kernels/cuda_ops.py), which owns shapes and semantics.
//
// Built only on a machine with a CUDA build of torch, by cuda_ops.py through
// torch.utils.cpp_extension.load.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <vector>

#include "tree_ops.h"

namespace {

void check_launch(int code, const char* op) {
  TORCH_CHECK(code == 0, "spec_tree_kernels CUDA ", op, " failed: ", spec_tree_error_string(code));
}

void check_tensor(const at::Tensor& t, const char* name, at::ScalarType dtype, const at::Device& device) {
  TORCH_CHECK(t.device() == device, name, " is on ", t.device(), ", expected ", device);
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

void* current_stream(const at::Device& device) { return c10::cuda::getCurrentCUDAStream(device.index()).stream(); }

// What both verify ops take: candidates, next_token, next_sibling [B, T]
// int64 and the outputs accept_index [B, W] int32, accept_length [B] int32,
// accept_tokens [B, W] int64, all on one CUDA device, which is returned.
at::Device check_verify_tensors(const at::Tensor& candidates, const at::Tensor& next_token,
                                const at::Tensor& next_sibling, const at::Tensor& accept_index,
                                const at::Tensor& accept_length, const at::Tensor& accept_tokens) {
  const at::Device device = candidates.device();
  TORCH_CHECK(device.is_cuda(), "candidates must be a CUDA tensor");
  check_tensor(candidates, "candidates", at::kLong, device);
  check_tensor(next_token, "retrieve_next_token", at::kLong, device);
  check_tensor(next_sibling, "retrieve_next_sibling", at::kLong, device);
  check_tensor(accept_index, "accept_index", at::kInt, device);
  check_tensor(accept_length, "accept_length", at::kInt, device);
  check_tensor(accept_tokens, "accept_tokens", at::kLong, device);
  return device;
}

// selected [B, T-1], parent_list [B, PW], seq_lens [B] int64; mask: contiguous
// buffer in the mode's layout; links [4, B, T] int64 = positions,
// retrieve_index, next_token, next_sibling; ok [B] bool.
void build(const at::Tensor& selected, const at::Tensor& parent_list, const at::Tensor& seq_lens, int64_t topk,
           int64_t num_steps, int64_t mode, bool fill_prefix, int64_t seq_lens_sum, at::Tensor mask,
           at::Tensor links, at::Tensor ok) {
  const at::Device device = selected.device();
  TORCH_CHECK(device.is_cuda(), "selected_index must be a CUDA tensor");
  check_tensor(selected, "selected_index", at::kLong, device);
  check_tensor(parent_list, "parent_list", at::kLong, device);
  check_tensor(seq_lens, "seq_lens", at::kLong, device);
  check_tensor(links, "links", at::kLong, device);
  check_tensor(ok, "ok", at::kBool, device);
  TORCH_CHECK(mask.device() == device && mask.is_contiguous(), "tree mask buffer must be contiguous on ", device);
  const int64_t batch = selected.size(0), nodes = selected.size(1) + 1;
  TORCH_CHECK(links.dim() == 3 && links.size(0) == 4 && links.size(1) == batch && links.size(2) == nodes,
              "links must be [4, B, T]");
  const c10::cuda::CUDAGuard guard(device);
  int64_t* out = links.data_ptr<int64_t>();
  const int64_t plane = batch * nodes;
  check_launch(spec_tree_build(selected.data_ptr<int64_t>(), parent_list.data_ptr<int64_t>(),
                               seq_lens.data_ptr<int64_t>(), batch, nodes, topk, num_steps, parent_list.size(1),
                               static_cast<int32_t>(mode), fill_prefix ? 1 : 0, seq_lens_sum, mask.data_ptr(),
                               static_cast<int32_t>(mask.element_size()), out, out + plane, out + 2 * plane,
                               out + 3 * plane, reinterpret_cast<uint8_t*>(ok.data_ptr<bool>()), current_stream(device)),
               "build_tree");
}

// The verify tensors (check_verify_tensors) and target [B, T] int64.
void verify(const at::Tensor& candidates, const at::Tensor& next_token, const at::Tensor& next_sibling,
            const at::Tensor& target, at::Tensor accept_index, at::Tensor accept_length, at::Tensor accept_tokens) {
  const at::Device device =
      check_verify_tensors(candidates, next_token, next_sibling, accept_index, accept_length, accept_tokens);
  check_tensor(target, "target_predict", at::kLong, device);
  const c10::cuda::CUDAGuard guard(device);
  check_launch(spec_tree_verify(candidates.data_ptr<int64_t>(), next_token.data_ptr<int64_t>(),
                                next_sibling.data_ptr<int64_t>(), target.data_ptr<int64_t>(), candidates.size(0),
                                candidates.size(1), accept_index.size(1), accept_index.data_ptr<int32_t>(),
                                accept_length.data_ptr<int32_t>(), accept_tokens.data_ptr<int64_t>(),
                                current_stream(device)),
               "verify_tree_greedy");
}

// The verify tensors (check_verify_tensors); target_probs [B, T, V], coins
// [B, T], exponentials [B, V] float32 or float64 (one dtype).
void verify_sampling(const at::Tensor& candidates, const at::Tensor& next_token, const at::Tensor& next_sibling,
                     const at::Tensor& target_probs, const at::Tensor& coins, const at::Tensor& exponentials,
                     at::Tensor accept_index, at::Tensor accept_length, at::Tensor accept_tokens) {
  const at::Device device =
      check_verify_tensors(candidates, next_token, next_sibling, accept_index, accept_length, accept_tokens);
  const at::ScalarType real = target_probs.scalar_type();
  TORCH_CHECK(real == at::kFloat || real == at::kDouble, "target_probs must be float32 or float64, got ", real);
  check_tensor(target_probs, "target_probs", real, device);
  check_tensor(coins, "coins", real, device);
  check_tensor(exponentials, "exponentials", real, device);
  TORCH_CHECK(target_probs.dim() == 3 && target_probs.size(0) == candidates.size(0) &&
                  target_probs.size(1) == candidates.size(1),
              "target_probs must be [B, T, V]");
  const c10::cuda::CUDAGuard guard(device);
  check_launch(spec_tree_verify_sampling(candidates.data_ptr<int64_t>(), next_token.data_ptr<int64_t>(),
                                         next_sibling.data_ptr<int64_t>(), target_probs.data_ptr(), coins.data_ptr(),
                                         exponentials.data_ptr(), real == at::kDouble ? 1 : 0, candidates.size(0),
                                         candidates.size(1), target_probs.size(2), accept_index.size(1),
                                         accept_index.data_ptr<int32_t>(), accept_length.data_ptr<int32_t>(),
                                         accept_tokens.data_ptr<int64_t>(), current_stream(device)),
               "verify_tree_sampling");
}

// caches: [num_blocks, block_size, H, D] views of any strides and dtype;
// verify_slots [B, T] int64; accept_index [B, W] and accept_length [B] int32/int64.
void move_kv(const std::vector<at::Tensor>& caches, const at::Tensor& verify_slots, const at::Tensor& accept_index,
             const at::Tensor& accept_length) {
  const at::Device device = verify_slots.device();
  TORCH_CHECK(device.is_cuda(), "verify_slots must be a CUDA tensor");
  check_tensor(verify_slots, "verify_slots", at::kLong, device);
  check_tensor(accept_index, "accept_index", accept_index.scalar_type(), device);
  check_tensor(accept_length, "accept_length", accept_length.scalar_type(), device);
  const bool index64 = accept_index.scalar_type() == at::kLong, length64 = accept_length.scalar_type() == at::kLong;
  TORCH_CHECK(index64 || accept_index.scalar_type() == at::kInt, "accept_index must be int32 or int64");
  TORCH_CHECK(length64 || accept_length.scalar_type() == at::kInt, "accept_length must be int32 or int64");
  std::vector<void*> bases;
  std::vector<int64_t> geometry;
  bases.reserve(caches.size());
  geometry.reserve(caches.size() * SPEC_TREE_MOVE_KV_GEOMETRY);
  for (const at::Tensor& cache : caches) {
    TORCH_CHECK(cache.dim() == 4 && cache.device() == device, "every cache must be a 4-D view on ", device);
    bases.push_back(cache.data_ptr());
    for (int k = 1; k < 4; ++k) geometry.push_back(cache.size(k));
    for (int k = 0; k < 4; ++k) geometry.push_back(cache.stride(k));
    geometry.push_back(cache.element_size());
  }
  const c10::cuda::CUDAGuard guard(device);
  check_launch(spec_tree_move_kv(bases.data(), geometry.data(), static_cast<int32_t>(bases.size()),
                                 verify_slots.data_ptr<int64_t>(), verify_slots.size(0), verify_slots.size(1),
                                 accept_index.data_ptr(), index64 ? 1 : 0, accept_index.size(1),
                                 accept_length.data_ptr(), length64 ? 1 : 0, current_stream(device)),
               "move_accepted_kv");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "CUDA kernels of spec_tree_kernels (see kernels/csrc/tree_ops.h)";
  m.def("build", &build, "build_tree into caller-allocated outputs");
  m.def("verify", &verify, "verify_tree_greedy into caller-allocated outputs");
  m.def("verify_sampling", &verify_sampling, "verify_tree_sampling into caller-allocated outputs");
  m.def("move_kv", &move_kv, "move_accepted_kv, all caches of one geometry in one launch");
}
