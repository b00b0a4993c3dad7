/* Tree attention over a paged KV cache on the host CPU, fp32, one call per layer.
 *
 * What spec_tree_kernels.attention_plan's torch path computes (its oracle),
 * without gathering the cache blocks: for request b, node t and query head h,
 *
 *   out[b, t, h] = softmax_s(scale * q[b, t, h] . K[s] + bias[b, t, s]) . V[s]
 *
 * over the positions s of the request's blocks (s = j * block_size + i is
 * slot i of block blocks[b, j]); bias is 0 where node t sees position s
 * (its context, its ancestors, itself) and -inf elsewhere. K/V head kh = h /
 * (Hq / Hkv) (GQA).
 *
 * Shapes and layout (element strides, any layout the engine uses):
 *   q      [B, T, Hq, D] contiguous float32
 *   k, v   views [num_blocks, block_size, Hkv, D] with strides k_s* / v_s*
 *          (vLLM-CPU fp32: K transposed per block and head, k_stok == 1;
 *          V row-major, v_sdim == 1: the fast loops below)
 *   blocks [B, nb] int64 cache block of each request's j-th block; an id
 *          outside [0, num_blocks) (padding) is never read: its positions
 *          are masked
 * Positions the bias masks are never read either (their slots may hold
 * garbage, even NaN: 0 * NaN would poison a sum).
 *   bias   [B, T, nb * block_size] contiguous float32 (0 / -inf)
 *   out    [B, T, Hq, D] contiguous float32
 *   work   scratch of spec_tree_attention_workspace(T, nb, block_size, D) floats
 *
 * Single-threaded on purpose: the engine's own threads run the model, and a
 * second OpenMP runtime in the process would fight their thread binding.
 * Build: cc -O3 -march=native -shared -fPIC (kernels/cpu_attention.py).
 */

#include <math.h>
#include <stdint.h>
#include <string.h>

#define LANES 16  /* floats per register block (one AVX-512 vector, two AVX2 ones) */
typedef float vec __attribute__((vector_size(LANES * sizeof(float))));  /* GCC/Clang vector extension */

static inline vec load(const float *p) { vec x; memcpy(&x, p, sizeof x); return x; }  /* unaligned */
static inline void store(float *p, vec x) { memcpy(p, &x, sizeof x); }

/* exp(x) for x <= 0 (softmax after the max is subtracted), relative error
 * about 2e-7; x < -87 (masked positions: -inf) gives exactly 0. Branch-free
 * (selects) so the loops that call it vectorize. */
static inline float exp_nonpositive(float x_in) {
    const float x = x_in < -87.0f ? -87.0f : x_in;
    const float n = nearbyintf(x * 1.44269504088896341f);
    const float r = fmaf(n, -0.693145751953125f, fmaf(n, -1.428606765330187e-06f, x));
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    p = fmaf(p * r, r, r) + 1.0f;
    union { float f; int32_t i; } scale2n;
    scale2n.i = ((int32_t)n + 127) << 23;
    return x_in < -87.0f ? 0.0f : p * scale2n.f;
}

int64_t spec_tree_attention_workspace(int64_t T, int64_t nb, int64_t block_size, int64_t D) {
    return T * nb * block_size + T * D + T * D;
}

