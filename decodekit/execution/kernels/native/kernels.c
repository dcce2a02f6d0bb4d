/* decodekit's native CPU kernels: the small float32 operations of a decoder layer, one call each.
 *
 * At batch 1 a SmolLM2 step spends ~13 ms outside its matrix products, most of it in the dispatch of ~25 small
 * torch ops per layer (RMSNorm alone is six), not in arithmetic: the data is a few KB. These kernels do that work
 * in four calls per layer (two RMSNorms, RoPE + KV write + attention, SiLU-gating). The float32 products of
 * several rows stay with torch's BLAS / oneDNN; single rows (dk_gemv) and the bf16 and int8 products are here.
 *
 * Built at first use by decodekit/execution/kernels/native.py with the system C compiler (-O3 -march=native
 * -ffp-contract=off) and loaded through ctypes: no Python or torch headers, so a compile takes well under a
 * second. -ffp-contract=off keeps `a*b + c*d` as two roundings, so RoPE is bit-identical to transformers'; the
 * reductions (RMSNorm's mean, attention's dots and softmax) are summed in another order than torch's and may
 * differ in the last bits, as the BLAS products already do between batch sizes.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if (defined(__AVX2__) && defined(__FMA__)) || defined(__AVX512F__)
#include <immintrin.h>
#endif

/* layers.c: a step's keys and values prefetched by the threads of the product before its attention (a hint). */
void dk_side_prefetch(int64_t part, int64_t parts, int64_t unit, int64_t units);
void dk_side_prefetch_share(int64_t part, int64_t parts, int64_t i, int64_t count);
/* Output rows of a float32 product between two such prefetches. */
#define GEMV_SIDE_ROWS 16

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8f load8(const float* p) { v8f v; memcpy(&v, p, sizeof v); return v; }
static inline void store8(float* p, v8f v) { memcpy(p, &v, sizeof v); }
static inline v8f splat8(float x) { v8f v = {x, x, x, x, x, x, x, x}; return v; }

/* bfloat16 is the top half of a float32: widening it is a shift, exact. */
static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* exp8: exp of 8 floats at once (Cephes' expf: x = n ln2 + r, a degree-6 polynomial in r, times 2^n), within 2 ulp
 * of expf; inputs below -87.3 give 0. Attention's softmax calls it once per (head, key): libm's scalar expf there
 * cost as much as the dot products. DK_DEFINE_EXP defines it (`static V NAME(V x)`) for a vector type V of floats,
 * VI its int32 twin and SPLAT its broadcast: every lane goes through the same operations, so a wider vector gives
 * each lane exp8's bits. */
#define DK_DEFINE_EXP(NAME, V, VI, SPLAT)                                                                       \
    static inline V NAME(V x) {                                                                                 \
        const V lowest = SPLAT(-87.3365447f);                                                                   \
        VI under = x < lowest;                                                                                  \
        x = (V)(((VI)x & ~under) | ((VI)lowest & under));                                                       \
        V fx = x * SPLAT(1.44269504088896341f) + SPLAT(0.5f);                                                   \
        VI n = __builtin_convertvector(fx, VI); /* truncates; floor() for the negative values below */          \
        V fn = __builtin_convertvector(n, V);                                                                   \
        VI above = fn > fx;                                                                                     \
        n += above; /* -1 where truncation rounded up */                                                        \
        fn += __builtin_convertvector(above, V);                                                                \
        x = x - fn * SPLAT(0.693359375f);                                                                       \
        x = x - fn * SPLAT(-2.12194440e-4f);                                                                    \
        V y = SPLAT(1.9875691500e-4f);                                                                          \
        y = y * x + SPLAT(1.3981999507e-3f);                                                                    \
        y = y * x + SPLAT(8.3334519073e-3f);                                                                    \
        y = y * x + SPLAT(4.1665795894e-2f);                                                                    \
        y = y * x + SPLAT(1.6666665459e-1f);                                                                    \
        y = y * x + SPLAT(5.0000001201e-1f);                                                                    \
        y = y * (x * x) + x + SPLAT(1.0f);                                                                      \
        V scale = (V)((n + 127) << 23);                                                                         \
        return (V)((VI)(y * scale) & ~under);                                                                   \
    }
DK_DEFINE_EXP(exp8, v8f, v8i, splat8)

#if defined(__AVX512F__)
/* 16 lanes where the CPU has AVX-512: exp8's values at half the instructions (softmax and SiLU-gating take it for
 * each whole 16 floats, then exp8, then expf as before, so each value is what it was). */
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
static inline v16f load16(const float* p) { v16f v; memcpy(&v, p, sizeof v); return v; }
static inline void store16(float* p, v16f v) { memcpy(p, &v, sizeof v); }
static inline v16f splat16(float x) { v16f v = {x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; return v; }
DK_DEFINE_EXP(exp16, v16f, v16i, splat16)
#endif

/* ---- the KV pool's element: float32, or bfloat16 (`kv_cache_dtype`) ------------------------------------------
 * Attention reads every cached key and value once per query, so a bf16 pool halves those bytes and doubles the
 * tokens a memory budget holds. The arithmetic stays float32: a bf16 element is widened (exact, a shift) as it is
 * loaded. The functions below take the pool as `const void*` and a flag that is a constant where they are inlined
 * (dk_rope_cache_attend's two calls of attend_items), so each is compiled twice, once per element, with no branch
 * per load. */
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint32_t v8u __attribute__((vector_size(32)));

#define KV_INLINE static inline __attribute__((always_inline))

KV_INLINE v8f load8_kv(const void* base, int64_t i, int bf16) {
    if (!bf16) return load8((const float*)base + i);
    v8h h;
    memcpy(&h, (const uint16_t*)base + i, sizeof h);
    return (v8f)(__builtin_convertvector(h, v8u) << 16);
}

KV_INLINE float load_kv(const void* base, int64_t i, int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t*)base)[i]) : ((const float*)base)[i];
}

/* float32 to bfloat16, rounding to nearest even as torch's `.to(torch.bfloat16)` does, so the native KV write
 * stores the same bits as the torch path's; a NaN stays a NaN (0x7FC0, c10's scalar rule; torch's vectorized
 * conversion gives other payload bits). */
static inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if (f != f) return 0x7FC0;
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

/* Dot product of a float vector with a pool row: four independent 8-lane accumulators (one chain would wait on the
 * adder's latency), then a fixed pairwise reduction. */
KV_INLINE float dot_kv(const float* a, const void* b, int64_t n, int bf16) {
    v8f acc0 = {0}, acc1 = {0}, acc2 = {0}, acc3 = {0};
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        acc0 += load8(a + i) * load8_kv(b, i, bf16);
        acc1 += load8(a + i + 8) * load8_kv(b, i + 8, bf16);
        acc2 += load8(a + i + 16) * load8_kv(b, i + 16, bf16);
        acc3 += load8(a + i + 24) * load8_kv(b, i + 24, bf16);
    }
    for (; i + 8 <= n; i += 8) acc0 += load8(a + i) * load8_kv(b, i, bf16);
    v8f acc = (acc0 + acc1) + (acc2 + acc3);
    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; i < n; ++i) s += a[i] * load_kv(b, i, bf16);
    return s;
}

/* o[0:dim] = sum_j p[j] * pool[base + rows[j]][0:dim]: the probability-weighted sum of n value rows. Each 64-float
 * slice of the output is kept in eight registers across all rows, instead of being stored and reloaded per row. */
KV_INLINE void weighted_rows_kv(float* o, const float* p, const void* pool, int64_t base, const int64_t* rows,
                                int64_t n, int64_t dim, int bf16) {
    int64_t d0 = 0;
    for (; d0 + 64 <= dim; d0 += 64) {
        v8f acc[8] = {{0}};
        for (int64_t j = 0; j < n; ++j) {
            int64_t v = base + rows[j] + d0;
            v8f pj = {p[j], p[j], p[j], p[j], p[j], p[j], p[j], p[j]};
            for (int k = 0; k < 8; ++k) acc[k] += pj * load8_kv(pool, v + 8 * k, bf16);
        }
        for (int k = 0; k < 8; ++k) store8(o + d0 + 8 * k, acc[k]);
    }
    for (; d0 < dim; ++d0) {
        float acc = 0;
        for (int64_t j = 0; j < n; ++j) acc += p[j] * load_kv(pool, base + rows[j] + d0, bf16);
        o[d0] = acc;
    }
}

/* transformers' LlamaRMSNorm in float32: out = w * (x * 1/sqrt(mean(x^2) + eps)), row by row.
 * The mean is accumulated in double (torch sums float32 pairwise; both are within an ulp of the exact mean). */
void dk_rms_norm(const float* x, const float* w, float* out, int64_t rows, int64_t dim, float eps) {
    for (int64_t r = 0; r < rows; ++r) {
        const float* xr = x + r * dim;
        float* o = out + r * dim;
        double acc0 = 0, acc1 = 0, acc2 = 0, acc3 = 0;
        int64_t i = 0;
        for (; i + 4 <= dim; i += 4) {
            acc0 += (double)xr[i] * xr[i];
            acc1 += (double)xr[i + 1] * xr[i + 1];
            acc2 += (double)xr[i + 2] * xr[i + 2];
            acc3 += (double)xr[i + 3] * xr[i + 3];
        }
        for (; i < dim; ++i) acc0 += (double)xr[i] * xr[i];
        float variance = (float)(((acc0 + acc1) + (acc2 + acc3)) / (double)dim);
        float inv = 1.0f / sqrtf(variance + eps);
        for (i = 0; i < dim; ++i) o[i] = w[i] * (xr[i] * inv);
    }
}

/* Columns [begin, end) of one row of dk_silu_mul: 8 at a time below the row's last multiple of 8 (`begin` a multiple
 * of 8), one at a time past it, so each column's value does not depend on the range it is computed in. */
static inline void silu_mul_row(const float* g, float* o, int64_t inter, int64_t begin, int64_t end) {
    const float* u = g + inter;
    int64_t vectors = inter / 8 * 8, stop = end < vectors ? end : vectors;
    int64_t i = begin;
#if defined(__AVX512F__)
    for (; i + 16 <= stop; i += 16) {  /* exp16: exp8's values, 16 at a time */
        v16f gi = load16(g + i), neg = -gi;
        neg = (v16f)(((v16i)neg & (v16i)(neg < splat16(88.0f))) | ((v16i)splat16(88.0f) & ~(v16i)(neg < splat16(88.0f))));
        store16(o + i, (gi / (splat16(1.0f) + exp16(neg))) * load16(u + i));
    }
#endif
    for (; i + 8 <= stop; i += 8) {
        v8f gi = load8(g + i), neg = -gi;
        neg = (v8f)(((v8i)neg & (v8i)(neg < splat8(88.0f))) | ((v8i)splat8(88.0f) & ~(v8i)(neg < splat8(88.0f))));
        store8(o + i, (gi / (splat8(1.0f) + exp8(neg))) * load8(u + i));
    }
    for (; i < end; ++i) o[i] = (g[i] / (1.0f + expf(-g[i]))) * u[i];
}

/* out[r, i] = silu(gate_up[r, i]) * gate_up[r, inter + i]: the SiLU-gated MLP's activation, 8 at a time with exp8
 * (within 2 ulp of expf; -g is capped at 88, past which g / (1 + e^-g) is 0 to float32 anyway, so exp8 never
 * overflows). Rows are split over torch's threads from 64K elements (a prefill chunk's gating). */
void dk_silu_mul(const float* gate_up, float* out, int64_t rows, int64_t inter) {
#ifdef _OPENMP
#pragma omp parallel for if (rows > 1 && rows * inter >= 65536)
#endif
    for (int64_t r = 0; r < rows; ++r) silu_mul_row(gate_up + r * 2 * inter, out + r * inter, inter, 0, inter);
}

/* dk_silu_mul of columns [begin, end) of each row only (`begin` a multiple of 8, `end` too or `inter`), on the calling
 * thread, with the same values: what a gate/up product that gates its own share of the rows calls
 * (`dk_quant_gated`). */
void dk_silu_mul_range(const float* gate_up, float* out, int64_t rows, int64_t inter, int64_t begin, int64_t end) {
    for (int64_t r = 0; r < rows; ++r) silu_mul_row(gate_up + r * 2 * inter, out + r * inter, inter, begin, end);
}

/* ---- the bf16 activations of a step on bf16 products ---------------------------------------------------------
 * A step whose products run on oneDNN's bf16 GEMM (`Bf16Matrix` with `bf16_gemm`) rounds each product's input to
 * bf16 and widens its bf16 output. These do that rounding and widening inside the norm, the gating and the residual
 * add, instead of as separate conversions (about eight torch ops a layer): the values are the same, bit for bit. */

/* dk_rms_norm, its output rounded to bf16. Returns 0, or -1 if scratch memory could not be allocated. */
int dk_rms_norm_bf16(const float* x, const float* w, uint16_t* out, int64_t rows, int64_t dim, float eps) {
    float* row = malloc((size_t)dim * sizeof(float));
    if (row == NULL) return -1;
    for (int64_t r = 0; r < rows; ++r) {
        dk_rms_norm(x + r * dim, w, row, 1, dim, eps);
        for (int64_t i = 0; i < dim; ++i) out[r * dim + i] = float_to_bf16(row[i]);
    }
    free(row);
    return 0;
}

/* dk_silu_mul of bf16 rows [rows, 2 * inter] (a bf16 product's output, widened exactly), its output rounded to
 * bf16 (the next product's input): each row widened, gated by dk_silu_mul, rounded. Returns 0, or -1 if scratch
 * memory could not be allocated. */
