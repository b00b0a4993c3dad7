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
 * The call (spec_tree_attention_run): a spec_tree_layer (k, v, Hq, Hkv, block_size, D,
 * scale, features), a spec_tree_step (B, T, blocks, nb, bias, ALiBi positions, work), and
 * q / out with their token strides.
 *   q      [B, T, Hq, D] float32, Hq * D contiguous per token, tokens q_stok floats apart
 *   k, v   views [num_blocks, block_size, Hkv, D] with strides k_s* / v_s*
 *          (vLLM-CPU fp32: K transposed per block and head, k_stok == 1;
 *          V row-major, v_sdim == 1: the vectorized loops below)
 *   blocks [B, nb] int64 cache block of each request's j-th block; an id
 *          outside [0, num_blocks) (padding) is never read: its positions
 *          are masked
 * Positions the bias masks are never read into the output either (their
 * slots may hold garbage, even NaN: 0 * NaN would poison a sum), and
 * positions past a request's last visible one are not read at all.
 *   bias   [B, T, nb * block_size] contiguous float32 (0 / -inf); a sliding
 *          window is part of it (the torch plan's windowed bias), and the
 *          blocks before the first position any row of a request sees are
 *          not read either
 *   out    [B, T, Hq, D] float32 laid out as q (tokens o_stok floats apart)
 *   work   scratch of spec_tree_attention_workspace(nb, block_size, D) floats, sized for the
 *          step's threads (the call never runs on more)
 *   features (spec_tree_kernels.attention_reference gives the semantics; all
 *          off: soft_cap 0 and NULL pointers, the code path of before):
 *   soft_cap  > 0: score = soft_cap * tanh(score / soft_cap) on scaled scores
 *   sinks  [Hq] float32 or NULL: a logit per query head in the softmax
 *          denominator only
 *   alibi  [Hq] float32 slopes or NULL: score += slope * (key_pos - query_pos),
 *          key_pos [B, nb * block_size] and query_pos [B, T] float32 logical
 *          positions (after the cap, before the mask)
 *
 * Work split: one unit is up to ROWS query rows (tile_rows; node-major (t, g) pairs of one KV
 * head's GQA group) of one request, so each K/V vector loaded serves the unit's
 * rows from registers; units run on the process's OpenMP threads (built with
 * -fopenmp against libgomp.so.1, the runtime torch already loaded: one thread
 * pool, the engine's thread binding), or serially where OpenMP did not build.
 * Build: cc -O3 -march=native -fopenmp -shared -fPIC (kernels/cpu_attention.py).
 */

#include <math.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* One register block is one vector register of the build CPU (-march=native), so the
 * accumulators below stay in registers: ROWS + 2 vectors in the score loop, PV_ROWS x 4 + 4
 * in the probs . V loop, against 32 vector registers (AVX-512, AArch64) or 16 (AVX2, SSE).
 * A block wider than a register spills every accumulator: 16-float blocks on an AVX2 CPU
 * ran 7-9x slower than 8-float ones (results/2026-12-03/cpu_tree_attention). */
#if defined(__AVX512F__)
#define LANES 16  /* floats per register block */
#define PV_ROWS 4 /* rows per probs . V pass */
#define ROWS 16   /* most query rows per unit (each K vector loaded serves a unit's rows) */
#elif defined(__AVX__)
#define LANES 8
#define PV_ROWS 2
#define ROWS 8
#elif defined(__aarch64__)
#define LANES 4
#define PV_ROWS 4
#define ROWS 16
#else
#define LANES 4
#define PV_ROWS 2
#define ROWS 8
#endif
/* K is transposed per block (k_stok == 1): a score pass reads D rows of a block at once, D concurrent
 * streams, more than a core's stream prefetchers follow. Where the step's K and V outgrow what caches
 * keep (PREFETCH_BYTES), each K row is prefetched PREFETCH_AHEAD register blocks ahead: 13% faster at
 * batch 8 x 1500 positions (18 MB) on a Zen 4 EPYC, 1-2% slower where it all sits in L2 or L3
 * (results/2026-12-06/cpu_attention). */
#define PREFETCH_AHEAD 2
#define PREFETCH_BYTES (8 << 20)
typedef float vec __attribute__((vector_size(LANES * sizeof(float))));  /* GCC/Clang vector extension */
typedef int32_t ivec __attribute__((vector_size(LANES * sizeof(int32_t))));

static inline vec load(const float *p) { vec x; memcpy(&x, p, sizeof x); return x; }  /* unaligned */
static inline void store(float *p, vec x) { memcpy(p, &x, sizeof x); }
static inline vec splat(float x) { return (vec){0} + x; }

static int max_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

static int thread_id(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

/* Query rows per unit for `rows` rows per (request, KV head) and `pairs` such pairs on `threads`
 * threads: a multiple of 4 (PV_ROWS divides it), at most ROWS. As few tiles as ROWS allows, more
 * when the pairs alone would leave threads idle, then rows spread evenly over them (24 rows: two
 * tiles of 12, not 16 + 8 of padding): K is read once per tile, padding rows cost as real ones.
 * A row's arithmetic never depends on its tile, so neither do the results. */
static int tile_rows(int64_t rows, int64_t pairs, int64_t threads) {
    if (rows < 1 || pairs < 1) return 4;  /* no row or no request: no unit runs */
    int64_t tiles = (rows + ROWS - 1) / ROWS;
    const int64_t for_threads = (threads + pairs - 1) / pairs, most = (rows + 3) / 4;
    if (for_threads > tiles) tiles = for_threads < most ? for_threads : most;
    const int64_t per_tile = (rows + tiles - 1) / tiles;
    return (int)((per_tile + 3) / 4 * 4);
}

/* exp(x) for x <= 0 (softmax after the max is subtracted), LANES at a time,
 * relative error about 2e-7; x < -87 (masked positions: -inf) gives exactly 0.
 * Round-to-nearest by the 1.5 * 2^23 trick, 2^n by building the exponent bits. */
static inline vec exp_nonpositive(vec x_in) {
    const ivec keep = x_in >= splat(-87.0f);
    const vec x = (vec)(((ivec)x_in & keep) | ((ivec)splat(-87.0f) & ~keep));
    const vec shifter = splat(12582912.0f);
    const vec n = (x * 1.44269504088896341f + shifter) - shifter;
    const vec r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
    vec p = splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = (p * r) * r + r + 1.0f;
    const ivec two_n = (__builtin_convertvector(n, ivec) + 127) << 23;
    return (vec)((ivec)(p * (vec)two_n) & keep);
}

static inline float hmax(vec x) {
    float m = x[0];
    for (int l = 1; l < LANES; ++l) m = x[l] > m ? x[l] : m;
    return m;
}

static inline float hsum(vec x) {
    float s = 0.0f;
    for (int l = 0; l < LANES; ++l) s += x[l];
    return s;
}

/* The kernel bench's roofline: `threads` OpenMP threads each run `iters` rounds of FMA_CHAINS
 * independent register-only FMA chains (enough chains to cover the FMA latency on every x86 core:
 * 4 cycles x 2 pipes). Returns the seconds the slowest thread spent in its loop and writes the float
 * FMAs done in all (every lane of every thread that ran) to *fmas: their ratio is the ceiling for
 * spec_tree_attention_run's two FMA passes. The count is returned apart from the time so that a test
 * checks it without a clock. */
#define FMA_CHAINS 12
static double monotonic_seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

double spec_tree_fma_seconds(int64_t iters, int64_t threads, double *fmas) {
    volatile float seed = 1.0f, step = 1e-9f;  /* volatile: the loop cannot be folded at build time */
    volatile float sink = 0.0f;
    double seconds = 0.0;
    int64_t ran = 0;  /* threads that ran (1 where OpenMP did not build) */
#pragma omp parallel num_threads((int)threads) reduction(max : seconds) reduction(+ : ran)
    {
        vec acc[FMA_CHAINS];
        for (int c = 0; c < FMA_CHAINS; ++c) acc[c] = splat(seed + (float)c);
        const vec scale = splat(seed), add = splat(step);
#pragma omp barrier
        const double t0 = monotonic_seconds();
        for (int64_t i = 0; i < iters; ++i)
            for (int c = 0; c < FMA_CHAINS; ++c) acc[c] = acc[c] * scale + add;
        seconds = monotonic_seconds() - t0;
        ran = 1;
        float total = 0.0f;
        for (int c = 0; c < FMA_CHAINS; ++c) total += hsum(acc[c]);
#pragma omp critical
        sink += total;
    }
    (void)sink;
    *fmas = (double)iters * FMA_CHAINS * LANES * (double)ran;
    return seconds;
}

/* The register block this build chose (floats): the startup log, the kernel bench and a test read it. */
int64_t spec_tree_attention_lanes(void) { return LANES; }

int64_t spec_tree_attention_workspace(int64_t nb, int64_t block_size, int64_t D) {
    return (int64_t)max_threads() * (ROWS * nb * block_size + ROWS * D);
}

/* The OpenMP threads a workspace sized now is for (spec_tree_step.threads). */
int64_t spec_tree_attention_threads(void) { return max_threads(); }

/* The positions a request's rows can see end before this (bias -inf from there on). */
static int64_t visible_span(const float *bias_b, int64_t T, int64_t S) {
    int64_t span = 0;
    for (int64_t t = 0; t < T; ++t) {
        const float *bi = bias_b + t * S;
        int64_t s = S;
        while (s > span && bi[s - 1] == -INFINITY) --s;
        span = s > span ? s : span;
    }
    return span;
}

/* The first position any row of a request sees (span when none): a window's start. */
static int64_t visible_first(const float *bias_b, int64_t T, int64_t S, int64_t span) {
    int64_t first = span;
    for (int64_t t = 0; t < T; ++t) {
        const float *bi = bias_b + t * S;
        int64_t s = 0;
        while (s < first && bi[s] == -INFINITY) ++s;
        first = s;
    }
    return first;
}

/* tanh, LANES at a time, relative error about 4e-7: an odd polynomial (Taylor to x^9) for |x| < 0.25,
 * else (1 - e) / (1 + e) with e = exp(-2|x|) (no cancellation there: e <= 0.61); the sign put back. */
static inline vec tanh_vec(vec x) {
    const ivec sign = (ivec)x & ((ivec){0} + INT32_MIN);  /* (splat(-0.0f) would be +0.0f: 0 + -0 = +0) */
    const vec ax = (vec)((ivec)x & ~sign);
    const vec e = exp_nonpositive(-2.0f * ax);
    const vec big = (1.0f - e) / (1.0f + e);
    const vec x2 = ax * ax;
    vec poly = splat(62.0f / 2835.0f);
    poly = poly * x2 - 17.0f / 315.0f;
    poly = poly * x2 + 2.0f / 15.0f;
    poly = poly * x2 - 1.0f / 3.0f;
    const vec small = ax + ax * x2 * poly;
    const ivec use_small = ax < splat(0.25f);
    return (vec)((((ivec)small & use_small) | ((ivec)big & ~use_small)) | sign);
}

/* score = cap * tanh(score / cap) over [from, to) of `rows` rows (row stride S). */
static void soft_cap_rows(float *scores, int rows, int64_t S, int64_t from, int64_t to, float cap) {
    const float inv = 1.0f / cap;
    for (int r = 0; r < rows; ++r) {
        float *sc = scores + r * S;
        int64_t s = from;
        for (; s + LANES <= to; s += LANES) store(sc + s, cap * tanh_vec(load(sc + s) * inv));
        for (; s < to; ++s) sc[s] = cap * tanhf(sc[s] * inv);
    }
}

/* Where scores_vectorized stores LANES scores of row r: plain (bias NULL), or with softmax's first
 * pass fused in (the bias added, a masked position -inf whatever its slot held, NaN included, and
 * the row's running max kept), which saves a pass over the scores. */
static inline __attribute__((always_inline)) void store_scores(float *dst, vec x, const float *bias, vec *row_max) {
    if (bias) {
        const vec neg_inf = splat(-INFINITY), b = load(bias);
        const ivec masked = b == neg_inf;
        x = (vec)(((ivec)(x + b) & ~masked) | ((ivec)neg_inf & masked));
        *row_max = (vec)(((ivec)x & (x > *row_max)) | ((ivec)*row_max & ~(x > *row_max)));
    }
    store(dst, x);
}

/* scores[r, s] = qs[r] . K[s] for nr rows (a constant after inlining: the accumulators are
 * registers) over the first `span` positions (rounded up to LANES); K transposed per block
 * (k_stok == 1), block_size % LANES == 0. With bias_rows (each row's bias at the same positions),
 * the bias is applied as softmax_row does and row_max[r] is the row's max (-inf: none seen). */
static inline __attribute__((always_inline)) void scores_tile(
    const float *qs, int64_t D, const float *k, int64_t k_sblk, int64_t k_shead, int64_t k_sdim, int64_t kh,
    const int64_t *blocks_b, int64_t num_blocks, int64_t block_size, int64_t span, int64_t S, float *scores,
    const float *const *bias_rows, float *row_max, const int nr, const int prefetch) {
    vec mx[ROWS];
    for (int r = 0; r < nr; ++r) mx[r] = splat(-INFINITY);
    for (int64_t j = 0; j * block_size < span; ++j) {
        const int64_t blk = blocks_b[j];
        const int64_t end = span - j * block_size < block_size ? span - j * block_size : block_size;
        const int64_t at = j * block_size;
        if (blk < 0 || blk >= num_blocks) {
            for (int r = 0; r < nr; ++r)
                for (int64_t i = 0; i < block_size; ++i) scores[r * S + at + i] = -INFINITY;
            continue;
        }
        const float *kb = k + blk * k_sblk + kh * k_shead;
        for (int64_t i0 = 0; i0 < end; i0 += LANES) {
            vec acc[ROWS] = {{0}};
            for (int64_t d = 0; d < D; ++d) {
                const vec kv = load(kb + d * k_sdim + i0);
                if (prefetch) __builtin_prefetch(kb + d * k_sdim + i0 + PREFETCH_AHEAD * LANES);
                for (int r = 0; r < nr; ++r) acc[r] += qs[r * D + d] * kv;
            }
            for (int r = 0; r < nr; ++r)
                store_scores(scores + r * S + at + i0, acc[r], bias_rows ? bias_rows[r] + at + i0 : NULL, &mx[r]);
        }
    }
    if (bias_rows)
        for (int r = 0; r < nr; ++r) row_max[r] = hmax(mx[r]);
}

static void scores_vectorized(const float *qs, int64_t D, const float *k, int64_t k_sblk, int64_t k_shead,
                              int64_t k_sdim, int64_t kh, const int64_t *blocks_b, int64_t num_blocks,
                              int64_t block_size, int64_t span, int64_t S, float *scores,
                              const float *const *bias_rows, float *row_max, int nr, int prefetch) {
#define SCORES_TILE(n, p) scores_tile(qs, D, k, k_sblk, k_shead, k_sdim, kh, blocks_b, num_blocks, block_size, \
                                      span, S, scores, bias_rows, row_max, n, p)
#define SCORES_TILES(p)                   \
    switch (nr) { /* tile_rows' values */ \
    case 4: SCORES_TILE(4, p); break;     \
    case 8: SCORES_TILE(8, p); break;     \
    SCORES_TILES_WIDE(p)                  \
    }
#if ROWS >= 16
#define SCORES_TILES_WIDE(p)           \
    case 12: SCORES_TILE(12, p); break; \
    case 16: SCORES_TILE(16, p); break;
#else
#define SCORES_TILES_WIDE(p)
#endif
    if (prefetch)
        SCORES_TILES(1)
    else
        SCORES_TILES(0)
#undef SCORES_TILES_WIDE
#undef SCORES_TILES
#undef SCORES_TILE
}

/* The same for any strides (scalar). */
static void scores_generic(const float *qs, int64_t D, const float *k, int64_t k_sblk, int64_t k_stok,
                           int64_t k_shead, int64_t k_sdim, int64_t kh, const int64_t *blocks_b,
                           int64_t num_blocks, int64_t block_size, int64_t span, int64_t S, float *scores, int nr) {
    for (int64_t s = 0; s < span; ++s) {
        const int64_t blk = blocks_b[s / block_size];
        if (blk < 0 || blk >= num_blocks) {
            for (int r = 0; r < nr; ++r) scores[r * S + s] = -INFINITY;
            continue;
        }
        const float *ks = k + blk * k_sblk + (s % block_size) * k_stok + kh * k_shead;
        for (int r = 0; r < nr; ++r) {
            float dot = 0.0f;
            for (int64_t d = 0; d < D; ++d) dot = fmaf(qs[r * D + d], ks[d * k_sdim], dot);
            scores[r * S + s] = dot;
        }
    }
}

/* scores -> unnormalized probabilities in place over [0, padded); returns 1 / sum.
 * A masked position is -inf whatever its slot held (NaN included), so exp gives 0.
 * sink (NULL: none): one more logit, in the max and the sum only. */
static float softmax_biased_row(float *sc, int64_t padded, const float *sink, float row_max);

static float softmax_row(float *sc, const float *bi, int64_t padded, const float *sink) {
    vec m = splat(-INFINITY);
    for (int64_t s = 0; s < padded; s += LANES) store_scores(sc + s, load(sc + s), bi + s, &m);
    return softmax_biased_row(sc, padded, sink, hmax(m));
}

/* softmax_row's second pass, on scores the bias is in (store_scores), row_max their max. */
static float softmax_biased_row(float *sc, int64_t padded, const float *sink, float row_max) {
    if (sink && *sink > row_max) row_max = *sink;
    vec sum = {0};
    for (int64_t s = 0; s < padded; s += LANES) {
        const vec e = exp_nonpositive(load(sc + s) - row_max);
        store(sc + s, e);
        sum += e;
    }
    float total = hsum(sum);
    if (sink) total += expf(*sink - row_max);
    return 1.0f / total;
}

static float softmax_row_generic(float *sc, const float *bi, int64_t span, const float *sink) {
    float m = -INFINITY, sum = 0.0f;
    for (int64_t s = 0; s < span; ++s) {
        sc[s] = bi[s] == -INFINITY ? -INFINITY : sc[s] + bi[s];
        m = sc[s] > m ? sc[s] : m;
    }
    if (sink && *sink > m) m = *sink;
    for (int64_t s = 0; s < span; ++s) {
        sc[s] = sc[s] == -INFINITY ? 0.0f : expf(sc[s] - m);
        sum += sc[s];
    }
    if (sink) sum += expf(*sink - m);
    return 1.0f / sum;
}

/* Dense K/V rows after the paged positions (the tree drafter's branch entries):
 * entry e of a request at base + e * stride, head kh at + kh * head_stride, D contiguous;
 * their probabilities sit at probs[r * S + offset + e]. count 0: none. */
struct extra_kv {
    const float *base;
    int64_t count, stride, head_stride, offset;
};

/* out rows = (probs . V) * inv for PV_ROWS rows, NV * LANES dims from d0; V row-major (v_sdim == 1). */
static inline __attribute__((always_inline)) void values_vectorized(
    const float *probs, int64_t S, const float *inv, const float *v, int64_t v_sblk, int64_t v_stok,
    int64_t v_shead, int64_t kh, const int64_t *blocks_b, int64_t num_blocks, int64_t block_size, int64_t span,
    struct extra_kv extra, int64_t d0, const int nv, float *const *out_rows) {
    vec acc[PV_ROWS][4] = {{{0}}};
    for (int64_t j = 0; j * block_size < span; ++j) {
        const int64_t blk = blocks_b[j];
        if (blk < 0 || blk >= num_blocks) continue;
        const float *vb = v + blk * v_sblk + kh * v_shead + d0;
        const int64_t end = span - j * block_size < block_size ? span - j * block_size : block_size;
        for (int64_t i = 0; i < end; ++i) {
            const float *vi = vb + i * v_stok;
            vec vv[4];
            for (int c = 0; c < nv; ++c) vv[c] = load(vi + c * LANES);
            for (int r = 0; r < PV_ROWS; ++r) {
                const float p = probs[r * S + j * block_size + i];
                if (p == 0.0f) continue;  /* masked: never 0 * whatever the slot holds */
                for (int c = 0; c < nv; ++c) acc[r][c] += p * vv[c];
            }
        }
    }
    for (int64_t e = 0; e < extra.count; ++e) {
        const float *ve = extra.base + e * extra.stride + kh * extra.head_stride + d0;
        for (int r = 0; r < PV_ROWS; ++r) {
            const float p = probs[r * S + extra.offset + e];
            if (p == 0.0f) continue;
            for (int c = 0; c < nv; ++c) acc[r][c] += p * load(ve + c * LANES);
        }
    }
    for (int r = 0; r < PV_ROWS; ++r)
        if (out_rows[r])
            for (int c = 0; c < nv; ++c) store(out_rows[r] + d0 + c * LANES, acc[r][c] * inv[r]);
}

/* values_vectorized over a unit's nr rows and D dims (D % LANES == 0). */
static void values_rows(const float *probs, int64_t S, const float *inv, const float *v, int64_t v_sblk,
                        int64_t v_stok, int64_t v_shead, int64_t kh, const int64_t *blocks_b, int64_t num_blocks,
                        int64_t block_size, int64_t span, struct extra_kv extra, int64_t D, float *const *out_rows,
                        int nr) {
    for (int r0 = 0; r0 < nr; r0 += PV_ROWS)
        for (int64_t d0 = 0; d0 < D; d0 += (D % (4 * LANES) == 0 ? 4 : 1) * LANES) {
            if (D % (4 * LANES) == 0)
                values_vectorized(probs + r0 * S, S, inv + r0, v, v_sblk, v_stok, v_shead, kh, blocks_b, num_blocks,
                                  block_size, span, extra, d0, 4, out_rows + r0);
            else
                values_vectorized(probs + r0 * S, S, inv + r0, v, v_sblk, v_stok, v_shead, kh, blocks_b, num_blocks,
                                  block_size, span, extra, d0, 1, out_rows + r0);
        }
}

static void values_generic(const float *probs, int64_t S, const float *inv, const float *v, int64_t v_sblk,
                           int64_t v_stok, int64_t v_shead, int64_t v_sdim, int64_t kh, const int64_t *blocks_b,
                           int64_t num_blocks, int64_t block_size, int64_t span, int64_t D, float *const *out_rows,
                           int nr) {
    for (int r = 0; r < nr; ++r) {
        if (!out_rows[r]) continue;
        float *o = out_rows[r];
        memset(o, 0, sizeof(float) * D);
        for (int64_t s = 0; s < span; ++s) {
            const float p = probs[r * S + s];
            const int64_t blk = blocks_b[s / block_size];
            if (p == 0.0f || blk < 0 || blk >= num_blocks) continue;
            const float *vs = v + blk * v_sblk + (s % block_size) * v_stok + kh * v_shead;
            for (int64_t d = 0; d < D; ++d) o[d] = fmaf(p, vs[d * v_sdim], o[d]);
        }
        for (int64_t d = 0; d < D; ++d) o[d] *= inv[r];
    }
}

/* One unit's nr query rows, node-major: row m0 + r is node (m0 + r) / group of
 * request b, query head kh * group + (m0 + r) % group. Scaled queries to qs
 * [nr, D] (zero for padding rows past the T * group real ones) and each row's
 * output row (NULL for padding). q and out [B, T, Hq, D] with Hq * D contiguous per
 * token and tokens q_stok / o_stok floats apart (Hq * D: contiguous; more: rows of the
 * engine's fused qkv or output, read and written in place). */
static void load_unit_rows(const float *q, int64_t q_stok, int64_t b, int64_t T, int64_t Hq, int64_t D, int64_t kh,
                           int64_t group, int64_t m0, float scale, float *qs, float *out, int64_t o_stok,
                           float **out_rows, int nr) {
    (void)Hq;
    for (int r = 0; r < nr; ++r) {
        const int64_t m = m0 + r;
        if (m < T * group) {
            const int64_t token = b * T + m / group, head = kh * group + m % group;
            const float *qr = q + token * q_stok + head * D;
            for (int64_t d = 0; d < D; ++d) qs[r * D + d] = scale * qr[d];
            out_rows[r] = out + token * o_stok + head * D;
        } else {
            memset(qs + r * D, 0, sizeof(float) * D);
            out_rows[r] = NULL;
        }
    }
}

/* The call split by lifetime, so the per-layer call passes 4 pointers (cpu_attention.HostLayer /
 * HostStep build these once): a layer's cache and features live as long as the engine, a step's
 * blocks and mask as long as one TreeAttentionPlan. The fields: the file's header. */
struct spec_tree_layer {
    const float *k;
    int64_t k_sblk, k_stok, k_shead, k_sdim;
    const float *v;
    int64_t v_sblk, v_stok, v_shead, v_sdim;
    int64_t num_blocks, Hq, Hkv, block_size, D;
    float scale, soft_cap;
    const float *sinks, *alibi;
};

struct spec_tree_step {
    int64_t B, T, nb;
    const int64_t *blocks;
    const float *bias, *key_pos, *query_pos;
    float *work;      /* spec_tree_attention_workspace(nb, block_size, D) floats, sized for threads */
    int64_t threads;  /* OpenMP threads when work was sized: never more, whatever the pool is now */
    const int64_t *spans;  /* [B, 2] spec_tree_attention_spans of bias, or NULL: found per unit */
};

/* Per request b: spans[b, 0] the first position any of its rows sees, spans[b, 1] the end of what
 * they see (visible_first, visible_span). A plan's bias is fixed: its HostStep finds them once,
 * not every unit of every layer (a scan of up to T * S floats). bias as spec_tree_attention_run's. */
void spec_tree_attention_spans(const float *bias, int64_t B, int64_t T, int64_t S, int64_t *spans) {
    for (int64_t b = 0; b < B; ++b) {
        const float *bias_b = bias + b * T * S;
        spans[2 * b + 1] = visible_span(bias_b, T, S);
        spans[2 * b] = visible_first(bias_b, T, S, spans[2 * b + 1]);
    }
}

void spec_tree_attention_run(const struct spec_tree_layer *layer, const struct spec_tree_step *step,
                             const float *q, int64_t q_stok, float *out, int64_t o_stok) {
    const int64_t B = step->B, T = step->T, nb = step->nb, Hq = layer->Hq, D = layer->D;
    const float *k = layer->k, *v = layer->v;
    const int64_t k_sblk = layer->k_sblk, k_stok = layer->k_stok, k_shead = layer->k_shead, k_sdim = layer->k_sdim;
    const int64_t v_sblk = layer->v_sblk, v_stok = layer->v_stok, v_shead = layer->v_shead, v_sdim = layer->v_sdim;
    const int64_t num_blocks = layer->num_blocks, Hkv = layer->Hkv, block_size = layer->block_size;
    const int64_t *blocks = step->blocks;
    const float *bias = step->bias, *key_pos = step->key_pos, *query_pos = step->query_pos;
    const float scale = layer->scale, soft_cap = layer->soft_cap, *sinks = layer->sinks, *alibi = layer->alibi;
    float *work = step->work;
    const int64_t S = nb * block_size;
    const int64_t group = Hq / Hkv;
    const int64_t rows = T * group;  /* per (request, KV head): row m is node m / group, head kh * group + m % group */
    const int threads = (int)step->threads;
    const int nr = tile_rows(rows, B * Hkv, threads);
    const int64_t tiles = (rows + nr - 1) / nr;
    const int64_t units = B * Hkv * tiles;
    const int64_t per_thread = ROWS * S + ROWS * D;
    const int fast_k = k_stok == 1 && block_size % LANES == 0;
    const int fast_v = v_sdim == 1 && D % LANES == 0;
    const int prefetch = (double)B * Hkv * S * D * sizeof(float) * 2 > (double)PREFETCH_BYTES;  /* the step's K and V */
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t u = 0; u < units; ++u) {
        const int64_t b = u / (Hkv * tiles), kh = (u / tiles) % Hkv, m0 = (u % tiles) * nr;
        float *scores = work + thread_id() * per_thread; /* [nr, S] */
        float *qs = scores + ROWS * S;                    /* [nr, D] scaled queries, zero past the last row */
        float *out_rows[ROWS];
        load_unit_rows(q, q_stok, b, T, Hq, D, kh, group, m0, scale, qs, out, o_stok, out_rows, nr);
        const float *bias_rows[ROWS];
        for (int r = 0; r < nr; ++r)  /* a padding row takes the first node's mask: finite, never written */
            bias_rows[r] = bias + (b * T + (m0 + r < rows ? (m0 + r) / group : 0)) * S;
        const int64_t span = step->spans ? step->spans[2 * b + 1] : visible_span(bias + b * T * S, T, S);
        const int64_t padded = (span + LANES - 1) / LANES * LANES;  /* <= S: fast_k has block_size % LANES == 0 */
        const int vector_rows = fast_k && fast_v;
        if (span == 0) {  /* nothing visible (no real request): zeros, as the torch path's uniform 0 * V */
            for (int r = 0; r < nr; ++r)
                if (out_rows[r]) memset(out_rows[r], 0, sizeof(float) * D);
            continue;
        }
        /* whole blocks before what any row sees (a window) are skipped: 0 without one. A multiple of
         * block_size, so of LANES on the vectorized path: the same lanes hold the same positions */
        const int64_t first = step->spans ? step->spans[2 * b] : visible_first(bias + b * T * S, T, S, span);
        const int64_t start = first / block_size * block_size;
        const int64_t *blocks_b = blocks + b * nb + start / block_size;
        /* the bias fused into the score pass where nothing comes between them (soft-cap and ALiBi do) */
        const int fused = vector_rows && !(soft_cap > 0.0f) && !alibi;
        const float *bias_from[ROWS];
        for (int r = 0; r < nr; ++r) bias_from[r] = bias_rows[r] + start;
        float row_max[ROWS];
        if (vector_rows)
            scores_vectorized(qs, D, k, k_sblk, k_shead, k_sdim, kh, blocks_b, num_blocks, block_size, span - start,
                              S, scores + start, fused ? bias_from : NULL, row_max, nr, prefetch);
        else
            scores_generic(qs, D, k, k_sblk, k_stok, k_shead, k_sdim, kh, blocks_b, num_blocks, block_size,
                           span - start, S, scores + start, nr);
        if (soft_cap > 0.0f) soft_cap_rows(scores, nr, S, start, span, soft_cap);
        const float *row_sink[ROWS];
        for (int r = 0; r < nr; ++r) {
            const int64_t m = m0 + r < rows ? m0 + r : 0, head = kh * group + m % group;
            row_sink[r] = sinks ? sinks + head : NULL;
            if (alibi) {
                const float slope = alibi[head], qp = query_pos[b * T + m / group];
                const float *kp = key_pos + b * S;
                for (int64_t s = start; s < span; ++s) scores[r * S + s] += slope * (kp[s] - qp);
            }
        }
        float inv[ROWS];
        for (int r = 0; r < nr; ++r)
            inv[r] = fused ? softmax_biased_row(scores + r * S + start, padded - start, row_sink[r], row_max[r])
                   : vector_rows ? softmax_row(scores + r * S + start, bias_from[r], padded - start, row_sink[r])
                                 : softmax_row_generic(scores + r * S + start, bias_rows[r] + start, span - start,
                                                       row_sink[r]);
        if (vector_rows) {
            const struct extra_kv none = {0};
            values_rows(scores + start, S, inv, v, v_sblk, v_stok, v_shead, kh, blocks_b, num_blocks, block_size,
                        span - start, none, D, out_rows, nr);
        } else {
            values_generic(scores + start, S, inv, v, v_sblk, v_stok, v_shead, v_sdim, kh, blocks_b, num_blocks,
                           block_size, span - start, D, out_rows, nr);
        }
    }
}

/* ------------------------------------------------------------------ draft steps
 *
 * One tree-drafting step of the head (spec_plugins.vllm_ext.attention.BranchAttention):
 * frontier node j of request r attends to the request's committed head KV
 * (paged, positions [0, kv_lens[r])) and to the branch entries e < filled it
 * descends from, itself included (visible[r, j, e]), which live in a dense
 * scratch instead of the paged cache.
 *
 *   q        [R, K, Hq, D] contiguous float32 (K frontier nodes per request)
 *   k, v     the head layer's paged views, vectorized layout only (k_stok == 1,
 *            v_sdim == 1, block_size % LANES == 0, D % LANES == 0: the caller
 *            checks, torch serves the rest)
 *   blocks   [R, nb] int64; kv_lens [R] int64, each <= nb * block_size
 *   bk, bv   [R, E, Hkv, D] contiguous float32 branch scratch, entries < filled written
 *   visible  [R, K, filled] uint8 (bool)
 *   out      [R, K, Hq, D] contiguous float32
 *   work     spec_branch_attention_workspace(nb, block_size, E, D) floats
 *   window   > 0: a sliding window W on the draft step's positions (committed
 *            j at j, entry e at kv_len + e / K, the level L = filled / K's
 *            queries at kv_len + L - 1): the context from max(0, kv_len + L -
 *            W) (whole blocks before it not read), entries from (L - W) * K;
 *            0: none. soft_cap, sinks, alibi as spec_tree_attention_run's
 *            (ALiBi on those positions).
 */

int64_t spec_branch_attention_workspace(int64_t nb, int64_t block_size, int64_t E, int64_t D) {
    const int64_t row = nb * block_size + (E + LANES - 1) / LANES * LANES;
    return (int64_t)max_threads() * (2 * ROWS * row + ROWS * D);
}

void spec_branch_attention_f32(const float *q, int64_t R, int64_t K, int64_t Hq, int64_t D,
                               const float *k, int64_t k_sblk, int64_t k_shead, int64_t k_sdim,
                               const float *v, int64_t v_sblk, int64_t v_stok, int64_t v_shead,
                               int64_t num_blocks, int64_t Hkv, int64_t block_size, const int64_t *blocks, int64_t nb,
                               const int64_t *kv_lens, const float *bk, const float *bv, int64_t E, int64_t filled,
                               const uint8_t *visible, float scale, float *out, float *work, int64_t window,
                               float soft_cap, const float *sinks, const float *alibi) {
    const int64_t group = Hq / Hkv;
    const int64_t rows = K * group;
    const int nr = tile_rows(rows, R * Hkv, max_threads());
    const int64_t tiles = (rows + nr - 1) / nr;
    const int64_t units = R * Hkv * tiles;
    const int64_t S = nb * block_size + (E + LANES - 1) / LANES * LANES;  /* a score row: context, then branch */
    const int64_t per_thread = 2 * ROWS * S + ROWS * D;
    const vec neg_inf = splat(-INFINITY);
    const int prefetch = (double)R * Hkv * nb * block_size * D * sizeof(float) * 2 > (double)PREFETCH_BYTES;
#pragma omp parallel for schedule(static)
    for (int64_t u = 0; u < units; ++u) {
        const int64_t b = u / (Hkv * tiles), kh = (u / tiles) % Hkv, m0 = (u % tiles) * nr;
        float *scores = work + thread_id() * per_thread; /* [nr, S] */
        float *bias = scores + ROWS * S;                  /* [nr, S] 0 / -inf */
        float *qs = bias + ROWS * S;                      /* [nr, D] */
        float *out_rows[ROWS];
        load_unit_rows(q, Hq * D, b, K, Hq, D, kh, group, m0, scale, qs, out, Hq * D, out_rows, nr);
        const int64_t ctx = kv_lens[b];
        const int64_t ctx_pad = (ctx + LANES - 1) / LANES * LANES;
        const int64_t total = ctx_pad + (filled + LANES - 1) / LANES * LANES;
        const int64_t level = filled / K;
        int64_t lo = 0, e_lo = 0;  /* the window: first context position and first entry seen */
        if (window > 0) {
            lo = ctx + level - window;
            lo = lo < 0 ? 0 : lo > ctx ? ctx : lo;
            e_lo = (level - window) * K;
        }
        const int64_t start = lo / block_size * block_size;  /* 0 without a window; a multiple of LANES */
        const int64_t *blocks_b = blocks + b * nb + start / block_size;
        scores_vectorized(qs, D, k, k_sblk, k_shead, k_sdim, kh, blocks_b, num_blocks, block_size, ctx - start, S,
                          scores + start, NULL, NULL, nr, prefetch);
        const float *bk_b = bk + b * E * Hkv * D + kh * D;
        const float *row_sink[ROWS];
        for (int r = 0; r < nr; ++r) {
            const int64_t m = m0 + r < rows ? m0 + r : 0, node = m / group, head = kh * group + m % group;
            const uint8_t *vis = visible + (b * K + node) * filled;
            float *bi = bias + r * S;
            for (int64_t s = 0; s < ctx_pad; s += LANES) store(bi + s, neg_inf);
            memset(bi, 0, sizeof(float) * ctx);
            for (int64_t s = 0; s < lo; ++s) bi[s] = -INFINITY;
            for (int64_t s = ctx_pad; s < total; s += LANES) store(bi + s, neg_inf);
            for (int64_t e = 0; e < filled; ++e) {
                if (vis[e] && e >= e_lo) bi[ctx_pad + e] = 0.0f;
                vec dot = {0};
                for (int64_t d = 0; d < D; d += LANES)
                    dot += load(qs + r * D + d) * load(bk_b + e * Hkv * D + d);
                scores[r * S + ctx_pad + e] = hsum(dot);
            }
            row_sink[r] = sinks ? sinks + head : NULL;
            float *sc = scores + r * S;
            if (soft_cap > 0.0f) {
                soft_cap_rows(sc, 1, S, start, ctx, soft_cap);
                soft_cap_rows(sc + ctx_pad, 1, S, 0, filled, soft_cap);
            }
            if (alibi) {  /* key position - query position: j - (ctx + level - 1), e / K - (level - 1) */
                const float slope = alibi[head];
                for (int64_t s = start; s < ctx; ++s) sc[s] += slope * (float)(s - (ctx + level - 1));
                for (int64_t e = 0; e < filled; ++e) sc[ctx_pad + e] += slope * (float)(e / K - (level - 1));
            }
        }
        float inv[ROWS];
        for (int r = 0; r < nr; ++r)
            inv[r] = softmax_row(scores + r * S + start, bias + r * S + start, total - start, row_sink[r]);
        const struct extra_kv branch = {bv + b * E * Hkv * D, filled, Hkv * D, D, ctx_pad - start};
        values_rows(scores + start, S, inv, v, v_sblk, v_stok, v_shead, kh, blocks_b, num_blocks, block_size,
                    ctx - start, branch, D, out_rows, nr);
    }
}
