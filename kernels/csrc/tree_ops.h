// C interface of the CUDA tree kernels (tree_ops.cu).
//
// Plain C, no torch and no CUDA headers, so that both the torch binding
// (tree_ops_binding.cpp) and a ctypes loader (cuda_ops.py) can call it. Every
// pointer is a device pointer (a host pointer in the emulated build); every
// launcher only enqueues work on `stream` (a cudaStream_t) and returns a
// cudaError_t value, or one of the negative SPEC_TREE_ERR_* codes for
// arguments it refuses before launching anything. No launcher synchronizes
// with the host, so all of them are CUDA-graph capturable.
//
// Shapes and semantics are those of spec_tree_kernels/reference.py:
// B requests, T nodes per request (root included), W = num_steps + 1.
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define SPEC_TREE_ERR_BAD_ARGUMENT (-1)
#define SPEC_TREE_MAX_NODES 1024
#define SPEC_TREE_MOVE_KV_GEOMETRY 8 /* int64 values describing one cache, see spec_tree_move_kv */

/* Tree structure and mask (reference.build_tree).
 *
 * selected:      [B, T-1] int64 pool indices; node i+1 is selected[:, i].
 * parent_list:   [B, parent_width] int64 (may be NULL when parent_width == 0).
 * seq_lens:      [B] int64.
 * mode:          TreeMaskMode value 0..4; mask layout per modes.py.
 * mask:          the mask buffer, contiguous, with elements of mask_elem_size
 *                bytes (1, 2, 4 or 8); values are written converted to that
 *                width like the Triton kernel does through an integer view.
 * fill_prefix:   FULL_MASK only: first set mask[0, seq_lens_sum*T + T*T*B) to 1.
 * positions, retrieve_index, next_token, next_sibling: [B, T] int64 outputs.
 * ok:            [B] uint8 (torch.bool): 1 iff the selection is a closed tree
 *                of depth <= num_steps.
 */
int spec_tree_build(const int64_t* selected, const int64_t* parent_list, const int64_t* seq_lens, int64_t batch,
                    int64_t nodes, int64_t topk, int64_t num_steps, int64_t parent_width, int32_t mode,
                    int32_t fill_prefix, int64_t seq_lens_sum, void* mask, int32_t mask_elem_size,
                    int64_t* positions, int64_t* retrieve_index, int64_t* next_token, int64_t* next_sibling,
                    uint8_t* ok, void* stream);

/* Greedy tree walk (reference.verify_tree_greedy).
 *
 * candidates, next_token, next_sibling, target_predict: [B, T] int64.
 * accept_index [B, W] int32, accept_length [B] int32, accept_tokens [B, W] int64.
 */
int spec_tree_verify(const int64_t* candidates, const int64_t* next_token, const int64_t* next_sibling,
                     const int64_t* target_predict, int64_t batch, int64_t nodes, int64_t width,
                     int32_t* accept_index, int32_t* accept_length, int64_t* accept_tokens, void* stream);

/* Sampled tree walk: target-only recursive rejection (reference.verify_tree_sampling).
 *
 * candidates, next_token, next_sibling: [B, T] int64.
 * target_probs [B, T, V], coins [B, T], exponentials [B, V]: float32, or
 * float64 when is_double != 0.
 * accept_index [B, W] int32, accept_length [B] int32, accept_tokens [B, W] int64.
 */
int spec_tree_verify_sampling(const int64_t* candidates, const int64_t* next_token, const int64_t* next_sibling,
                              const void* target_probs, const void* coins, const void* exponentials,
                              int32_t is_double, int64_t batch, int64_t nodes, int64_t vocab, int64_t width,
                              int32_t* accept_index, int32_t* accept_length, int64_t* accept_tokens, void* stream);

/* Compact each request's accepted path (reference.move_accepted_kv), every
 * cache in place.
 *
 * caches:        num_caches base pointers (data_ptr of each [num_blocks,
 *                block_size, H, D] view).
 * geometry:      [num_caches, 8] int64: block_size, H, D, then the four
 *                strides of the view in elements, then the element size in
 *                bytes. Caches of equal geometry share one launch.
 * verify_slots:  [B, T] int64 slot of each node (slot s = [s / block_size,
 *                s % block_size]).
 * accept_index:  [B, W] int32 (accept_index_is64 == 0) or int64.
 * accept_length: [B] int32 (accept_length_is64 == 0) or int64.
 */
int spec_tree_move_kv(void* const* caches, const int64_t* geometry, int32_t num_caches, const int64_t* verify_slots,
                      int64_t batch, int64_t nodes, const void* accept_index, int32_t accept_index_is64,
                      int64_t width, const void* accept_length, int32_t accept_length_is64, void* stream);

/* Text for a value returned by the launchers above. */
const char* spec_tree_error_string(int code);

#ifdef __cplusplus
}
#endif