int dk_silu_mul_bf16(const uint16_t* gate_up, uint16_t* out, int64_t rows, int64_t inter) {
    int failed = 0;
#ifdef _OPENMP
#pragma omp parallel if (rows > 1 && rows * inter >= 65536) reduction(|| : failed)
#endif
    {
        float* wide = malloc((size_t)(3 * inter) * sizeof(float));
        failed = wide == NULL;
#ifdef _OPENMP
#pragma omp for
#endif
        for (int64_t r = 0; r < rows; ++r) {
            if (wide == NULL) continue;
            for (int64_t i = 0; i < 2 * inter; ++i) wide[i] = bf16_to_float(gate_up[r * 2 * inter + i]);
            dk_silu_mul(wide, wide + 2 * inter, 1, inter);
            for (int64_t i = 0; i < inter; ++i) out[r * inter + i] = float_to_bf16(wide[2 * inter + i]);
        }
        free(wide);
    }
    return failed ? -1 : 0;
}

/* out = (float(src) + bias) + residual, rows x cols, for a bf16 product's output (bias and residual optional). */
void dk_widen_add(const uint16_t* src, const float* bias, const float* residual, float* out, int64_t rows,
                  int64_t cols) {
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t i = 0; i < cols; ++i) {
            float v = bf16_to_float(src[r * cols + i]);
            if (bias != NULL) v += bias[i];
            if (residual != NULL) v += residual[r * cols + i];
            out[r * cols + i] = v;
        }
}

/* RoPE in place on one head: x = x*cos + roll(x, D/2)*signed_sin (see fused_decoder._rotate). */
static void rotate(float* x, const float* cos, const float* signed_sin, int64_t dim, float* tmp) {
    int64_t half = dim / 2;
    memcpy(tmp, x, (size_t)dim * sizeof(float));
    for (int64_t i = 0; i < dim; ++i) {
        float rolled = tmp[i < half ? i + half : i - half];
        float a = tmp[i] * cos[i];
        float b = rolled * signed_sin[i];
        x[i] = a + b;
    }
}

/* `n` floats stored at element `at` of a pool of float32 or (rounded) bfloat16 elements. */
static void store_kv(void* pool, int64_t at, const float* src, int64_t n, int bf16) {
    if (!bf16) {
        memcpy((float*)pool + at, src, (size_t)n * sizeof(float));
        return;
    }
    uint16_t* dst = (uint16_t*)pool + at;
    for (int64_t i = 0; i < n; ++i) dst[i] = float_to_bf16(src[i]);
}

/* One decoder layer's RoPE and KV write for the tokens of a step (the first half of attention):
 *   1. RoPE on every query and key head of `qkv` ([T, (H + 2*KVH) * D], rotated in place), all T tokens;
 *   2. every token's key and value written to its pool slot (`kpool`/`vpool` are the layer's [slots, KVH, D] of
 *      float32, or of bfloat16 with `kv_bf16`).
 * Returns 0, or -1 if scratch memory could not be allocated. */
static int rope_store(float* qkv, int64_t tokens, int64_t heads, int64_t kv_heads, int64_t dim, const float* cos,
                      const float* signed_sin, void* kpool, void* vpool, const int64_t* slots, int kv_bf16) {
    int64_t width = (heads + 2 * kv_heads) * dim;
    float* tmp = malloc((size_t)dim * sizeof(float));
    if (tmp == NULL) return -1;
    for (int64_t t = 0; t < tokens; ++t) {
        float* row = qkv + t * width;
        for (int64_t h = 0; h < heads + kv_heads; ++h) rotate(row + h * dim, cos + t * dim, signed_sin + t * dim, dim, tmp);
        store_kv(kpool, slots[t] * kv_heads * dim, row + heads * dim, kv_heads * dim, kv_bf16);
        store_kv(vpool, slots[t] * kv_heads * dim, row + (heads + kv_heads) * dim, kv_heads * dim, kv_bf16);
    }
    free(tmp);
    return 0;
}

/* softmax of n scores in place: the largest subtracted, exp8 8 at a time, the sum's pairwise order fixed (both
 * attention paths share it). */
static void softmax_in_place(float* sc, int64_t n) {
    /* the largest score as `m = sc[j] > m ? sc[j] : m` from sc[0] finds it (NaNs skipped unless sc[0] is one), 8
     * lanes at a time, not in one scalar chain of compares (softmax was ~20% of a lone token's attention) */
    v8f best = splat8(sc[0]);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        v8f x = load8(sc + j);
        v8i more = x > best;
        best = (v8f)(((v8i)x & more) | ((v8i)best & ~more));
    }
    float m = best[0];
    for (int k = 1; k < 8; ++k) m = best[k] > m ? best[k] : m;
    for (; j < n; ++j) m = sc[j] > m ? sc[j] : m;
    v8f sums = {0};
    j = 0;
#if defined(__AVX512F__)
    for (; j + 16 <= n; j += 16) {  /* exp16, its halves summed in exp8's order */
        v16f e = exp16(load16(sc + j) - splat16(m));
        store16(sc + j, e);
        sums += __builtin_shufflevector(e, e, 0, 1, 2, 3, 4, 5, 6, 7);
        sums += __builtin_shufflevector(e, e, 8, 9, 10, 11, 12, 13, 14, 15);
    }
#endif
    for (; j + 8 <= n; j += 8) {
        v8f e = exp8(load8(sc + j) - splat8(m));
        store8(sc + j, e);
        sums += e;
    }
    float sum = ((sums[0] + sums[4]) + (sums[1] + sums[5])) + ((sums[2] + sums[6]) + (sums[3] + sums[7]));
    for (; j < n; ++j) { sc[j] = expf(sc[j] - m); sum += sc[j]; }
    float inv = 1.0f / sum;
    for (j = 0; j < n; ++j) sc[j] *= inv;
}

/* Attention for the work items [item_begin, item_end), item = t * KVH + g being query token t's `group` query
 * heads that share kv head g. Each query t with key_len[t] > 0 attends the first key_len[t] keys of its sequence
 * (with a `window` > 0, only the last `window` of them: transformers' sliding window), whose blocks are
 * tables[table_start[t] ...]; the result goes to out [T, H, D]. Tokens with key_len 0 (long
 * prefill chunks, which the caller attends with a blocked SDPA) are left untouched in `out`. Items are independent
 * (each writes its own slice of `out`; the keys were all written before), so disjoint ranges may run on several
 * threads at once with results identical to one pass. Returns 0, or -1 if scratch memory could not be allocated. */