void spec_tree_attention_f32(const float *q, int64_t B, int64_t T, int64_t Hq, int64_t D,
                             const float *k, int64_t k_sblk, int64_t k_stok, int64_t k_shead, int64_t k_sdim,
                             const float *v, int64_t v_sblk, int64_t v_stok, int64_t v_shead, int64_t v_sdim,
                             int64_t num_blocks, int64_t Hkv, int64_t block_size, const int64_t *blocks, int64_t nb,
                             const float *bias, float scale, float *out, float *work) {
    const int64_t S = nb * block_size;
    const int64_t group = Hq / Hkv;
    float *scores = work;              /* [T, S] */
    float *qs = work + T * S;          /* [T, D] scaled queries of one head */
    float *acc = qs + T * D;           /* [T, D] */
    for (int64_t b = 0; b < B; ++b) {
        for (int64_t h = 0; h < Hq; ++h) {
            const int64_t kh = h / group;
            for (int64_t t = 0; t < T; ++t)
                for (int64_t d = 0; d < D; ++d)
                    qs[t * D + d] = scale * q[((b * T + t) * Hq + h) * D + d];
            /* scores = qs . K^T, block by block */
            for (int64_t j = 0; j < nb; ++j) {
                const int64_t blk = blocks[b * nb + j];
                if (blk < 0 || blk >= num_blocks) {
                    for (int64_t t = 0; t < T; ++t)
                        for (int64_t i = 0; i < block_size; ++i) scores[t * S + j * block_size + i] = -INFINITY;
                    continue;
                }
                const float *kb = k + blk * k_sblk + kh * k_shead;
                if (k_stok == 1 && block_size % LANES == 0) {
                    /* LANES positions per register, summed over d: one load and one FMA per step */
                    for (int64_t t = 0; t < T; ++t) {
                        const float *qt = qs + t * D;
                        float *sc = scores + t * S + j * block_size;
                        for (int64_t i0 = 0; i0 < block_size; i0 += LANES) {
                            vec a = {0};
                            for (int64_t d = 0; d < D; ++d) a += qt[d] * load(kb + d * k_sdim + i0);
                            store(sc + i0, a);
                        }
                    }
                } else {
                    for (int64_t i = 0; i < block_size; ++i) {
                        const float *ki = kb + i * k_stok;
                        for (int64_t t = 0; t < T; ++t) {
                            float dot = 0.0f;
                            for (int64_t d = 0; d < D; ++d) dot = fmaf(qs[t * D + d], ki[d * k_sdim], dot);
                            scores[t * S + j * block_size + i] = dot;
                        }
                    }
                }
            }
            /* softmax over each node's visible positions */
            for (int64_t t = 0; t < T; ++t) {
                float *sc = scores + t * S;
                const float *bi = bias + (b * T + t) * S;
                float m = -INFINITY;
                for (int64_t s = 0; s < S; ++s) {
                    sc[s] = bi[s] == -INFINITY ? -INFINITY : sc[s] + bi[s];  /* masked: whatever the slot held */
                    m = sc[s] > m ? sc[s] : m;
                }
                float sum = 0.0f;
                for (int64_t s = 0; s < S; ++s) {
                    const float e = exp_nonpositive(sc[s] - m);
                    sc[s] = e;
                    sum += e;
                }
                const float inv = 1.0f / sum;
                for (int64_t s = 0; s < S; ++s) sc[s] *= inv;
            }
            /* acc = probs . V */
            if (v_sdim == 1 && D % LANES == 0) {
                /* LANES dims per register, summed over the positions */
                for (int64_t t = 0; t < T; ++t) {
                    const float *pt = scores + t * S;
                    for (int64_t d0 = 0; d0 < D; d0 += LANES) {
                        vec a = {0};
                        for (int64_t j = 0; j < nb; ++j) {
                            const int64_t blk = blocks[b * nb + j];
                            if (blk < 0 || blk >= num_blocks) continue;
                            const float *vb = v + blk * v_sblk + kh * v_shead + d0;
                            const float *pj = pt + j * block_size;
                            for (int64_t i = 0; i < block_size; ++i)
                                if (pj[i] != 0.0f) a += pj[i] * load(vb + i * v_stok);
                        }
                        store(acc + t * D + d0, a);
                    }
                }
            } else {
                memset(acc, 0, sizeof(float) * T * D);
                for (int64_t j = 0; j < nb; ++j) {
                    const int64_t blk = blocks[b * nb + j];
                    if (blk < 0 || blk >= num_blocks) continue;
                    const float *vb = v + blk * v_sblk + kh * v_shead;
                    for (int64_t i = 0; i < block_size; ++i) {
                        const float *vi = vb + i * v_stok;
                        for (int64_t t = 0; t < T; ++t) {
                            const float p = scores[t * S + j * block_size + i];
                            if (p == 0.0f) continue;
                            float *a = acc + t * D;
                            for (int64_t d = 0; d < D; ++d) a[d] = fmaf(p, vi[d * v_sdim], a[d]);
                        }
                    }
                }
            }
            for (int64_t t = 0; t < T; ++t)
                memcpy(out + ((b * T + t) * Hq + h) * D, acc + t * D, sizeof(float) * D);
        }
    }
}