KV_INLINE int attend_items(const float* qkv, int64_t item_begin, int64_t item_end, int64_t heads, int64_t kv_heads,
                          int64_t dim, const void* kpool, const void* vpool, const int64_t* tables,
                          const int64_t* table_start, const int64_t* key_len, int64_t block_size, float scale,
                          int64_t window, float softcap, float* out, int kv_bf16) {
    if (item_begin >= item_end) return 0;
    int64_t width = (heads + 2 * kv_heads) * dim;
    int64_t group = heads / kv_heads;
    int64_t max_keys = 1;
    for (int64_t it = item_begin; it < item_end; ++it) {
        int64_t n = key_len[it / kv_heads];
        max_keys = n > max_keys ? n : max_keys;
    }
    float* scores = malloc((size_t)(group * max_keys) * sizeof(float));
    int64_t* rows = malloc((size_t)max_keys * sizeof(int64_t));
    if (scores == NULL || rows == NULL) { free(scores); free(rows); return -1; }

    int64_t rows_of = -1;  /* the token whose key offsets `rows` holds */
    for (int64_t it = item_begin; it < item_end; ++it) {
        int64_t t = it / kv_heads, g = it % kv_heads;
        int64_t n = key_len[t];
        if (n == 0) continue;
        if (rows_of != t) {
            /* the pool offset (in elements, kv head 0) of each key, walked block by block: no division per key */
            const int64_t* table = tables + table_start[t];
            for (int64_t j = 0, b = 0; j < n; ++b)
                for (int64_t i = 0; i < block_size && j < n; ++i, ++j) rows[j] = (table[b] * block_size + i) * kv_heads * dim;
            rows_of = t;
        }
        const float* qg = qkv + t * width + g * group * dim;
        /* the keys this query sees: all n, or the last `window` of them */
        const int64_t* seen = rows;
        if (window > 0 && n > window) {
            seen = rows + (n - window);
            n = window;
        }
        /* scores[h][j] = scale * q_h . k_j for the `group` query heads sharing kv head g */
        for (int64_t j = 0; j < n; ++j) {
            int64_t k = seen[j] + g * dim;
            for (int64_t h = 0; h < group; ++h) {
                const void* key = kv_bf16 ? (const void*)((const uint16_t*)kpool + k) : (const void*)((const float*)kpool + k);
                scores[h * n + j] = dot_kv(qg + h * dim, key, dim, kv_bf16) * scale;
            }
        }
        /* Gemma 2's soft-capped scores, as transformers computes them: cap * tanh(score / cap) */
        if (softcap > 0)
            for (int64_t j = 0; j < group * n; ++j) scores[j] = tanhf(scores[j] / softcap) * softcap;
        for (int64_t h = 0; h < group; ++h) {
            float* sc = scores + h * n;
            softmax_in_place(sc, n);
            weighted_rows_kv(out + (t * heads + g * group + h) * dim, sc, vpool, g * dim, seen, n, dim, kv_bf16);
        }
    }
    free(scores);
    free(rows);
    return 0;
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
/* ---- attention in tiles of keys, on AVX-512 (16 keys) or AVX2 + FMA (8) -------------------------------------
 * attend_items' work for a head size that is a multiple of the vector width (TILE floats), shaped for the memory
 * and the vector unit:
 *   - keys are taken TILE at a time, a token's whole rows (every kv head) at once: a tile's rows within one block
 *     are one contiguous run of memory, read once (the key-by-key path reads each kv head's slice of a row in its own
 *     pass, and at 1,024 keys of context read 5 GB/s where this reads 15-20 on AVX-512), the next tile's rows
 *     prefetched into L1 and the next unit's into L2 (see `next_unit`);
 *   - each query head of the group multiplies the tile from L1, TILE key dot products at once: the products are
 *     accumulated as vectors (fused multiply-add), one independent sum per key, and the TILE horizontal sums done
 *     together by one shuffle tree (`tv_sums`), instead of one horizontal sum per key and head;
 *   - the values likewise: a tile's value rows are read once and each head's output accumulates them with its
 *     probabilities, four TILE-float chunks and even and odd keys apart (eight independent multiply-add chains:
 *     one chain per chunk waited on its previous key, 1.2x slower at 1,024 keys).
 * The softmax is attend_items' (same exp, same order). The sums are ordered differently from the key-by-key path
 * (and fused), so the two agree to float32 rounding, not bit for bit; within this path the result is the same
 * on any number of threads (each item is computed whole by one). Which width a library has is fixed when it is
 * compiled for its CPU (-march=native): `dk_tiled_attention` says. */
#if defined(__AVX512F__)
#define TILE 16
typedef __m512 tvec;
#define tv_zero() _mm512_setzero_ps()
#define tv_load(p) _mm512_loadu_ps(p)
#define tv_store(p, v) _mm512_storeu_ps(p, v)
#define tv_set1(x) _mm512_set1_ps(x)
#define tv_fma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define tv_add(a, b) _mm512_add_ps(a, b)
#define tv_mul(a, b) _mm512_mul_ps(a, b)

/* 16 floats of a pool row, float32 or bf16 (widened: a shift). */
KV_INLINE tvec tv_load_kv(const void* base, int64_t i, int bf16) {
    if (!bf16) return _mm512_loadu_ps((const float*)base + i);
    __m256i h = _mm256_loadu_si256((const __m256i*)((const uint16_t*)base + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* The 16 horizontal sums of v[0..15] as one vector: lane 4i + m holds the sum of v[i + 4m] (so a caller that
 * wants key k's sum in lane k keeps key k's vector at index `TILE_SLOT(k)` = k / 4 + 4 * (k % 4)). Four levels of
 * pairwise shuffles and adds: 15 combines for 16 sums, instead of 16 separate reductions. */
#define TILE_SLOT(k) (((k) >> 2) + (((k) & 3) << 2))
static inline tvec tv_sums(const tvec* v) {
    __m512 w[8], x[4], y[2];
    for (int k = 0; k < 8; ++k)  /* per 128-bit quarter: (q0 + q2, q1 + q3) of v[2k], then of v[2k + 1] */
        w[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int k = 0; k < 4; ++k)  /* quarter i: four partial sums of v[4k + i] */
        x[k] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * k], w[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(w[2 * k], w[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int k = 0; k < 2; ++k)  /* quarter i: two partial sums of v[8k + i], then two of v[8k + 4 + i] */
        y[k] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * k], x[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(x[2 * k], x[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
#else
#define TILE 8
typedef __m256 tvec;
#define tv_zero() _mm256_setzero_ps()
#define tv_load(p) _mm256_loadu_ps(p)
#define tv_store(p, v) _mm256_storeu_ps(p, v)
#define tv_set1(x) _mm256_set1_ps(x)
#define tv_fma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define tv_add(a, b) _mm256_add_ps(a, b)
#define tv_mul(a, b) _mm256_mul_ps(a, b)

/* 8 floats of a pool row, float32 or bf16 (widened: a shift). */
KV_INLINE tvec tv_load_kv(const void* base, int64_t i, int bf16) {
    if (!bf16) return _mm256_loadu_ps((const float*)base + i);
    __m128i h = _mm_loadu_si128((const __m128i*)((const uint16_t*)base + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* The 8 horizontal sums of v[0..7] as one vector: lane p holds the sum of v[2p] (p < 4) or v[2(p - 4) + 1], so key
 * k's vector goes at index `TILE_SLOT(k)`. Three levels of shuffles and adds: 7 combines for 8 sums. */
#define TILE_SLOT(k) ((k) < 4 ? 2 * (k) : 2 * ((k) - 4) + 1)
static inline tvec tv_sums(const tvec* v) {
    __m256 w[4], x[2];
    for (int k = 0; k < 4; ++k)  /* low half: v[2k]'s two halves added; high half: v[2k + 1]'s */
        w[k] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * k], v[2 * k + 1], 0x20),
                             _mm256_permute2f128_ps(v[2 * k], v[2 * k + 1], 0x31));
    for (int k = 0; k < 2; ++k)  /* per half: two partial sums of each of two vectors */
        x[k] = _mm256_add_ps(_mm256_shuffle_ps(w[2 * k], w[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(w[2 * k], w[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm256_add_ps(_mm256_shuffle_ps(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm256_shuffle_ps(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif

/* Prefetch a tile's rows into L1 (keys [from, from + count) up to n; `bytes` of each row from element `offset`,
 * `elem` bytes an element) while the tile before it is computed. Alone, on pools cold in the caches as a decode step
 * finds them (30 layers' pools read once each), that made the bf16 dot path 12-14% and the widened path 3-6% faster
 * on Zen 5 (attention_bound.py --layers 30), and float32 pools no faster (twice the lines to fetch); with the next
 * unit's rows coming into L2 meanwhile (`prefetch_next_share`), float32 keys and values a tile ahead took a 64-row
 * float32 layer at 300 keys from 1.49 to 1.33 ms. */
KV_INLINE void prefetch_tile_rows(const void* pool, const int64_t* rows, int64_t from, int64_t n, int64_t count,
                                 int64_t offset, int64_t bytes, int64_t elem) {
    for (int64_t j = from; j < n && j < from + count; ++j) {
        const char* row = (const char*)pool + (rows[j] + offset) * elem;
        for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(row + b, _MM_HINT_T0);
    }
}

/* The unit a thread attends after this one: its keys' pool offsets (kv head 0), how many, and the slice of each row
 * it reads (from element `offset`, `bytes` long). While a unit is computed, its share of the next unit's keys and
 * values is prefetched into L2 (`prefetch_next_share`), so that the next unit finds them there: a decode step reads
 * each layer's pool cold, and with only the next tile prefetched a 64-row step's attention on Zen 5 spent ~0.6 ms
 * of its 0.9 waiting on memory (bf16 pool, 300 keys; 0.27 ms with the pool in cache). With this: 0.69 ms on bf16 dot
 * products, 0.70 against 1.07 widened, and float32 1.33 against 1.54 (`attention_bound.py --layers 30`). A unit's
 * keys and values (a few hundred KB at a few hundred keys) fit in L2 beside the current one's. The hint is T1 (L2);
 * T0 and T2 measured the same. */
typedef struct {
    const int64_t* rows;
    int64_t n, offset, bytes;
} next_unit;

#ifndef NEXT_UNIT_HINT
#define NEXT_UNIT_HINT _MM_HINT_T1
#endif

/* The next unit's share of rows of one pool (its keys, or its values) for this unit's work done at
 * [done, done + step) of `total`: spread evenly, the last step taking the rest (the key pass of a unit prefetches the
 * next one's keys, the value pass its values); `elem` bytes a pool element. */
KV_INLINE void prefetch_next_share(const void* pool, const next_unit* next, int64_t done, int64_t step, int64_t total,
                                   int64_t elem) {
    if (next->n == 0) return;
    int64_t from = done * next->n / total, to = done + step >= total ? next->n : (done + step) * next->n / total;
    for (int64_t j = from; j < to; ++j) {
        const char* row = (const char*)pool + (next->rows[j] + next->offset) * elem;
        for (int64_t b = 0; b < next->bytes; b += 64) _mm_prefetch(row + b, NEXT_UNIT_HINT);
    }
}

/* Attention of query token t's heads over kv heads [g0, g1): scores, softmax, values, TILE keys at a time (rows[j]
 * is key j's pool offset for kv head 0; `scores` has room for (g1 - g0) * group rows of `padded` floats). */
KV_INLINE void attend_token_tiled(const float* qkv, int64_t t, int64_t g0, int64_t g1, int64_t n, const int64_t* rows,
                                  int64_t heads, int64_t kv_heads, int64_t dim, const void* kpool, const void* vpool,
                                  float scale, float softcap, float* scores, int64_t padded, float* out, int kv_bf16,
                                  const next_unit* next) {
    int64_t width = (heads + 2 * kv_heads) * dim;
    int64_t group = heads / kv_heads, chunks = dim / TILE, elem = kv_bf16 ? 2 : 4;
    tvec vscale = tv_set1(scale);
    /* scores[(g - g0) * group + h][j] = scale * q_{g, h} . k_{j, g} */
    for (int64_t j0 = 0; j0 < n; j0 += TILE) {
        int64_t count = n - j0 < TILE ? n - j0 : TILE;
        prefetch_tile_rows(kpool, rows, j0 + TILE, n, TILE, g0 * dim, (g1 - g0) * dim * elem, elem);
        prefetch_next_share(kpool, next, j0, TILE, n, elem);
        /* the tile's rows (a short last tile repeats its first key: those lanes are computed and never read) */
        int64_t tile[TILE];
        for (int k = 0; k < TILE; ++k) tile[k] = rows[j0 + (k < count ? k : 0)];
        for (int64_t g = g0; g < g1; ++g)
            for (int64_t h = 0; h < group; ++h) {
                const float* q = qkv + t * width + (g * group + h) * dim;
                /* TILE independent sums (one per key), each over the head's chunks: the adds never wait on each
                 * other, unlike one key's chain of chunks */
                tvec acc[TILE];
                for (int k = 0; k < TILE; ++k) acc[k] = tv_zero();
                for (int64_t c = 0; c < chunks; ++c) {
                    tvec qc = tv_load(q + TILE * c);
                    for (int k = 0; k < TILE; ++k)
                        acc[TILE_SLOT(k)] = tv_fma(qc, tv_load_kv(kpool, tile[k] + g * dim + TILE * c, kv_bf16),
                                                    acc[TILE_SLOT(k)]);
                }
                tv_store(scores + ((g - g0) * group + h) * padded + j0, tv_mul(tv_sums(acc), vscale));
            }
    }
    for (int64_t r = 0; r < (g1 - g0) * group; ++r) {
        float* sc = scores + r * padded;
        if (softcap > 0)  /* Gemma 2's soft-capped scores, as transformers computes them: cap * tanh(score / cap) */
            for (int64_t j = 0; j < n; ++j) sc[j] = tanhf(sc[j] / softcap) * softcap;
        softmax_in_place(sc, n);
    }
    memset(out + (t * heads + g0 * group) * dim, 0, (size_t)((g1 - g0) * group * dim) * sizeof(float));
    /* out_{g, h} += sum_j p[g, h][j] * v_{j, g} */
    for (int64_t j0 = 0; j0 < n; j0 += TILE) {
        int64_t count = n - j0 < TILE ? n - j0 : TILE;
        prefetch_tile_rows(vpool, rows, j0 + TILE, n, TILE, g0 * dim, (g1 - g0) * dim * elem, elem);
        prefetch_next_share(vpool, next, j0, TILE, n, elem);
        for (int64_t g = g0; g < g1; ++g)
            for (int64_t h = 0; h < group; ++h) {
                const float* p = scores + ((g - g0) * group + h) * padded + j0;
                float* o = out + (t * heads + g * group + h) * dim;
                const void* v = vpool;
                int64_t base = g * dim;
                /* four chunks of the output at a time, even and odd keys in separate sums: eight independent
                 * multiply-add chains instead of one per chunk waiting on its previous key */
                int64_t c0 = 0;
                for (; c0 + 4 <= chunks; c0 += 4) {
                    tvec even[4], odd[4];
                    for (int c = 0; c < 4; ++c) {
                        even[c] = tv_load(o + TILE * (c0 + c));
                        odd[c] = tv_zero();
                    }
                    int64_t k = 0;
                    for (; k + 2 <= count; k += 2) {
                        tvec p0 = tv_set1(p[k]), p1 = tv_set1(p[k + 1]);
                        for (int c = 0; c < 4; ++c) {
                            even[c] = tv_fma(p0, tv_load_kv(v, rows[j0 + k] + base + TILE * (c0 + c), kv_bf16),
                                                      even[c]);
                            odd[c] = tv_fma(p1, tv_load_kv(v, rows[j0 + k + 1] + base + TILE * (c0 + c),
                                                                    kv_bf16), odd[c]);
                        }
                    }
                    if (k < count) {
                        tvec p0 = tv_set1(p[k]);
                        for (int c = 0; c < 4; ++c)
                            even[c] = tv_fma(p0, tv_load_kv(v, rows[j0 + k] + base + TILE * (c0 + c), kv_bf16),
                                                      even[c]);
                    }
                    for (int c = 0; c < 4; ++c) tv_store(o + TILE * (c0 + c), tv_add(even[c], odd[c]));
                }
                for (; c0 < chunks; ++c0) {  /* the chunks past a multiple of four (head sizes 80, 96, ...) */
                    tvec even = tv_load(o + TILE * c0), odd = tv_zero();
                    int64_t k = 0;
                    for (; k + 2 <= count; k += 2) {
                        even = tv_fma(tv_set1(p[k]), tv_load_kv(v, rows[j0 + k] + base + TILE * c0, kv_bf16),
                                               even);
                        odd = tv_fma(tv_set1(p[k + 1]),
                                              tv_load_kv(v, rows[j0 + k + 1] + base + TILE * c0, kv_bf16), odd);
                    }
                    if (k < count)
                        even = tv_fma(tv_set1(p[k]), tv_load_kv(v, rows[j0 + k] + base + TILE * c0, kv_bf16),
                                               even);
                    tv_store(o + TILE * c0, tv_add(even, odd));
                }
            }
    }
}

#if defined(__AVX512BF16__)
/* ---- attention on the CPU's bf16 dot products (AVX512-BF16: vdpbf16ps) ---------------------------------------
 * For a bfloat16 model whose batched steps multiply on bf16 dot products (`bf16_arithmetic`): the query rounded to
 * bf16 (as transformers' and vLLM's bf16 attention hold it) times the bf16 keys as they lie in the pool, and the
 * softmax's probabilities rounded to bf16 times the bf16 values, each pair of products summed in float32 by one
 * vdpbf16ps: no widening, a quarter of the tiled path's instructions per key. Scores, the softmax and the sums stay
 * float32. Head sizes that are a multiple of 32 and at most DOT_MAX_DIM.
 *   - keys: a tile of 16 keys, 16 independent sums per query head (as the tiled path), 32 dims per instruction;
 *   - values: two keys at once: their rows interleaved element by element (vpunpck{l,h}wd) so that each 32-bit
 *     lane holds one dim of both keys, times the pair of probabilities broadcast; per kv head, up to four query
 *     heads' outputs (eight registers per 32 dims) accumulate over every key before they are stored, so a value
 *     row is read once per four heads, not once per head. */
#define DOT_MAX_DIM 256

/* Query heads [hb, hb + NH) of kv head g: out[.., 32c..32c+31] = sum_k p[k] v[k] over the bf16 pairs `pairs`
 * (row r's pair k / 2 holds p[k] in its low half and p[k + 1] in its high half; past n they are 0). */
KV_INLINE void dot_values(int nh, const uint32_t* const* pairs, int64_t n, const int64_t* rows, const uint16_t* v,
                          int64_t base, int64_t dim, float* const* outs, const next_unit* next, int64_t pass,
                          int64_t passes) {
    /* unpacklo/hi interleave within 128-bit lanes: lane j of `lo` holds dim 8(j / 4) + j % 4, of `hi` that + 4;
     * these put dims 0-15 and 16-31 back in order */
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int64_t c = 0; c < dim / 32; ++c) {
        __m512 lo[4], hi[4];
        for (int i = 0; i < nh; ++i) lo[i] = hi[i] = _mm512_setzero_ps();
        for (int64_t k = 0; k < n; k += 2) {
            if (c == 0 && k % 16 == 0)  /* this pass's share of the next unit's values, 16 keys at a time */
                prefetch_next_share(v, next, pass * n + k, 16, passes * n, 2);
            __m512i a = _mm512_loadu_si512((const void*)(v + rows[k] + base + 32 * c));
            __m512i b = k + 1 < n ? _mm512_loadu_si512((const void*)(v + rows[k + 1] + base + 32 * c)) : a;
            __m512bh even = (__m512bh)_mm512_unpacklo_epi16(a, b), odd = (__m512bh)_mm512_unpackhi_epi16(a, b);
            for (int i = 0; i < nh; ++i) {
                __m512bh pair = (__m512bh)_mm512_set1_epi32((int)pairs[i][k / 2]);
                lo[i] = _mm512_dpbf16_ps(lo[i], pair, even);
                hi[i] = _mm512_dpbf16_ps(hi[i], pair, odd);
            }
        }
        for (int i = 0; i < nh; ++i) {
            _mm512_storeu_ps(outs[i] + 32 * c, _mm512_permutex2var_ps(lo[i], first, hi[i]));
            _mm512_storeu_ps(outs[i] + 32 * c + 16, _mm512_permutex2var_ps(lo[i], second, hi[i]));
        }
    }
}

/* attend_token_tiled on bf16 dot products (bf16 pools; dim a multiple of 32, at most DOT_MAX_DIM; `padded` a
 * multiple of 32). */
KV_INLINE void attend_token_dot(const float* qkv, int64_t t, int64_t g0, int64_t g1, int64_t n, const int64_t* rows,
                                int64_t heads, int64_t kv_heads, int64_t dim, const uint16_t* kpool,
                                const uint16_t* vpool, float scale, float softcap, float* scores, int64_t padded,
                                float* out, const next_unit* next) {
    int64_t width = (heads + 2 * kv_heads) * dim;
    int64_t group = heads / kv_heads, chunks = dim / 32;
    __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
        int64_t count = n - j0 < 16 ? n - j0 : 16;
        prefetch_tile_rows(kpool, rows, j0 + 16, n, 16, g0 * dim, (g1 - g0) * dim * 2, 2);
        prefetch_next_share(kpool, next, j0, 16, n, 2);
        int64_t tile[16];
        for (int k = 0; k < 16; ++k) tile[k] = rows[j0 + (k < count ? k : 0)];
        for (int64_t g = g0; g < g1; ++g)
            for (int64_t h = 0; h < group; ++h) {
                const float* q = qkv + t * width + (g * group + h) * dim;
                __m512 acc[16];
                for (int k = 0; k < 16; ++k) acc[k] = _mm512_setzero_ps();
                for (int64_t c = 0; c < chunks; ++c) {
                    __m512bh qc = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + 32 * c + 16), _mm512_loadu_ps(q + 32 * c));
                    for (int k = 0; k < 16; ++k)
                        acc[TILE_SLOT(k)] = _mm512_dpbf16_ps(
                            acc[TILE_SLOT(k)], qc,
                            (__m512bh)_mm512_loadu_si512((const void*)(kpool + tile[k] + g * dim + 32 * c)));
                }
                _mm512_storeu_ps(scores + ((g - g0) * group + h) * padded + j0, _mm512_mul_ps(tv_sums(acc), vscale));
            }
    }
    for (int64_t r = 0; r < (g1 - g0) * group; ++r) {
        float* sc = scores + r * padded;
        if (softcap > 0)
            for (int64_t j = 0; j < n; ++j) sc[j] = tanhf(sc[j] / softcap) * softcap;
        softmax_in_place(sc, n);
        for (int64_t j = n; j < padded; ++j) sc[j] = 0.0f;
        /* the probabilities as bf16 pairs, in place: 32 floats read before their 16 pairs are written behind them */
        for (int64_t j = 0; j < padded; j += 32) {
            __m512bh packed = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(sc + j + 16), _mm512_loadu_ps(sc + j));
            _mm512_storeu_si512((void*)((uint16_t*)sc + j), (__m512i)packed);
        }
    }
    for (int64_t g = g0; g < g1; ++g)
        for (int64_t hb = 0; hb < group; hb += 4) {
            int nh = group - hb < 4 ? (int)(group - hb) : 4;
            const uint32_t* pairs[4];
            float* outs[4];
            for (int i = 0; i < nh; ++i) {
                pairs[i] = (const uint32_t*)(scores + ((g - g0) * group + hb + i) * padded);
                outs[i] = out + (t * heads + g * group + hb + i) * dim;
            }
            /* the value passes of this unit, which share out the prefetch of the next unit's values */
            int64_t pass = (g - g0) * ((group + 3) / 4) + hb / 4, passes = (g1 - g0) * ((group + 3) / 4);
            /* one inlined copy per head count, so the accumulators stay in registers */
            switch (nh) {
                case 4: dot_values(4, pairs, n, rows, vpool, g * dim, dim, outs, next, pass, passes); break;
                case 3: dot_values(3, pairs, n, rows, vpool, g * dim, dim, outs, next, pass, passes); break;
                case 2: dot_values(2, pairs, n, rows, vpool, g * dim, dim, outs, next, pass, passes); break;
                default: dot_values(1, pairs, n, rows, vpool, g * dim, dim, outs, next, pass, passes); break;
            }
        }
}
#endif

/* Fill `buf` with token t's key offsets (kv head 0) unless it holds them already (*holds == t); return the first key
 * its queries see, with *n their count (the last `window` of them with a window). */
KV_INLINE const int64_t* token_keys(const int64_t* tables, const int64_t* table_start, const int64_t* key_len,
                                    int64_t block_size, int64_t row_width, int64_t window, int64_t t, int64_t* buf,
                                    int64_t* holds, int64_t* n) {
    int64_t count = key_len[t];
    if (*holds != t) {
        const int64_t* table = tables + table_start[t];
        for (int64_t j = 0, b = 0; j < count; ++b)
            for (int64_t i = 0; i < block_size && j < count; ++i, ++j) buf[j] = (table[b] * block_size + i) * row_width;
        *holds = t;
    }
    if (window > 0 && count > window) {
        *n = window;
        return buf + (count - window);
    }
    *n = count;
    return buf;
}

/* attend_items' contract on the tiled path. A unit of work is a whole query token (all its kv heads: a key's row
 * of every head is read in one pass, so a tile of a block is one contiguous run of memory), or with
 * `per_head` one (token, kv head) item as attend_items has it (a step of one token still splits over threads). */
KV_INLINE int attend_items_tiled(const float* qkv, int64_t unit_begin, int64_t unit_end, int per_head, int64_t heads,
                                 int64_t kv_heads, int64_t dim, const void* kpool, const void* vpool,
                                 const int64_t* tables, const int64_t* table_start, const int64_t* key_len,
                                 int64_t block_size, float scale, int64_t window, float softcap, float* out,
                                 int kv_bf16) {
    if (unit_begin >= unit_end) return 0;
    int64_t per_unit = per_head ? kv_heads : 1;
    int64_t max_keys = 1;
    for (int64_t u = unit_begin; u < unit_end; ++u) {
        int64_t n = key_len[u / per_unit];
        max_keys = n > max_keys ? n : max_keys;
    }
    int64_t padded = (max_keys + 31) / 32 * 32;  /* whole tiles, and whole 32-float chunks for the dot path */
    float* scores = malloc((size_t)(heads * padded) * sizeof(float));
    /* two tokens' key offsets: the unit being attended and the next one (whose keys are prefetched meanwhile) */
    int64_t* rows[2] = {malloc((size_t)max_keys * sizeof(int64_t)), malloc((size_t)max_keys * sizeof(int64_t))};
    if (scores == NULL || rows[0] == NULL || rows[1] == NULL) {
        free(scores);
        free(rows[0]);
        free(rows[1]);
        return -1;
    }
    int64_t holds[2] = {-1, -1}, row_width = kv_heads * dim;
    int cur = 0;
    int64_t u = unit_begin;
    while (u < unit_end && key_len[u / per_unit] == 0) ++u;  /* long prefill chunks' tokens: attended elsewhere */
    while (u < unit_end) {
        int64_t t = u / per_unit;
        int64_t g0 = per_head ? u % kv_heads : 0, g1 = per_head ? g0 + 1 : kv_heads;
        if (holds[cur] != t && holds[1 - cur] == t) cur = 1 - cur;
        int64_t n;
        const int64_t* seen = token_keys(tables, table_start, key_len, block_size, row_width, window, t, rows[cur],
                                         &holds[cur], &n);
        int64_t v = u + 1;
        while (v < unit_end && key_len[v / per_unit] == 0) ++v;
        next_unit next = {NULL, 0, 0, 0};
        if (v < unit_end) {
            int64_t tv = v / per_unit, vg0 = per_head ? v % kv_heads : 0;
            int slot = tv == t ? cur : 1 - cur;
            next.rows = token_keys(tables, table_start, key_len, block_size, row_width, window, tv, rows[slot],
                                   &holds[slot], &next.n);
            next.offset = vg0 * dim;
            next.bytes = (per_head ? 1 : kv_heads) * dim * (kv_bf16 ? 2 : 4);
        }
#if defined(__AVX512BF16__)
        if (kv_bf16 == 2)
            attend_token_dot(qkv, t, g0, g1, n, seen, heads, kv_heads, dim, kpool, vpool, scale, softcap, scores,
                             padded, out, &next);
        else
#endif
            attend_token_tiled(qkv, t, g0, g1, n, seen, heads, kv_heads, dim, kpool, vpool, scale, softcap, scores,
                               padded, out, kv_bf16, &next);
        u = v;
    }
    free(scores);
    free(rows[0]);
    free(rows[1]);
    return 0;
}
#endif

/* The first item of the `part`-th of `parts` consecutive ranges of about equal work (keys read): how
 * dk_rope_cache_attend splits its items over threads (layers.c plans its prefetches by it too). */
int64_t dk_range_start(const int64_t* key_len, int64_t tokens, int64_t kv_heads, int64_t total, int64_t part,
                           int64_t parts) {
    if (part <= 0) return 0;
    if (part >= parts) return tokens * kv_heads;
    int64_t goal = total * part / parts, done = 0;
    for (int64_t it = 0; it < tokens * kv_heads; ++it) {
        if (done >= goal) return it;
        done += key_len[it / kv_heads];
    }
    return tokens * kv_heads;
}

/* How dk_rope_cache_attend splits a step's attention over `threads` (layers.c plans its prefetches by it too): returns
 * whether its items are (token, kv head) pairs (off the tiled path, or with fewer tokens than threads) rather than
 * whole tokens; *total gets the keys its items read, *split whether it runs on the threads at all (at least
 * `parallel_min_keys` keys read and more than one item). */
int dk_attention_split(const int64_t* key_len, int64_t tokens, int64_t kv_heads, int64_t dim, int64_t tiled,
                       int64_t parallel_min_keys, int64_t threads, int64_t* total, int* split) {
    int use_tiled = 0;
#ifdef TILE
    use_tiled = tiled != 0 && dim % TILE == 0;
#else
    (void)dim;
    (void)tiled;
#endif
    int per_head = !use_tiled || tokens < threads;
    int64_t per_unit = per_head ? kv_heads : 1;
    *total = 0;
    for (int64_t t = 0; t < tokens; ++t) *total += key_len[t] * per_unit;
    *split = threads > 1 && *total * (kv_heads / per_unit) >= parallel_min_keys && tokens * per_unit > 1;
    return per_head;
}

/* Whether this library was built with OpenMP (attention then runs on torch's threads: the library links the
 * libgomp torch has already loaded, so the two share one thread pool and one thread count). */
int dk_parallel(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* Whether this library attends bf16 pools on the CPU's bf16 dot products (built for AVX512-BF16), for head sizes
 * that are a multiple of 32 up to DOT_MAX_DIM (`kv_bf16` 2 in dk_rope_cache_attend). */
int dk_dot_attention(void) {
#if defined(__AVX512BF16__)
    return DOT_MAX_DIM;
#else
    return 0;
#endif
}

/* The keys per tile of this library's tiled attention (attend_items_tiled: 16 built for AVX-512, 8 for AVX2 + FMA),
 * which dk_rope_cache_attend runs for head sizes that are a multiple of it unless its `tiled` argument is 0; 0
 * where the CPU has neither (key by key only). */
int dk_tiled_attention(void) {
#ifdef TILE
    return TILE;
#else
    return 0;
#endif
}

/* One decoder layer's attention for the tokens of a step that belong to sequences scoring a few new tokens
 * (decode, speculative verification, beams): RoPE and KV write for all T tokens (rope_store), then attention
 * (attend_items) for all of them: every write happens before any read, so queries of one sequence see each
 * other's keys (causality comes from key_len; a `window` > 0 keeps each query's last `window` keys; a `softcap` > 0
 * caps each score to softcap * tanh(score / softcap)). The pools
 * hold float32, or bfloat16 where `kv_bf16` is non-zero
 * (written rounded to nearest even, read widened: float32 arithmetic either way; `kv_bf16` 2 asks for bf16 dot
 * products instead, attend_token_dot, where the library has them (`dk_dot_attention`) and the path is tiled). With OpenMP and at least
 * `parallel_min_keys` keys to read, the attention is cut into one range of about equal work per thread. With
 * `tiled` non-zero, a library built for AVX-512 or AVX2 + FMA attends in tiles of keys (attend_items_tiled) where
 * the head size is a multiple of the tile; otherwise, and on other CPUs, key by key (attend_items). Returns 0, or -1 if scratch
 * memory could not be allocated. */
int dk_rope_cache_attend(float* qkv, int64_t tokens, int64_t heads, int64_t kv_heads, int64_t dim,
                         const float* cos, const float* signed_sin, void* kpool, void* vpool,
                         const int64_t* slots, const int64_t* tables, const int64_t* table_start,
                         const int64_t* key_len, int64_t block_size, float scale, int64_t parallel_min_keys,
                         int64_t window, float softcap, int64_t kv_bf16, int64_t tiled, float* out) {
    if (rope_store(qkv, tokens, heads, kv_heads, dim, cos, signed_sin, kpool, vpool, slots, kv_bf16 != 0) != 0)
        return -1;
    int use_tiled = 0;
#ifdef TILE
    use_tiled = tiled != 0 && dim % TILE == 0;
#endif
    int use_dot = 0;  /* kv_bf16 == 2: bf16 dot products, where this library and the head size have them */
#if defined(__AVX512BF16__)
    use_dot = kv_bf16 == 2 && dim % 32 == 0 && dim <= DOT_MAX_DIM;
#endif
    int64_t threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    int64_t total;
    int split;
    int per_head = dk_attention_split(key_len, tokens, kv_heads, dim, tiled, parallel_min_keys, threads, &total, &split);
    (void)use_tiled;  /* read on the tiled paths only */
    (void)split;      /* read by OpenMP only */
    int64_t per_unit = per_head ? kv_heads : 1;
    int failed = 0;
#ifdef _OPENMP
#pragma omp parallel if (split) reduction(|| : failed)
    {
        int64_t parts = omp_get_num_threads(), part = omp_get_thread_num();
#else
    {
        int64_t parts = 1, part = 0;
#endif
        int64_t begin = dk_range_start(key_len, tokens, per_unit, total, part, parts);
        int64_t end = dk_range_start(key_len, tokens, per_unit, total, part + 1, parts);
        /* two inlined copies of each path, one per pool element (its flag a constant in each) */
#ifdef TILE
        if (use_tiled && use_dot)
            failed = attend_items_tiled(qkv, begin, end, per_head, heads, kv_heads, dim, kpool, vpool, tables,
                                        table_start, key_len, block_size, scale, window, softcap, out, 2) != 0;
        else if (use_tiled)
            failed = (kv_bf16 ? attend_items_tiled(qkv, begin, end, per_head, heads, kv_heads, dim, kpool, vpool,
                                                   tables, table_start, key_len, block_size, scale, window, softcap,
                                                   out, 1)
                              : attend_items_tiled(qkv, begin, end, per_head, heads, kv_heads, dim, kpool, vpool,
                                                   tables, table_start, key_len, block_size, scale, window, softcap,
                                                   out, 0)) != 0;
        else
#endif
        if (kv_bf16)
            failed = attend_items(qkv, begin, end, heads, kv_heads, dim, kpool, vpool, tables, table_start, key_len,
                                  block_size, scale, window, softcap, out, 1) != 0;
        else
            failed = attend_items(qkv, begin, end, heads, kv_heads, dim, kpool, vpool, tables, table_start, key_len,
                                  block_size, scale, window, softcap, out, 0) != 0;
    }
    return failed ? -1 : 0;
}

/* ---- bfloat16 weights -----------------------------------------------------------------------------------------
 * out[m, o] = dot(x[m], w[o]) (+ bias[o]) (+ residual[m, o]) for float32 rows x [rows, in] and bfloat16 weights:
 * bf16 storage, float32 arithmetic (llama.cpp's bf16 model files on a CPU). Widening a bf16 weight to float32 is
 * exact (a shift), so each product is the float32 product of the bf16-rounded weights, summed in float32: closer
 * to float32 than torch's bf16 path, which also rounds every activation to bf16. Decode reads every weight once per
 * step, and bf16 halves those bytes.
 *
 * The weights are packed in panels of 16 output rows, [ceil(out / 16), in, 16] (`pack_bf16_panels` in
 * fused_decoder.py, zero rows past `out`): a panel is one contiguous run of memory read front to back, 16 outputs
 * per input. Measured on SmolLM2's shapes (2-core AVX2 EPYC, 1 thread, cold weights): row-major [out, in] dot
 * products read 8 GB/s, the four interleaved 1 KB row streams defeating the prefetcher; panels read 19.5 GB/s.
 * A 256-bit load holds 16 weights, two per 32-bit lane: masking the low half gives the odd outputs as floats and
 * shifting left by 16 the even ones, two cheap ops and no shuffle; each input x[m, i] is broadcast once.
 * Tiles are P panels x M rows with 2 * P * M accumulators (at most 8 of the 16 registers). Panels are split over
 * torch's OpenMP threads; each output is computed as on one thread, so results do not depend on the thread count. */
#define PANEL 16

/* How far ahead in its panel each panel stream prefetches (weights: 4 KB). Without it one core's prefetcher kept
 * too few lines in flight for 4 panel streams: one step's 30 SmolLM2 layers took 7.2 ms on a 2-core Zen 5 and 5.1
 * ms with it. */
#define PANEL_PREFETCH 2048

#if (defined(__AVX2__) && defined(__FMA__)) || defined(__AVX512F__)
/* A panel's 16 sums from its even outputs' and odd outputs' vectors, in output order. */
static inline void interleave_panel_sums(float* dst, __m256 even, __m256 odd) {
    float e[8], o[8];
    _mm256_storeu_ps(e, even);
    _mm256_storeu_ps(o, odd);
    for (int k = 0; k < 8; ++k) {
        dst[2 * k] = e[k];
        dst[2 * k + 1] = o[k];
    }
}
#endif

#if defined(__AVX512F__)
/* AVX-512: a 512-bit load holds two inputs' 16 weights (i and i + 1): the even/odd split as below, each input's x
 * broadcast into its half (one permute per two inputs), and the two halves' sums added at the end. */
#define DK_PANEL_TILE(P, M)                                                                                     \
    static void panel_tile_##P##_##M(const float* x, int64_t in, const uint16_t* w, float* sums) {             \
        const __m512i high = _mm512_set1_epi32((int)0xffff0000u);                                               \
        const __m512i halves = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);              \
        __m512 acc[P][2][M];                                                                                    \
        for (int q = 0; q < P; ++q)                                                                             \
            for (int m = 0; m < M; ++m) acc[q][0][m] = acc[q][1][m] = _mm512_setzero_ps();                      \
        int64_t i = 0;                                                                                          \
        for (; i + 2 <= in; i += 2) {                                                                           \
            __m512 xb[M];                                                                                       \
            for (int m = 0; m < M; ++m) {                                                                       \
                double two;                                                                                     \
                memcpy(&two, x + m * in + i, sizeof two);                                                       \
                xb[m] = _mm512_permutexvar_ps(halves, _mm512_castpd_ps(_mm512_set1_pd(two)));                   \
            }                                                                                                   \
            for (int q = 0; q < P; ++q) {                                                                       \
                __builtin_prefetch(w + (q * in + i) * PANEL + PANEL_PREFETCH);                                  \
                __m512i pair = _mm512_loadu_si512((const void*)(w + (q * in + i) * PANEL));                     \
                __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16));                                 \
                __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(pair, high));                                 \
                for (int m = 0; m < M; ++m) {                                                                   \
                    acc[q][0][m] = _mm512_fmadd_ps(even, xb[m], acc[q][0][m]);                                  \
                    acc[q][1][m] = _mm512_fmadd_ps(odd, xb[m], acc[q][1][m]);                                   \
                }                                                                                               \
            }                                                                                                   \
        }                                                                                                       \
        for (int q = 0; q < P; ++q)                                                                             \
            for (int m = 0; m < M; ++m) {                                                                       \
                __m256 half[2];                                                                                 \
                for (int h = 0; h < 2; ++h) {                                                                   \
                    __m512 a = acc[q][h][m];                                                                    \
                    half[h] = _mm256_add_ps(_mm512_castps512_ps256(a),                                         \
                                            _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1))); \
                    if (i < in) { /* an odd input count's last input */                                         \
                        __m256i one = _mm256_loadu_si256((const __m256i*)(w + (q * in + i) * PANEL));           \
                        __m256 part = _mm256_castsi256_ps(h == 0 ? _mm256_slli_epi32(one, 16)                   \
                                                                 : _mm256_and_si256(one, _mm512_castsi512_si256(high))); \
                        half[h] = _mm256_fmadd_ps(part, _mm256_set1_ps(x[m * in + i]), half[h]);               \
                    }                                                                                           \
                }                                                                                               \
                interleave_panel_sums(sums + (m * P + q) * PANEL, half[0], half[1]);                            \
            }                                                                                                   \
    }
#elif defined(__AVX2__) && defined(__FMA__)
#define DK_PANEL_TILE(P, M)                                                                                     \
    static void panel_tile_##P##_##M(const float* x, int64_t in, const uint16_t* w, float* sums) {             \
        const __m256i high = _mm256_set1_epi32((int)0xffff0000u);                                               \
        __m256 acc[P][2][M];                                                                                    \
        for (int q = 0; q < P; ++q)                                                                             \
            for (int m = 0; m < M; ++m) acc[q][0][m] = acc[q][1][m] = _mm256_setzero_ps();                      \
        /* two inputs (a 64-byte line of a panel) a turn: one prefetch a line and no test (the same sums) */      \
        for (int64_t i = 0; i < in; i += 2) {                                                                   \
            int two = i + 1 < in;                                                                               \
            for (int q = 0; q < P; ++q) __builtin_prefetch(w + (q * in + i) * PANEL + PANEL_PREFETCH);          \
            for (int t = 0; t < 1 + two; ++t) {                                                                 \
                __m256 xb[M];                                                                                   \
                for (int m = 0; m < M; ++m) xb[m] = _mm256_broadcast_ss(x + m * in + i + t);                    \
                for (int q = 0; q < P; ++q) {                                                                   \
                    __m256i pair = _mm256_loadu_si256((const __m256i*)(w + (q * in + i + t) * PANEL));          \
                    __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(pair, 16));                             \
                    __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(pair, high));                             \
                    for (int m = 0; m < M; ++m) {                                                               \
                        acc[q][0][m] = _mm256_fmadd_ps(even, xb[m], acc[q][0][m]);                              \
                        acc[q][1][m] = _mm256_fmadd_ps(odd, xb[m], acc[q][1][m]);                               \
                    }                                                                                           \
                }                                                                                               \
            }                                                                                                   \
        }                                                                                                       \
        for (int q = 0; q < P; ++q)                                                                             \
            for (int m = 0; m < M; ++m) {                                                                       \
                interleave_panel_sums(sums + (m * P + q) * PANEL, acc[q][0][m], acc[q][1][m]);                  \
            }                                                                                                   \
    }
#else
/* Without AVX2 and FMA: the same sums, serial. */
#define DK_PANEL_TILE(P, M)                                                                                     \
    static void panel_tile_##P##_##M(const float* x, int64_t in, const uint16_t* w, float* sums) {             \
        for (int q = 0; q < P; ++q)                                                                             \
            for (int m = 0; m < M; ++m)                                                                         \
                for (int k = 0; k < PANEL; ++k) {                                                               \
                    float t = 0;                                                                                \
                    for (int64_t i = 0; i < in; ++i) t += x[m * in + i] * bf16_to_float(w[(q * in + i) * PANEL + k]); \
                    sums[(m * P + q) * PANEL + k] = t;                                                          \
                }                                                                                               \
    }
#endif
DK_PANEL_TILE(1, 1)
DK_PANEL_TILE(1, 2)
DK_PANEL_TILE(1, 3)
DK_PANEL_TILE(1, 4)
#if defined(__AVX512F__)
/* 5-8 rows in one block where the registers hold 16 accumulators and 8 broadcast input pairs (AVX-512's 32): each
 * pair of bf16 weights widened once for all of them. Each output's sums are the same whatever rows share its block.
 * SmolLM2's bf16 layer products (30 layers, 2-core Zen 5, the two libraries alternating in one process, equal
 * outputs): 5-8 rows 1.16-1.20x as fast (8 rows now 1.08x one row's time), 12 rows 1.15x, 16 rows 1.13x. */
DK_PANEL_TILE(1, 5)
DK_PANEL_TILE(1, 6)
DK_PANEL_TILE(1, 7)
DK_PANEL_TILE(1, 8)
#define BF16_PANEL_ROWS 8
#define BF16_PANEL_SUMS(x, n, wp) DK_PANEL_SUMS_8(panel, x, n, wp)
#endif

/* A panel block's epilogue: out[m + k, o] = sums[k][o - 16p] (* scale[o]) (+ bias[o]) (+ residual[m + k, o]) for
 * its nm rows and the outputs o < out_dim of panel p. */
static void store_panel_sums(const float* sums, int64_t p, int64_t m, int64_t nm, int64_t out_dim,
                             const float* scale, const float* bias, const float* residual, float* out) {
    for (int64_t k = 0; k < nm; ++k)
        for (int64_t j = 0; j < PANEL; ++j) {
            int64_t o = p * PANEL + j;
            if (o >= out_dim) break;
            int64_t at = (m + k) * out_dim + o;
            float v = sums[k * PANEL + j];
            if (scale) v *= scale[o];
            if (bias) v += bias[o];
            if (residual) v += residual[at];
            out[at] = v;
        }
}

/* Activation rows per tile at most on AVX2: one panel's 8 accumulators and 4 broadcast inputs (6 rows measured 25%
 * slower from 16 rows up: registers spill); AVX-512's 32 registers take 8 (BF16_PANEL_ROWS, I8_PANEL_ROWS). */
#define PANEL_ROWS 4

/* The sums of one panel `wp` for rows [0, nm) of x (nm <= PANEL_ROWS) into sums [nm][PANEL], by the tiles
 * NAME##_tile_1_M(x, n, w, sums) of one weight format. */
#define DK_PANEL_SUMS(NAME, x, n, wp)                                                                           \
    do {                                                                                                        \
        switch (nm) {                                                                                           \
            case 1: NAME##_tile_1_1(x, n, wp, sums); break;                                                    \
            case 2: NAME##_tile_1_2(x, n, wp, sums); break;                                                    \
            case 3: NAME##_tile_1_3(x, n, wp, sums); break;                                                    \
            default: NAME##_tile_1_4(x, n, wp, sums); break;                                                   \
        }                                                                                                       \
    } while (0)

/* DK_PANEL_SUMS for nm <= 8, by the tiles NAME##_tile_1_1 .. NAME##_tile_1_8 (built where the registers hold 8 rows:
 * AVX-512). */
#define DK_PANEL_SUMS_8(NAME, x, n, wp)                                                                         \
    do {                                                                                                        \
        switch (nm) {                                                                                           \
            case 1: case 2: case 3: case 4: DK_PANEL_SUMS(NAME, x, n, wp); break;                               \
            case 5: NAME##_tile_1_5(x, n, wp, sums); break;                                                    \
            case 6: NAME##_tile_1_6(x, n, wp, sums); break;                                                    \
            case 7: NAME##_tile_1_7(x, n, wp, sums); break;                                                    \
            default: NAME##_tile_1_8(x, n, wp, sums); break;                                                   \
        }                                                                                                       \
    } while (0)

/* One panel product's operands, for its block function. */
typedef struct {
    const void* x;      /* float rows (bf16 weights) or int16 rows (int8 weights) */
    const float* xf;    /* the float rows (the int8 path's fallback) */
    int64_t in;         /* inputs per row */
    const void* w;      /* the panels */
} panel_operands;

/* A weight format's block: the unscaled sums of panel p for rows [m, m + nm) into sums [nm][PANEL]. */
typedef void (*panel_block_fn)(const panel_operands* ops, int64_t p, int64_t m, int64_t nm, float* sums);

/* The most rows a panel block takes (I8_PANEL_ROWS on AVX-512). */
#define PANEL_MAX_ROWS 8

/* out = the product of `rows` rows and `out_dim` outputs, block by block: panels are split over torch's OpenMP threads
 * one at a time, rows go `block_rows` (at most PANEL_MAX_ROWS) at a time; each block's sums are times row_scale[m]
 * (when given) and stored by `store_panel_sums`. Each output is computed as on one thread, so results do not depend on
 * the thread count. One panel at a time, each thread streams its panels front to back as one run (consecutive panels
 * are adjacent in memory): one row or two took 4 or 2 panels at a time before (interleaved streams, each activation
 * broadcast serving more panels), and one panel at a time measured a SmolLM2 token 1.13x as fast in bf16 and 1.19x in
 * int8, two-row steps 1.13x and 1.22x (2-core Zen 5, two engines alternating in one process), as the float32 kernel's
 * single stream did (`dk_gemv`). */
static void panel_product(const panel_operands* ops, panel_block_fn block, int64_t block_rows, int64_t rows,
                          int64_t out_dim, const float* row_scale, const float* scale, const float* bias,
                          const float* residual, float* out) {
    int64_t num_panels = (out_dim + PANEL - 1) / PANEL;
#ifdef _OPENMP
    int64_t work = out_dim * ops->in * (rows < 8 ? rows : 8);  /* a product this small is not worth the fork and join */
#pragma omp parallel for schedule(static) if (work >= 65536)
#endif
    for (int64_t p = 0; p < num_panels; ++p) {
#ifdef _OPENMP
        dk_side_prefetch(omp_get_thread_num(), omp_get_num_threads(), p, num_panels);
#else
        dk_side_prefetch(0, 1, p, num_panels);
#endif
        for (int64_t m = 0; m < rows; m += block_rows) {
            int64_t nm = rows - m < block_rows ? rows - m : block_rows;
            float sums[PANEL_MAX_ROWS * PANEL];
            block(ops, p, m, nm, sums);
            if (row_scale)
                for (int64_t k = 0; k < nm; ++k)
                    for (int64_t j = 0; j < PANEL; ++j) sums[k * PANEL + j] *= row_scale[m + k];
            store_panel_sums(sums, p, m, nm, out_dim, scale, bias, residual, out);
        }
    }
}

#ifndef BF16_PANEL_ROWS  /* 4 rows a block (PANEL_ROWS) where the tiles stop at 4 */
#define BF16_PANEL_ROWS PANEL_ROWS
#define BF16_PANEL_SUMS(x, n, wp) DK_PANEL_SUMS(panel, x, n, wp)
#endif

static void bf16_block(const panel_operands* ops, int64_t p, int64_t m, int64_t nm, float* sums) {
    const float* xm = (const float*)ops->x + m * ops->in;
    const uint16_t* wp = (const uint16_t*)ops->w + p * ops->in * PANEL;
    BF16_PANEL_SUMS(xm, ops->in, wp);
}

void dk_linear_bf16(const float* x, int64_t rows, int64_t in, const uint16_t* panels, const float* bias,
                    const float* residual, float* out, int64_t out_dim) {
    panel_operands ops = {x, x, in, panels};
    panel_product(&ops, bf16_block, BF16_PANEL_ROWS, rows, out_dim, NULL, NULL, bias, residual, out);
}

/* ---- int8 weights ---------------------------------------------------------------------------------------------
 * out[m, o] = scale[o] * dot(x[m], w[o]) (+ bias[o]) (+ residual[m, o]) for float32 rows x [rows, in] and int8
 * weights w [out, in] with one float32 scale per output row: weight-only int8 (llama.cpp's Q8_0 weights). At
 * batch 1 the float32 products stream 4 bytes per weight; these stream 1.
 *
 * The weights are packed like the bf16 ones, in panels of 16 output rows read front to back, here by pairs of
 * inputs: [ceil(out / 16), ceil(in / 2), 16, 2] (`pack_int8_panels` in native_kernels.py; zero weights past `out`
 * and past an odd `in`). Each activation row is rounded to int16 with its own scale (max|x| -> 32767) and the
 * products are `vpmaddwd`: 16 weights widened to int16 times the row's input pair broadcast, summed exactly in
 * int32 (flushed to float every I8_PAIRS_CHUNK pairs, before int32 could overflow). The row-major layout this
 * replaced read ~8 GB/s from memory on one thread here (four interleaved 1 KB row streams).
 * Rounding x adds at most max|x| / 65534 to each element; as max|x| <= sqrt(in) * rms(x) for any row, that is at
 * most sqrt(in) / 65534 of the row's rms (0.06% at in = 1536), well under the int8 weights' own rounding (up to 0.4%
 * of a row's largest weight). A call with a row that is not finite (and any CPU without AVX2) takes the scalar
 * float path instead, so NaN and infinity propagate as in float32. */
#define I8_PAIRS_CHUNK 256  /* 256 pairs x 2 x 127 x 32767 < 2^31 */
/* How far ahead in its panel each panel stream prefetches (bytes), as PANEL_PREFETCH for bf16: 4.1 -> 3.0 ms for
 * one step's 30 SmolLM2 layers on a 2-core Zen 5. */
#define I8_PANEL_PREFETCH 4096

/* Round each row of x to int16 with its own scale into xq/xscale; 0 when some row is not finite (the float path
 * then takes the call, so NaN and infinity propagate as in float32).
 *
 * With AVX2 eight at a time: the same peak (a maximum is exact), and `vcvtps2dq` rounds as `lrintf` does (both by
 * the current rounding mode, to nearest even by default), so every int16 is the scalar loop's. The scalar loop
 * (`lrintf` a call each) took ~2 us of a 576-wide row and ~5 us of a 1536-wide one (2-core Zen 3), on one thread
 * while the other waited, before each of a batch-1 token's int8 products. */
static int quantize_rows_i16(const float* x, int64_t rows, int64_t in, int16_t* xq, float* xscale) {
    for (int64_t m = 0; m < rows; ++m) {
        const float* xm = x + m * in;
        int16_t* qm = xq + m * in;
        float peak = 0.0f;
        int64_t i = 0;
        int not_a_number = 0;
#if defined(__AVX2__)
        const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
        __m256 most = _mm256_setzero_ps(), unordered = _mm256_setzero_ps();
        for (; i + 8 <= in; i += 8) {
            __m256 a = _mm256_and_ps(_mm256_loadu_ps(xm + i), magnitude);
            most = _mm256_max_ps(most, a);
            unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
        }
        __m128 half = _mm_max_ps(_mm256_castps256_ps128(most), _mm256_extractf128_ps(most, 1));
        half = _mm_max_ps(half, _mm_movehl_ps(half, half));
        half = _mm_max_ss(half, _mm_movehdup_ps(half));
        peak = _mm_cvtss_f32(half);
        not_a_number = _mm256_movemask_ps(unordered) != 0;
#endif
        for (; i < in; ++i) {
            float a = fabsf(xm[i]);
            not_a_number |= a != a;
            peak = a > peak ? a : peak;
        }
        if (not_a_number || !isfinite(peak)) return 0;
        float step = peak > 0.0f ? peak / 32767.0f : 1.0f;
        float inverse = 1.0f / step;
        xscale[m] = step;
        i = 0;
#if defined(__AVX2__)
        const __m256 by = _mm256_set1_ps(inverse);
        for (; i + 8 <= in; i += 8) {
            __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xm + i), by));
            /* |q| <= 32767, so the saturating pack is the plain narrowing (int16_t) does */
            _mm_storeu_si128((__m128i*)(qm + i), _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)));
        }
#endif
        for (; i < in; ++i) qm[i] = (int16_t)lrintf(xm[i] * inverse);
    }
    return 1;
}

#if defined(__AVX512BW__) && defined(__AVX2__) && defined(__FMA__)
/* AVX-512 (BW): a pair's 32 weights widen to one 512-bit vector of int16 and one `vpmaddwd` (with VNNI one
 * `vpdpwssd`, the multiply-add and the sum in one) gives all 16 outputs: half the AVX2 path's instructions, the same
 * exact int32 sums. */
#if defined(__AVX512VNNI__)
#define I8_DOT_ADD(acc, w, x) _mm512_dpwssd_epi32(acc, w, x)
#else
#define I8_DOT_ADD(acc, w, x) _mm512_add_epi32(acc, _mm512_madd_epi16(w, x))
#endif
#define DK_I8_PANEL_TILE(P, M)                                                                                  \
    static void i8_panel_tile_##P##_##M(const int16_t* x, int64_t pairs, const int8_t* w, float* sums) {       \
        __m512 total[P][M];                                                                                     \
        for (int q = 0; q < P; ++q)                                                                             \
            for (int m = 0; m < M; ++m) total[q][m] = _mm512_setzero_ps();                                      \
        for (int64_t j0 = 0; j0 < pairs; j0 += I8_PAIRS_CHUNK) {                                                \
            int64_t j1 = j0 + I8_PAIRS_CHUNK < pairs ? j0 + I8_PAIRS_CHUNK : pairs;                             \
            __m512i acc[P][M];                                                                                  \
            for (int q = 0; q < P; ++q)                                                                         \
                for (int m = 0; m < M; ++m) acc[q][m] = _mm512_setzero_si512();                                 \
            /* two pairs (a 64-byte line of a panel) a turn: one prefetch a line, no test per pair */           \
            for (int64_t j = j0; j < j1; j += 2) {                                                              \
                int two = j + 1 < j1;                                                                           \
                for (int q = 0; q < P; ++q)                                                                     \
                    __builtin_prefetch(w + (q * pairs + j) * 2 * PANEL + I8_PANEL_PREFETCH);                    \
                for (int t = 0; t < 1 + two; ++t) {                                                             \
                    __m512i xb[M];                                                                              \
                    for (int m = 0; m < M; ++m) {                                                               \
                        int32_t pair;                                                                           \
                        memcpy(&pair, x + m * pairs * 2 + 2 * (j + t), sizeof pair);                            \
                        xb[m] = _mm512_set1_epi32(pair);                                                        \
                    }                                                                                           \
                    for (int q = 0; q < P; ++q) {                                                               \
                        __m512i wide = _mm512_cvtepi8_epi16(                                                    \
                            _mm256_loadu_si256((const __m256i*)(w + (q * pairs + j + t) * 2 * PANEL)));         \
                        for (int m = 0; m < M; ++m) acc[q][m] = I8_DOT_ADD(acc[q][m], wide, xb[m]);             \
                    }                                                                                           \
                }                                                                                               \
            }                                                                                                   \
            for (int q = 0; q < P; ++q)                                                                         \
                for (int m = 0; m < M; ++m) total[q][m] = _mm512_add_ps(total[q][m], _mm512_cvtepi32_ps(acc[q][m])); \
        }                                                                                                       \
        for (int q = 0; q < P; ++q)                                                                             \
            for (int m = 0; m < M; ++m) _mm512_storeu_ps(sums + (m * P + q) * PANEL, total[q][m]);              \
    }
DK_I8_PANEL_TILE(1, 1)
DK_I8_PANEL_TILE(1, 2)
DK_I8_PANEL_TILE(1, 3)
DK_I8_PANEL_TILE(1, 4)
/* 5-8 rows in one block where the registers hold 8 accumulators, 8 totals and 8 broadcast pairs (AVX-512's 32): each
 * pair of weights widened once for all of them, not once per 4 rows. Each output's sums are the same (exact int32
 * per I8_PAIRS_CHUNK pairs, added to its total in order), whatever rows share its block. SmolLM2's int8 layer
 * products (30 layers, 2-core Zen 5, the two libraries alternating in one process, equal outputs): 5 rows 1.31x as
 * fast, 6 1.27x, 7 1.20x, 8 1.16x, 12 1.10x, 16 1.13x; 1-4 rows run the same code. */
DK_I8_PANEL_TILE(1, 5)
DK_I8_PANEL_TILE(1, 6)
DK_I8_PANEL_TILE(1, 7)
DK_I8_PANEL_TILE(1, 8)
#define I8_PANEL_ROWS 8
#define I8_PANEL_SUMS(x, n, wp) DK_PANEL_SUMS_8(i8_panel, x, n, wp)
#define DK_HAVE_I16 1
#elif defined(__AVX2__) && defined(__FMA__)
/* AVX2: 16 weights widened to int16 and one `vpmaddwd` per 8 outputs. Two pairs a turn with each half widened from
 * memory: the loop had loaded each 32 bytes twice (a 256-bit load for the extract, a 128-bit one for the low half),
 * tested every pair for its prefetch and copied its accumulators each turn (34 instructions per 64 bytes, now 19);
 * SmolLM2's one-row int8 products in cache 1.43-1.73x as fast (2-core Zen 3, equal outputs), a batch-1 int8 token
 * 1.04x (from memory it is the memory's). */
#define DK_I8_PANEL_TILE(P, M)                                                                                  \
    static void i8_panel_tile_##P##_##M(const int16_t* x, int64_t pairs, const int8_t* w, float* sums) {       \
        float total[P][2][M][8];                                                                                \
        memset(total, 0, sizeof total);                                                                         \
        for (int64_t j0 = 0; j0 < pairs; j0 += I8_PAIRS_CHUNK) {                                                \
            int64_t j1 = j0 + I8_PAIRS_CHUNK < pairs ? j0 + I8_PAIRS_CHUNK : pairs;                             \
            __m256i acc[P][2][M];                                                                               \
            for (int q = 0; q < P; ++q)                                                                         \
                for (int m = 0; m < M; ++m) acc[q][0][m] = acc[q][1][m] = _mm256_setzero_si256();               \
            /* two pairs (a 64-byte line of a panel) a turn, so one prefetch a line with no test; each half     \
             * widened straight from memory (the load folded into `vpmovsxbw`) */                               \
            int64_t j = j0;                                                                                     \
            for (; j < j1; j += 2) {                                                                            \
                int two = j + 1 < j1;                                                                           \
                for (int q = 0; q < P; ++q)                                                                     \
                    __builtin_prefetch(w + (q * pairs + j) * 2 * PANEL + I8_PANEL_PREFETCH);                    \
                for (int t = 0; t < 1 + two; ++t) {                                                             \
                    __m256i xb[M];                                                                              \
                    for (int m = 0; m < M; ++m) {                                                               \
                        int32_t pair;                                                                           \
                        memcpy(&pair, x + m * pairs * 2 + 2 * (j + t), sizeof pair);                            \
                        xb[m] = _mm256_set1_epi32(pair);                                                        \
                    }                                                                                           \
                    for (int q = 0; q < P; ++q) {                                                               \
                        const int8_t* wq = w + (q * pairs + j + t) * 2 * PANEL;                                 \
                        __m256i lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)wq));                 \
                        __m256i hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(wq + 16)));          \
                        for (int m = 0; m < M; ++m) {                                                           \
                            acc[q][0][m] = _mm256_add_epi32(acc[q][0][m], _mm256_madd_epi16(lo, xb[m]));        \
                            acc[q][1][m] = _mm256_add_epi32(acc[q][1][m], _mm256_madd_epi16(hi, xb[m]));        \
                        }                                                                                       \
                    }                                                                                           \
                }                                                                                               \
            }                                                                                                   \
            for (int q = 0; q < P; ++q)                                                                         \
                for (int h = 0; h < 2; ++h)                                                                     \
                    for (int m = 0; m < M; ++m)                                                                 \
                        _mm256_storeu_ps(total[q][h][m], _mm256_add_ps(_mm256_loadu_ps(total[q][h][m]),         \
                                                                       _mm256_cvtepi32_ps(acc[q][h][m])));      \
        }                                                                                                       \
        for (int q = 0; q < P; ++q)                                                                             \
            for (int m = 0; m < M; ++m)                                                                         \
                for (int k = 0; k < PANEL; ++k) sums[(m * P + q) * PANEL + k] = total[q][k / 8][m][k % 8];      \
    }
DK_I8_PANEL_TILE(1, 1)
DK_I8_PANEL_TILE(1, 2)
DK_I8_PANEL_TILE(1, 3)
DK_I8_PANEL_TILE(1, 4)
#define DK_HAVE_I16 1
#else
#define DK_HAVE_I16 0
#endif
#ifndef I8_PANEL_ROWS  /* 4 rows a block (PANEL_ROWS) where the tiles stop at 4 */
#define I8_PANEL_ROWS PANEL_ROWS
#define I8_PANEL_SUMS(x, n, wp) DK_PANEL_SUMS(i8_panel, x, n, wp)
#endif

static void i8_block(const panel_operands* ops, int64_t p, int64_t m, int64_t nm, float* sums) {
    int64_t pairs = (ops->in + 1) / 2;
#if DK_HAVE_I16
    const int16_t* xm = (const int16_t*)ops->x + m * pairs * 2;
    const int8_t* wp = (const int8_t*)ops->w + p * pairs * 2 * PANEL;
    I8_PANEL_SUMS(xm, pairs, wp);
#else
    (void)pairs; (void)p; (void)m; (void)nm; (void)sums;
#endif
}

/* The float path's block (a row that is not finite, or no AVX2): the float rows times the int8 panels, serially. */
static void i8_block_float(const panel_operands* ops, int64_t p, int64_t m, int64_t nm, float* sums) {
    int64_t in = ops->in, pairs = (in + 1) / 2;
    const float* x = ops->xf + m * in;
    const int8_t* wq = (const int8_t*)ops->w + p * pairs * 2 * PANEL;
    for (int64_t k = 0; k < nm; ++k)
        for (int64_t o = 0; o < PANEL; ++o) {
            float t = 0;
            for (int64_t i = 0; i < in; ++i) t += x[k * in + i] * (float)wq[((i / 2) * PANEL + o) * 2 + i % 2];
            sums[k * PANEL + o] = t;
        }
}

void dk_linear_i8(const float* x, int64_t rows, int64_t in, const int8_t* panels, const float* scale,
                  const float* bias, const float* residual, float* out, int64_t out_dim) {
    int64_t pairs = (in + 1) / 2;
    int16_t* xq = NULL;
    float* xscale = NULL;
    if (DK_HAVE_I16) {
        xq = calloc((size_t)(rows * pairs * 2), sizeof(int16_t));  /* zero past an odd `in` */
        xscale = malloc((size_t)rows * sizeof(float));
        int finite = xq != NULL && xscale != NULL;
        for (int64_t m = 0; m < rows && finite; ++m)
            finite = quantize_rows_i16(x + m * in, 1, in, xq + m * pairs * 2, xscale + m);
        if (!finite) {
            free(xq);
            free(xscale);
            xq = NULL;
            xscale = NULL;
        }
    }
    panel_operands ops = {xq, x, in, panels};
    panel_product(&ops, xq != NULL ? i8_block : i8_block_float, xq != NULL ? I8_PANEL_ROWS : PANEL_ROWS, rows, out_dim,
                  xq != NULL ? xscale : NULL, scale, bias, residual, out);
    free(xq);
    free(xscale);
}

/* ---- float32 products of a few rows ----------------------------------------------------------------------------
 * y = x @ W^T (+ residual) (+ bias) for float32 rows x [rows, in] (batch-1 decode, small batches, speculative
 * verification) and a weight W [out, in] in its own row-major layout, 1 to GEMV_MAX_ROWS rows. torch's single-row
 * product streams the weights on one core, and oneDNN's blocked copy reads them at ~2/3 of the bandwidth for 2-8
 * rows; here each of torch's OpenMP threads owns a range of output rows and streams that part of W front to back,
 * one weight row at a time, dotting every activation row with it (`gemv_rows`).
 *
 * One stream per core is what the memory system reads fastest. On a 2-core Zen 5, SmolLM2's products for one row
 * (538 MB: 30 layers and the LM head) took 0.81-0.86x the time of the column-major kernel this replaced (weights
 * [in, out], 8 input rows' runs interleaved, each thread half of the inputs), 2 rows 0.82-0.87x, 4 rows 0.90x,
 * 8 rows 1.07-1.25x, and a whole float32 token 0.85x (two engines alternating in one process, same tokens); a
 * plain read of the same bytes with a prefetch 4 KB ahead ran at about the speed of the new kernel. The prefetch
 * runs GEMV_PREFETCH_ROW floats per activation row ahead of the stream: the more rows, the longer each weight line
 * takes to consume, the earlier it must be asked for (the hardware prefetcher stops at 4 KB pages; the software
 * prefetch carries the stream across them).
 *
 * Each output is summed by one thread, in the same order whatever the thread count and however many rows are
 * multiplied together (`gemv_pass`): results depend neither on threads nor on the batch. Every step of a sum is
 * one fused multiply-add where the CPU has FMA (`gemv_fma8`/`gemv_fmaf`), else a multiply and an add. */
/* Rows up to which a step's float32 products run here rather than on torch's prepacked oneDNN weights (more rows
 * than that take the fused decoder's per-layer path). On a 2-core Zen 3 (AVX2), whole float32 decode steps of SmolLM2
 * by rows (two engines in one process, this limit at 12 and at 64, steps alternating, 4 rounds; `gemv_tiles` from 13
 * rows): 13 rows 1.30x as fast here, 16 rows 1.27x, 24 rows 1.13x, 32 rows 1.02x, 48 rows 1.07x, 64 rows 0.98x (noisy
 * rounds: 0.75-1.39x). Up to 24 rows, then: a batch of 8 whose speculation adds a verification row or two, a
 * batch-1 draft of up to 23 tokens, a batch of 16, and each row's result the same whichever of those it is in.
 * AVX-512's groups of 8 rows were not measured past 8 rows: 8 there. */
#if defined(__AVX512F__)
#define GEMV_MAX_ROWS 8
#else
#define GEMV_MAX_ROWS 24
#endif
#ifndef GEMV_PREFETCH_ROW
#define GEMV_PREFETCH_ROW 1024
#endif
/* The floats per activation row dk_gemv prefetches ahead, process-wide: GEMV_PREFETCH_ROW unless
 * `dk_gemv_set_prefetch` says otherwise. The software prefetch carried a 2-core Zen 5's stream across pages, but on a
 * 2-core Zen 3 a float32 token ran 1.16x as fast without it (its hardware prefetcher alone kept up, and the extra
 * requests only competed with it), so the engine measures both once per machine and sets the faster
 * (`kernels.gemv_prefetch`). A hint: no value changes. */
static int64_t gemv_prefetch_row = GEMV_PREFETCH_ROW;

/* Sets the floats per activation row that dk_gemv prefetches its weight stream ahead (0: none, the hardware
 * prefetcher alone; negative: GEMV_PREFETCH_ROW); returns the setting before. */
int64_t dk_gemv_set_prefetch(int64_t floats) {
    return __atomic_exchange_n(&gemv_prefetch_row, floats < 0 ? GEMV_PREFETCH_ROW : floats, __ATOMIC_RELAXED);
}
#ifndef GEMV_AHEAD
#define GEMV_AHEAD(rows) (__atomic_load_n(&gemv_prefetch_row, __ATOMIC_RELAXED) * (rows))
#endif

#if defined(__FMA__)
static inline v8f gemv_fma8(v8f a, v8f b, v8f c) {
    __m256 r = _mm256_fmadd_ps(_mm256_loadu_ps((const float*)&a), _mm256_loadu_ps((const float*)&b),
                               _mm256_loadu_ps((const float*)&c));
    v8f v;
    memcpy(&v, &r, sizeof v);
    return v;
}
static inline float gemv_fmaf(float a, float b, float c) { return fmaf(a, b, c); }
#else
static inline v8f gemv_fma8(v8f a, v8f b, v8f c) { return c + a * b; }
static inline float gemv_fmaf(float a, float b, float c) { return c + a * b; }
#endif

static inline float sum8(v8f a) { return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7])); }

#if defined(__AVX512F__)
/* Row-major on AVX-512: 16 columns of the inputs at a time (one zmm), two accumulators per row (inputs i and i + 16
 * of each 32), reduced in a fixed order. */
typedef __m512 gv16;
static inline gv16 gv_zero(void) { return _mm512_setzero_ps(); }
static inline gv16 gv_load(const float* p) { return _mm512_loadu_ps(p); }
static inline gv16 gv_fma(gv16 a, gv16 b, gv16 c) { return _mm512_fmadd_ps(a, b, c); }
static inline gv16 gv_add(gv16 a, gv16 b) { return _mm512_add_ps(a, b); }
static inline void gv_store(float* p, gv16 v) { _mm512_storeu_ps(p, v); }
/* rows dotted with one weight row per pass over it (the others re-read it from L1): 8 x 2 accumulators fit 32 zmm */
#ifndef GEMV_PASS_ROWS
#define GEMV_PASS_ROWS 8
#endif

/* The sum of 16 lanes, in a fixed order (halves added, then halves of those): no trip through memory, whose wide
 * store and narrow reloads stalled 8-row products. */
static inline float gv_sum(gv16 v) {
    __m256 upper = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), upper);
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_shuffle_ps(q, q, 1));
    return _mm_cvtss_f32(q);
}

/* sums[m * stride] = x[m] . wr over `in` inputs for `g` activation rows (a constant where inlined, so the 2g
 * accumulators stay in registers), each weight vector loaded once for them; with `ahead`, the weight stream is
 * prefetched that many floats ahead. Each row is summed in the same order whatever g: two accumulators (inputs i and
 * i + 16 of each 32), the 16-wide tail into the first, their lanes added (`gv_sum`), then the scalar tail. */
static inline __attribute__((always_inline)) void gemv_pass(const float* x, int64_t ld, int g, const float* wr,
                                                           int64_t in, int64_t ahead, float* sums, int64_t stride) {
    gv16 a0[GEMV_PASS_ROWS], a1[GEMV_PASS_ROWS];
    for (int m = 0; m < g; ++m) a0[m] = a1[m] = gv_zero();
    int64_t i = 0;
    for (; i + 32 <= in; i += 32) {
        if (ahead) {  /* both lines of the 32 floats: one prefetch per line */
            __builtin_prefetch(wr + i + ahead);
            __builtin_prefetch(wr + i + ahead + 16);
        }
        gv16 w0 = gv_load(wr + i), w1 = gv_load(wr + i + 16);
        for (int m = 0; m < g; ++m) {
            a0[m] = gv_fma(gv_load(x + m * ld + i), w0, a0[m]);
            a1[m] = gv_fma(gv_load(x + m * ld + i + 16), w1, a1[m]);
        }
    }
    for (; i + 16 <= in; i += 16) {
        gv16 w0 = gv_load(wr + i);
        for (int m = 0; m < g; ++m) a0[m] = gv_fma(gv_load(x + m * ld + i), w0, a0[m]);
    }
    for (int m = 0; m < g; ++m) {
        float s = gv_sum(gv_add(a0[m], a1[m]));
        for (int64_t j = i; j < in; ++j) s = gemv_fmaf(x[m * ld + j], wr[j], s);
        sums[m * stride] = s;
    }
}

#else
/* The most activation rows a pass over a weight row dots with it: their two accumulators each and the two weight
 * vectors fit AVX2's 16 registers. */
#define GEMV_PASS_ROWS 6
/* Keeps the weight vector in a register for all the rows: GCC otherwise folds its load into each row's multiply-add,
 * loading it once per row, and Zen 3's two vector loads a cycle then bound the loop. */
#if defined(__x86_64__) && defined(__GNUC__) && defined(__AVX__)
#define GEMV_IN_REGISTER(v) __asm__("" : "+x"(v))
#else
#define GEMV_IN_REGISTER(v) ((void)0)
#endif

/* sums[m * stride] = x[m] . wr for `g` activation rows (a constant where inlined, so the 2g accumulators stay in
 * registers), each weight vector loaded once for them. Every sum runs in one order whatever g: two 8-lane
 * accumulators (inputs i..i+7 and i+8..i+15 of each 16; two, so that one row's sums are two chains of multiply-adds,
 * not one), the 8-wide tail into the first, the two added and their lanes added (`sum8`), then the scalar tail: a
 * row's result does not depend on the batch. */
static inline __attribute__((always_inline)) void gemv_pass(const float* x, int64_t ld, int g, const float* wr,
                                                           int64_t in, int64_t ahead, float* sums, int64_t stride) {
    v8f acc[GEMV_PASS_ROWS], acc1[GEMV_PASS_ROWS];
    for (int m = 0; m < g; ++m) acc[m] = acc1[m] = splat8(0.0f);
    int64_t i = 0;
    for (; i + 16 <= in; i += 16) {
        if (ahead) __builtin_prefetch(wr + i + ahead);  /* one prefetch per 64-byte line */
        v8f wv = load8(wr + i), wv1 = load8(wr + i + 8);
        if (g > 1) { GEMV_IN_REGISTER(wv); GEMV_IN_REGISTER(wv1); }
        for (int m = 0; m < g; ++m) {
            acc[m] = gemv_fma8(load8(x + m * ld + i), wv, acc[m]);
            acc1[m] = gemv_fma8(load8(x + m * ld + i + 8), wv1, acc1[m]);
        }
    }
    for (; i + 8 <= in; i += 8) {
        v8f wv = load8(wr + i);
        for (int m = 0; m < g; ++m) acc[m] = gemv_fma8(load8(x + m * ld + i), wv, acc[m]);
    }
    for (int m = 0; m < g; ++m) {
        float s = sum8(acc[m] + acc1[m]);
        for (int64_t j = i; j < in; ++j) s = gemv_fmaf(x[m * ld + j], wr[j], s);
        sums[m * stride] = s;
    }
}

/* Activation rows from which AVX2's products take `gemv_tiles` rather than `gemv_pass` over one weight row at a time:
 * the single stream of the passes reads the memory faster, the tiles multiply faster. SmolLM2-sized products (65536 x
 * 576 and 24576 x 1536 weights, 2 threads, 2-core Zen 3, the two libraries alternating in one process, every output
 * equal), the tiles' speed over the passes': 8 rows 0.79-1.00x, 12 rows 0.86-1.16x, 13 rows 1.03x, 16 rows
 * 1.14-1.22x, 24 rows 1.21-1.47x, 32 rows 1.29-1.53x. */
#ifndef GEMV_TILE_MIN_ROWS
#define GEMV_TILE_MIN_ROWS 13
#endif
/* A tile: GEMV_TILE_R weight rows by GEMV_TILE_M activation rows, over GEMV_TILE_K inputs of each at a time (7 rows
 * of 1024 floats, 28 KB, stay in L1 for the tile's second chain). */
#define GEMV_TILE_R 3
#define GEMV_TILE_M 4
#define GEMV_TILE_K 1024
/* Output rows of a piece (between two side prefetches) on the tiled path: whole tiles of GEMV_TILE_R. */
#define GEMV_TILE_SIDE_ROWS 18

/* One of the two chains of each of R x G outputs (`acc`, [R][GEMV_TILE_M]) carried over inputs [k0, k1) (multiples
 * of 16): the 8-float vectors at k0, k0 + 16, ... of weight rows `w` (`in` floats apart) and activation rows `x` (`ld`
 * apart); the caller offsets both by 8 for the second chain. Each output's two chains are independent sums, so one can
 * run after the other: one accumulator an output at a time (12 of AVX2's 16 registers, the R weight vectors and one
 * activation vector beside them), and each step loads R + G vectors for R x G multiply-adds, 7 for 12, where both
 * chains at once allow 2 x 3 (5 for 6) and `gemv_pass` 1 x 6 (7 for 6). Loads bind these products on a Zen 3 (about
 * 3.8 vector loads a ns a core, against 9.6 multiply-adds: in L1, a 3 x 4 loop of one chain ran 6.3 multiply-adds a
 * ns, a 2 x 3 loop of both 4.6). */
static inline __attribute__((always_inline)) void gemv_tile_chain(const float* x, int64_t ld, int G, const float* w,
                                                                 int64_t in, int R, int64_t k0, int64_t k1,
                                                                 v8f acc[][GEMV_TILE_M]) {
    v8f a[GEMV_TILE_R][GEMV_TILE_M];
    for (int r = 0; r < R; ++r)
        for (int m = 0; m < G; ++m) a[r][m] = acc[r][m];
    for (int64_t i = k0; i < k1; i += 16) {
        v8f u[GEMV_TILE_R];
        for (int r = 0; r < R; ++r) {
            u[r] = load8(w + r * in + i);
            GEMV_IN_REGISTER(u[r]);
        }
        for (int m = 0; m < G; ++m) {
            v8f xv = load8(x + m * ld + i);
            GEMV_IN_REGISTER(xv);
            for (int r = 0; r < R; ++r) a[r][m] = gemv_fma8(xv, u[r], a[r][m]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int m = 0; m < G; ++m) acc[r][m] = a[r][m];
}

/* sums of R (1-3) weight rows `in` floats apart by G (1-4) activation rows `ld` apart into y[m * out + r]: each
 * output summed exactly as `gemv_pass` sums it (its two chains of multiply-adds: the first 8 of each 16 inputs then
 * the 8-wide tail, and the second 8 of each 16; `sum8` of the two; the scalar tail), so a row's result is the same
 * on either path, whatever the rows beside it. */
static inline __attribute__((always_inline)) void gemv_tile(const float* x, int64_t ld, int G, const float* w,
                                                           int64_t in, int R, float* y, int64_t out) {
    v8f c0[GEMV_TILE_R][GEMV_TILE_M], c1[GEMV_TILE_R][GEMV_TILE_M];
    for (int r = 0; r < R; ++r)
        for (int m = 0; m < G; ++m) c0[r][m] = c1[r][m] = splat8(0.0f);
    int64_t full = in / 16 * 16, i = full;
    for (int64_t k0 = 0; k0 < full; k0 += GEMV_TILE_K) {
        int64_t k1 = full - k0 < GEMV_TILE_K ? full : k0 + GEMV_TILE_K;
        gemv_tile_chain(x, ld, G, w, in, R, k0, k1, c0);
        gemv_tile_chain(x + 8, ld, G, w + 8, in, R, k0, k1, c1);
    }
    if (i + 8 <= in) {
        for (int r = 0; r < R; ++r)
            for (int m = 0; m < G; ++m) c0[r][m] = gemv_fma8(load8(x + m * ld + i), load8(w + r * in + i), c0[r][m]);
        i += 8;
    }
    for (int r = 0; r < R; ++r)
        for (int m = 0; m < G; ++m) {
            float s = sum8(c0[r][m] + c1[r][m]);
            for (int64_t j = i; j < in; ++j) s = gemv_fmaf(x[m * ld + j], w[r * in + j], s);
            y[m * out + r] = s;
        }
}

/* y[m, o] for outputs [o0, o1) and GEMV_TILE_MIN_ROWS rows or more, in `gemv_tile`s: GEMV_TILE_R weight rows at a
 * time on the outside, read from memory once, every GEMV_TILE_M activation rows multiplied with them while they are
 * in L1. Before each group of GEMV_TILE_M rows the next weight rows' share of lines is asked for (the whole next tile
 * over the groups): the hardware prefetcher does not follow three short interleaved streams. Asking evenly, a line a
 * row each step of the first group's loop, measured 0.82-0.94x as fast from 12 rows up; two or four tiles ahead, or
 * into L2 only, 0.97-1.01x. A hint: a line past the weight's end is never read. */
static void gemv_tiles(const float* x, int64_t rows, const float* w, int64_t in, int64_t out, int64_t o0, int64_t o1,
                       float* y) {
    int64_t groups = (rows + GEMV_TILE_M - 1) / GEMV_TILE_M, tile_bytes = GEMV_TILE_R * in * (int64_t)sizeof(float);
    for (int64_t o = o0; o < o1; o += GEMV_TILE_R) {
        int r = o1 - o < GEMV_TILE_R ? (int)(o1 - o) : GEMV_TILE_R;
        const float* wr = w + o * in;
        const char* next = (const char*)(wr + GEMV_TILE_R * in);
        for (int64_t q = 0; q < groups; ++q) {
            for (int64_t b = tile_bytes * q / groups; b < tile_bytes * (q + 1) / groups; b += 64)
                __builtin_prefetch(next + b);
            int64_t m0 = q * GEMV_TILE_M;
            int g = rows - m0 < GEMV_TILE_M ? (int)(rows - m0) : GEMV_TILE_M;
            const float* xg = x + m0 * in;
            float* yg = y + m0 * out + o;
#define GEMV_TILE(G, R) gemv_tile(xg, in, G, wr, in, R, yg, out)
            switch (r * 8 + g) {  /* constant sizes: accumulators in registers */
                case 9: GEMV_TILE(1, 1); break;
                case 10: GEMV_TILE(2, 1); break;
                case 11: GEMV_TILE(3, 1); break;
                case 12: GEMV_TILE(4, 1); break;
                case 17: GEMV_TILE(1, 2); break;
                case 18: GEMV_TILE(2, 2); break;
                case 19: GEMV_TILE(3, 2); break;
                case 20: GEMV_TILE(4, 2); break;
                case 25: GEMV_TILE(1, 3); break;
                case 26: GEMV_TILE(2, 3); break;
                case 27: GEMV_TILE(3, 3); break;
                default: GEMV_TILE(4, 3); break;
            }
#undef GEMV_TILE
        }
    }
}
#define GEMV_TILES 1

#endif

/* y[m, o] = x[m] . w[o] for outputs [o0, o1) of a row-major [out, in] weight: one weight row at a time, so each
 * thread streams its part of the weight front to back as one run (the hardware prefetcher's best case, with a
 * software prefetch ahead of it across pages), every activation row dotted with each weight vector while it is in a
 * register (a multiply-add and an activation load a row, the weight load shared), up to GEMV_PASS_ROWS rows a pass
 * (`gemv_pass`; later passes re-read the weight row from L1). Interleaving two weight rows instead (each activation
 * load serving both) was slower at every row count: 4 rows 1.29 against 1.08, 8 rows 1.48 against 1.34 (times of one
 * row; SmolLM2's products, 2-core Zen 5); so were 2-8 weight rows a tile on a 2-core Zen 3 (1-4 activation rows:
 * 1.05-1.22x), whatever their loads saved: the memory system reads one stream a core fastest.
 *
 * AVX2 once took 2 rows a pass in AVX-512's order (four 8-lane accumulators a row): 12 loads for 8 multiply-adds,
 * which Zen 3's two vector loads a cycle bound, while the memory stream stood during the later passes. With two
 * accumulators a row and 6 rows a pass, SmolLM2's float32 products on a 2-core Zen 3 (both builds alternating in one
 * process, 15 rounds, the faster prefetch setting of each): 1 and 2 rows the same, 6 rows 0.88x, 8 rows 0.84x, 11
 * rows 0.85x the time. One accumulator a row (12 rows a pass) ran 8 and 11 rows a little faster still, but a single
 * row 1.06x slower: its one chain of multiply-adds. */
static void gemv_rows(const float* x, int64_t rows, const float* w, int64_t in, int64_t out, int64_t o0, int64_t o1,
                      float* y) {
    int64_t ahead = GEMV_AHEAD(rows);
    for (int64_t o = o0; o < o1; ++o) {
        const float* wr = w + o * in;
        for (int64_t m0 = 0; m0 < rows; m0 += GEMV_PASS_ROWS) {
            int64_t g = rows - m0 < GEMV_PASS_ROWS ? rows - m0 : GEMV_PASS_ROWS;
            const float* xg = x + m0 * in;
            float* yg = y + m0 * out + o;
            int64_t pf = m0 == 0 ? ahead : 0;  /* the first pass reads the weight row from memory, later ones L1 */
#define GEMV_PASS(G) gemv_pass(xg, in, G, wr, in, pf, yg, out)
            switch (g) {  /* constant sizes: accumulators in registers */
                case 1: GEMV_PASS(1); break;
                case 2: GEMV_PASS(2); break;
                case 3: GEMV_PASS(3); break;
                case 4: GEMV_PASS(4); break;
                case 5: GEMV_PASS(5); break;
#if GEMV_PASS_ROWS >= 8
                case 6: GEMV_PASS(6); break;
                case 7: GEMV_PASS(7); break;
#endif
                default: GEMV_PASS(GEMV_PASS_ROWS); break;
            }
#undef GEMV_PASS
        }
    }
}

/* The most rows dk_gemv takes in this build (GEMV_MAX_ROWS). */
int dk_gemv_max_rows(void) { return GEMV_MAX_ROWS; }

/* Returns 0, or -1 (nothing computed) for a row count outside 1..GEMV_MAX_ROWS. */
int dk_gemv(const float* x, int64_t rows, const float* w, int64_t in, int64_t out, const float* bias,
            const float* residual, float* y) {
    if (rows < 1 || rows > GEMV_MAX_ROWS) return -1;
#ifdef _OPENMP
#pragma omp parallel
    {
        int64_t parts = omp_get_num_threads(), part = omp_get_thread_num();
#else
    {
        int64_t parts = 1, part = 0;
#endif
        int64_t o0 = out * part / parts, o1 = out * (part + 1) / parts;
        if (o0 < o1) {
            /* GEMV_SIDE_ROWS output rows at a time, each output computed as in one call */
            int64_t side = GEMV_SIDE_ROWS;
#ifdef GEMV_TILES
            if (rows >= GEMV_TILE_MIN_ROWS) side = GEMV_TILE_SIDE_ROWS;
#endif
            int64_t pieces = (o1 - o0 + side - 1) / side;
            for (int64_t k = 0; k < pieces; ++k) {
                dk_side_prefetch_share(part, parts, k, pieces);
                int64_t a = o0 + k * side, b = a + side < o1 ? a + side : o1;
#ifdef GEMV_TILES
                if (rows >= GEMV_TILE_MIN_ROWS) {
                    gemv_tiles(x, rows, w, in, out, a, b, y);
                    continue;
                }
#endif
                gemv_rows(x, rows, w, in, out, a, b, y);
            }
            for (int64_t m = 0; m < rows; ++m)
                for (int64_t o = o0; o < o1; ++o) {
                    float v = y[m * out + o];
                    if (residual != NULL) v = residual[m * out + o] + v;
                    if (bias != NULL) v = v + bias[o];
                    y[m * out + o] = v;
                }
        }
    }
    return 0;
}
