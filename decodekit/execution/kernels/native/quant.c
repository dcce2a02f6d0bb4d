/* decodekit's products of GGUF quantized weights, run as the file stores them.
 *
 * A GGUF weight [out, in] is `out` rows of blocks: Q4_0, Q4_1 and Q8_0 blocks of 32 weights (18, 20, 34 bytes),
 * Q4_K and Q6_K super-blocks of 256 (144, 210 bytes). These products read those bytes as they lie (row after row,
 * as in the file) and dequantize each block in registers inside the product, 32 weights (a "chunk") at a time:
 *
 *   Q4_0  w = d * (q - 8)            q: 4-bit, d: fp16
 *   Q4_1  w = d * q + m              q: 4-bit, d, m: fp16
 *   Q8_0  w = d * q                  q: int8
 *   Q4_K  w = (d * sc) * q - dmin * mn    q: 4-bit; sc, mn: the 6-bit scale and min of the 32-weight sub-block
 *   Q6_K  w = (d * sc) * (q - 32)    q: 6-bit; sc: the int8 scale of the 16-weight sub-block
 *
 * Each weight is computed with the operations, in the order, of gguf-py's `dequantize` (which transformers uses to
 * load a GGUF in float32), and every product before the last rounding is exact in float32 (fp16's 11 significant
 * bits times at most 7 of a scale and 6 of a quant), so a fused multiply-add gives the same float: the weights
 * multiplied are exactly the float32 weights of the dequantized model. Activations stay float32 (llama.cpp rounds
 * them to 8 bits for its integer dot products; that is why VNNI's int8 and AVX512-BF16's bf16 dot products are not
 * used here: neither multiplies these float32 weights by float32 activations), except in the fixed-point products
 * below (AVX2's Q4_0, Q4_1 and Q8_0, AVX-512's Q4_0 and Q4_1: activations rounded to 16-bit per block of 32, unless
 * DK_QUANT_FLOAT_ACTIVATIONS). A float product therefore equals the float32 product of the dequantized weight up to
 * the order of its sums.
 *
 * Three code paths, chosen at run time by the `isa` argument (`dk_quant_isa` says the best this library was compiled
 * with; native.py picks it unless DECODEKIT_QUANT_ISA asks for a lower one):
 *   2  AVX-512: 4-bit quants index a 16-entry table of the block's 16 possible weights (`vpermps`: one permute per
 *      16 weights instead of a conversion and a multiply-add), 16 lanes; Q4_0 and Q4_1 in fixed point on 512-bit
 *      integer tiles (`i16_tile_avx512`, the AVX2 fixed-point products' arithmetic in an order of its own);
 *   1  AVX2 + FMA: quants widened to int32 (8 bytes at a time, from memory) and converted, 8 lanes; Q4_0, Q4_1 and
 *      Q8_0 in fixed point (`i16_tile_avx2`);
 *   0  portable C: GCC/Clang vector extensions of 8 floats (whatever the target makes of them).
 *
 * The product y[m, o] = sum_i x[m, i] w[o, i] runs in tiles of R weight rows x M activation rows (1x1-1x4, and
 * 1x5-1x8 and 2x3-2x5 on AVX-512): a chunk of each weight row is dequantized once and multiplied into every
 * activation row of the tile. Groups of 4 output rows are split over torch's OpenMP threads. From
 * QUANT_PANEL_MIN_ROWS activation rows, 21 on AVX-512 (batches, prefill chunks), a group is 16 output rows,
 * dequantized once into a panel in cache and multiplied from there (2x4 tiles on AVX-512), so each weight is
 * dequantized once per product rather than once per 4 (or 8) activation rows. Each output's sum runs in one fixed
 * order (chunk by chunk, even and odd vectors in two accumulators), whatever the tile, the panel, the number of rows
 * or of threads: a row's result does not depend on the batch it is multiplied in, nor on the thread count.
 * Q4_1 interleaved by 8 rows (DK_Q4_1X8, opt-in) has tiles of its own and an order of its own, below.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
/* GCC turns a group's store of its few outputs (no bias, no residual) into a call to memcpy: a library call and a
 * vzeroupper per four outputs, ~3.5% of a batch-1 GGUF token's samples under perf. Without it a token measured
 * 0.98-1.09x as fast, ~1.03x in the median (2-core Zen 5, the two libraries alternating in one process, 30-40 rounds
 * each, same tokens). */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-tree-loop-distribute-patterns")
#endif
#if (defined(__AVX2__) && defined(__FMA__)) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define DK_QUANT_AVX2 1
#else
#define DK_QUANT_AVX2 0
#endif
#if defined(__AVX512F__) && DK_QUANT_AVX2
#define DK_QUANT_AVX512 1
#else
#define DK_QUANT_AVX512 0
#endif

/* ggml's type ids (GGMLQuantizationType) */
enum { DK_Q4_0 = 2, DK_Q4_1 = 3, DK_Q8_0 = 8, DK_Q4_K = 12, DK_Q6_K = 14 };
/* Q4_1 with each 8 rows' blocks interleaved (`Q4_1x8` in quant.py, decodekit's own id): the AVX2 path's layout of
 * Q4_1, below. */
enum { DK_Q4_1X8 = 103 };
/* decodekit's own layouts of Q4_0 and Q4_1 rows for the AVX2 path's products (`kernels.quant.group_blocks`): each
 * run of 8 blocks (the last run 1-8) as its blocks' fp16 scales, then (Q4_1) their fp16 mins, then their 16-byte
 * quants one after another: the same bytes a row. */
enum { DK_Q4_0G = 104, DK_Q4_1G = 105 };
/* Blocks a run of the grouped layouts holds (the last run of a row: what is left). */
#define GROUP_BLOCKS 8
/* ggml's F32, here only inside the library: a row of weights already dequantized (the panels of many-row products,
 * below); no entry point takes it. */
enum { DK_F32 = 0 };

#define CHUNK 32
#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* Weights per block and bytes per block of a type (0 for a type these kernels do not take). */
static int64_t block_weights(int64_t kind) {
    return kind == DK_Q4_K || kind == DK_Q6_K ? 256 : 32;
}

static int64_t block_bytes(int64_t kind) {
    switch (kind) {
        case DK_Q4_0: return 18;
        case DK_Q4_1: return 20;
        case DK_Q4_1X8: return 20;
        case DK_Q4_0G: return 18;
        case DK_Q4_1G: return 20;
        case DK_Q8_0: return 34;
        case DK_Q4_K: return 144;
        case DK_Q6_K: return 210;
        default: return 0;
    }
}

/* Whether a type is a grouped layout of Q4_0 or Q4_1 (DK_Q4_0G, DK_Q4_1G), and the type its blocks hold. */
static inline int is_grouped(int64_t kind) { return kind == DK_Q4_0G || kind == DK_Q4_1G; }
static inline int grouped_base(int64_t kind) { return kind == DK_Q4_0G ? DK_Q4_0 : DK_Q4_1; }

/* A grouped row (`blocks` blocks of DK_Q4_0G or DK_Q4_1G at src) written in the file's layout at dst. A run of n
 * blocks lies as their n fp16 scales, (Q4_1) their n fp16 mins, then their n x 16 quant bytes:
 * `kernels.quant.group_blocks`' order. */
static void ungroup_row(int64_t kind, const uint8_t* src, uint8_t* dst, int64_t blocks) {
    int one = kind == DK_Q4_1G;
    int64_t bytes = one ? 20 : 18, head = bytes - 16;
    for (int64_t first = 0; first < blocks; first += GROUP_BLOCKS) {
        int64_t n = blocks - first < GROUP_BLOCKS ? blocks - first : GROUP_BLOCKS;
        const uint8_t* s = src + first * bytes;
        for (int64_t j = 0; j < n; ++j) {
            uint8_t* b = dst + (first + j) * bytes;
            memcpy(b, s + 2 * j, 2);
            if (one) memcpy(b + 2, s + 2 * n + 2 * j, 2);
            memcpy(b + head, s + head * n + 16 * j, 16);
        }
    }
}

/* Whether a type's blocks are super-blocks of 8 chunks (whose constants the AVX2 path computes once for all 8). */
static inline int is_kquant(int64_t kind) {
    return kind == DK_Q4_K || kind == DK_Q6_K;
}

/* An IEEE half (read unaligned) widened to float, exactly (numpy's float16 -> float32): one F16C instruction where
 * the CPU has it (every AVX2 one), else by its bits. */
static inline float half_at(const uint8_t* p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#endif
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu, bits;
    if (exponent == 0) {  /* zero or subnormal: mantissa * 2^-24, exact in float */
        float f = (float)mantissa * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    if (exponent == 31) bits = sign | 0x7f800000u | (mantissa << 13);  /* infinity, NaN */
    else bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Q4_K's 6-bit scale and min of sub-block j (ggml's get_scale_min_k4; gguf-py's Q4_K.get_scale_min). */
static inline void q4k_scale_min(const uint8_t* s, int64_t j, int* sc, int* mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 15) | ((s[j - 4] >> 2) & 0x30);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
    }
}

/* ---- the portable path: chunk c (weights 32c..32c+31) of a row, dequantized into w[32] ------------------------ */
ALWAYS_INLINE void chunk_scalar(int kind, const uint8_t* row, int64_t c, float* w) {
    if (kind == DK_F32) {
        memcpy(w, (const float*)row + c * CHUNK, CHUNK * sizeof(float));
    } else if (kind == DK_Q4_0) {
        const uint8_t* b = row + c * 18;
        float d = half_at(b);
        for (int j = 0; j < 16; ++j) {
            w[j] = d * (float)((b[2 + j] & 15) - 8);
            w[j + 16] = d * (float)((b[2 + j] >> 4) - 8);
        }
    } else if (kind == DK_Q4_1) {
        const uint8_t* b = row + c * 20;
        float d = half_at(b), m = half_at(b + 2);
        for (int j = 0; j < 16; ++j) {
            w[j] = d * (float)(b[4 + j] & 15) + m;
            w[j + 16] = d * (float)(b[4 + j] >> 4) + m;
        }
    } else if (kind == DK_Q8_0) {
        const uint8_t* b = row + c * 34;
        float d = half_at(b);
        for (int j = 0; j < 32; ++j) w[j] = (float)(int8_t)b[2 + j] * d;
    } else if (kind == DK_Q4_K) {
        const uint8_t* b = row + (c / 8) * 144;
        int64_t j = c % 8;
        int sc, mn;
        q4k_scale_min(b + 4, j, &sc, &mn);
        float ds = half_at(b) * (float)sc, dm = half_at(b + 2) * (float)mn;
        const uint8_t* qs = b + 16 + 32 * (j / 2);
        int shift = 4 * (int)(j % 2);
        for (int l = 0; l < 32; ++l) w[l] = ds * (float)((qs[l] >> shift) & 15) - dm;
    } else {  /* DK_Q6_K */
        const uint8_t* b = row + (c / 8) * 210;
        int64_t k = c % 8, h = k / 4, kk = k % 4;
        const uint8_t* ql = b + 64 * h + 32 * (kk & 1);
        const uint8_t* qh = b + 128 + 32 * h;
        const int8_t* sc = (const int8_t*)(b + 192) + 8 * h + 2 * kk;
        float d = half_at(b + 208);
        float s0 = d * (float)sc[0], s1 = d * (float)sc[1];
        for (int l = 0; l < 32; ++l) {
            int q = (((ql[l] >> (4 * (kk >> 1))) & 15) | (((qh[l] >> (2 * kk)) & 3) << 4)) - 32;
            w[l] = (l < 16 ? s0 : s1) * (float)q;
        }
    }
}

typedef float dk_v8f __attribute__((vector_size(32)));

ALWAYS_INLINE dk_v8f load_v8f(const float* p) { dk_v8f v; memcpy(&v, p, sizeof v); return v; }

/* The portable path computes a K-quant's scale and min in each chunk: no super-block
 * constants (`ksuper_avx2`, `ksuper_avx512`) to compute. */
ALWAYS_INLINE void ksuper_portable(int kind, const uint8_t* sb, float* ks) { (void)kind, (void)sb, (void)ks; }

ALWAYS_INLINE void chunk_portable(int kind, const uint8_t* row, int64_t c, dk_v8f* w, const float* ks, int half) {
    (void)ks, (void)half;
    float f[CHUNK];
    chunk_scalar(kind, row, c, f);
    for (int v = 0; v < 4; ++v) w[v] = load_v8f(f + 8 * v);
}

ALWAYS_INLINE float hsum_portable(dk_v8f a) {
    return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

#if DK_QUANT_AVX2
/* ---- AVX2 + FMA: chunk c as four vectors of 8 ------------------------------------------------------------------ */

/* half_at(p) in every lane: the half broadcast, then widened (exactly, as half_at). */
ALWAYS_INLINE __m256 half_splat_avx2(const uint8_t* p) {
#if defined(__F16C__)
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return _mm256_cvtph_ps(_mm_set1_epi16((short)h));
#else
    return _mm256_set1_ps(half_at(p));
#endif
}

/* 8 bytes at p (unaligned) widened to int32, the load folded into the widening. Reading a chunk's bytes 8 at a time
 * from memory, rather than as one vector split with byte shifts and lane extracts before widening, leaves the
 * shuffle units only the widenings: a 4-bit or 8-bit chunk took 1.4-1.5x as long the other way (in cache, one row,
 * 2-core Zen 3, where the shuffles and the multiply-adds share a pipe). */
ALWAYS_INLINE __m256i widen8_avx2(const uint8_t* p, int is_signed) {
    __m128i bytes = _mm_loadl_epi64((const __m128i*)p);
    return is_signed ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes);
}

/* The 32 quants of 16 bytes of nibbles (low nibbles first), as four int32 vectors: each byte widened once, its low
 * nibble masked and its high one shifted down in the int32 lane. */
ALWAYS_INLINE void nibbles_avx2(const uint8_t* p, __m256i* q) {
    __m256i a = widen8_avx2(p, 0), b = widen8_avx2(p + 8, 0), mask = _mm256_set1_epi32(15);
    q[0] = _mm256_and_si256(a, mask);
    q[1] = _mm256_and_si256(b, mask);
    q[2] = _mm256_srli_epi32(a, 4);
    q[3] = _mm256_srli_epi32(b, 4);
}

/* 32 signed bytes of a vector widened to four int32 vectors (Q6_K's quants, computed in a vector). */
ALWAYS_INLINE void widen32_signed_avx2(__m256i bytes, __m256i* q) {
    __m128i lo = _mm256_castsi256_si128(bytes), hi = _mm256_extracti128_si256(bytes, 1);
    q[0] = _mm256_cvtepi8_epi32(lo);
    q[1] = _mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8));
    q[2] = _mm256_cvtepi8_epi32(hi);
    q[3] = _mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8));
}

/* Q6_K's 32 quants of chunk kk (0-3) of half h of a super-block, as signed bytes q - 32. */
ALWAYS_INLINE __m256i q6k_bytes(const uint8_t* b, int64_t h, int64_t kk) {
    __m256i ql = _mm256_loadu_si256((const __m256i*)(b + 64 * h + 32 * (kk & 1)));
    __m256i qh = _mm256_loadu_si256((const __m256i*)(b + 128 + 32 * h));
    __m256i lo = _mm256_and_si256(_mm256_srl_epi16(ql, _mm_cvtsi32_si128((int)(4 * (kk >> 1)))),
                                  _mm256_set1_epi8(15));
    __m256i hi = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128((int)(2 * kk))), _mm256_set1_epi8(3));
    /* hi < 4, so shifting its 16-bit lanes left by 4 moves no bit into the next byte */
    return _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), _mm256_set1_epi8(32));
}

/* A K-quant super-block's constants, computed once for its 8 chunks (`ks`, 16 floats) instead of once a chunk: Q4_K's
 * sub-block scales d * sc[j] (ks[0..7]) and negated mins -(dmin * mn[j]) (ks[8..15]), all 8 unpacked from their 12
 * bytes at once as ggml does; Q6_K's 16 sub-block scales d * sc[i]. The same products as gguf-py's, each rounded
 * once, so every weight is the float it was. Each chunk unpacked its own before (branches, two fp16 conversions, two
 * broadcasts): one weight row by one activation row in cache (1024 x 1536, one thread, 2-core Zen 3, the two
 * libraries alternating in one process, equal outputs) now 1.33-1.42x as fast for Q4_K (5.3 -> 3.9-4.1 ns a chunk;
 * Q4_1's 3.0-3.1) and 1.16x for Q6_K; 4 rows 1.07-1.19x, 32 rows (the panels) 1.05-1.11x. */
ALWAYS_INLINE void ksuper_avx2(int kind, const uint8_t* sb, float* ks) {
    if (kind == DK_Q4_K) {
        uint32_t u[3];
        memcpy(u, sb + 4, sizeof u);
        /* q4k_scale_min for j = 0-3 (low 6 bits of bytes 0-3 and 4-7) and j = 4-7 (the low or high nibble of bytes
         * 8-11, and the top 2 bits of bytes 0-3 or 4-7 above it), a byte a lane of 32-bit words */
        uint32_t sc_lo = u[0] & 0x3f3f3f3fu, mn_lo = u[1] & 0x3f3f3f3fu;
        uint32_t sc_hi = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);
        uint32_t mn_hi = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);
        __m128i sc8 = _mm_cvtsi64_si128((long long)((uint64_t)sc_hi << 32 | sc_lo));
        __m128i mn8 = _mm_cvtsi64_si128((long long)((uint64_t)mn_hi << 32 | mn_lo));
        __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sc8)), mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mn8));
        /* -(dmin * mn) by its sign bit, exactly as the scalar negation (a zero becomes -0) */
        __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32((int)0x80000000u));
        _mm256_storeu_ps(ks, _mm256_mul_ps(half_splat_avx2(sb), sc));
        _mm256_storeu_ps(ks + 8, _mm256_xor_ps(_mm256_mul_ps(half_splat_avx2(sb + 2), mn), sign));
    } else if (kind == DK_Q6_K) {
        __m256 d = half_splat_avx2(sb + 208);
        _mm256_storeu_ps(ks, _mm256_mul_ps(d, _mm256_cvtepi32_ps(widen8_avx2(sb + 192, 1))));
        _mm256_storeu_ps(ks + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(widen8_avx2(sb + 200, 1))));
    }
}

/* Chunk c of a row as four vectors; `ks` holds its super-block's constants (ksuper_avx2) for a K-quant. */
ALWAYS_INLINE void chunk_avx2(int kind, const uint8_t* row, int64_t c, __m256* w, const float* ks, int half) {
    if (kind == DK_F32) {
        for (int k = 0; k < 4; ++k) w[k] = _mm256_loadu_ps((const float*)row + c * CHUNK + 8 * k);
        return;
    }
    __m256i q[4];
    if (kind == DK_Q4_0) {
        const uint8_t* b = row + c * 18;
        __m256 d = half_splat_avx2(b);
        nibbles_avx2(b + 2, q);
        for (int v = 0; v < 4; ++v) w[v] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(q[v], _mm256_set1_epi32(8))));
    } else if (kind == DK_Q4_1) {
        const uint8_t* b = row + c * 20;
        __m256 d = half_splat_avx2(b), m = half_splat_avx2(b + 2);
        nibbles_avx2(b + 4, q);
        /* d * q is exact, so the fused d * q + m rounds once, as d * q then + m does */
        for (int v = 0; v < 4; ++v) w[v] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(q[v]), m);
    } else if (kind == DK_Q8_0) {
        const uint8_t* b = row + c * 34;
        __m256 d = half_splat_avx2(b);
        for (int v = 0; v < 4; ++v) w[v] = _mm256_mul_ps(_mm256_cvtepi32_ps(widen8_avx2(b + 2 + 8 * v, 1)), d);
    } else if (kind == DK_Q4_K) {
        const uint8_t* b = row + (c / 8) * 144;
        int64_t j = c % 8;
        __m256 ds = _mm256_broadcast_ss(ks + j), ndm = _mm256_broadcast_ss(ks + 8 + j);
        const uint8_t* qs = b + 16 + 32 * (j / 2);
        for (int v = 0; v < 4; ++v) {
            __m256i bytes = widen8_avx2(qs + 8 * v, 0), quants;
            /* an even sub-block's quants are the low nibbles, an odd one's the high ones: one operation each where
             * the caller knows which (`half`), a shift by j % 2 nibbles and a mask where not */
            if (half == 0) quants = _mm256_and_si256(bytes, _mm256_set1_epi32(15));
            else if (half == 1) quants = _mm256_srli_epi32(bytes, 4);
            else quants = _mm256_and_si256(_mm256_srl_epi32(bytes, _mm_cvtsi32_si128((int)(4 * (j % 2)))),
                                           _mm256_set1_epi32(15));
            w[v] = _mm256_fmadd_ps(ds, _mm256_cvtepi32_ps(quants), ndm);
        }
    } else {  /* DK_Q6_K */
        const uint8_t* b = row + (c / 8) * 210;
        int64_t k = c % 8, h = k / 4, kk = k % 4;
        /* sub-block scales 8h + 2kk and the next: ks[2k], ks[2k + 1] */
        __m256 s0 = _mm256_broadcast_ss(ks + 2 * k), s1 = _mm256_broadcast_ss(ks + 2 * k + 1);
        widen32_signed_avx2(q6k_bytes(b, h, kk), q);
        for (int v = 0; v < 4; ++v) w[v] = _mm256_mul_ps(v < 2 ? s0 : s1, _mm256_cvtepi32_ps(q[v]));
    }
}

ALWAYS_INLINE float hsum_avx2(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

#if DK_QUANT_AVX512
/* ---- AVX-512: chunk c as two vectors of 16 --------------------------------------------------------------------
 * A 4-bit quant takes one of 16 values per block (or sub-block): those 16 weights are computed once, in one vector,
 * and each quant picks its weight with `vpermps`, which reads only the low 4 bits of each index, so the high
 * nibbles need no mask after the shift. */
ALWAYS_INLINE void table_lookup_avx512(__m512 table, __m128i lo16, __m128i hi16, __m512* w) {
    w[0] = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(lo16), table);
    w[1] = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(hi16), table);
}

/* A block's fp16 scale at p (and, with `m`, the fp16 min after it) widened to float in every lane: exactly as
 * half_at. The 4 halves at p widened by one 128-bit `vcvtph2ps` from memory, stored, and each broadcast from there
 * by `vbroadcastss` from memory, which takes a load port only. A 512-bit `vcvtph2ps` of a broadcast half per value
 * (what this was) costs the shuffle port twice each, the port the quants' widening and `vpermps` need: in cache, one
 * Q4_1 weight row by one activation row 1.15x as fast for it (2-core Intel Xeon with AVX-512, equal outputs). The
 * asm keeps the compiler from turning either back into register shuffles (it loads the halves into a register
 * first, then widens them: 1.07x). Reads 8 bytes at p: within every block it is used on (18, 20, 34 bytes). */
#if defined(DK_SPLAT_FROM_REGISTERS)
/* On AMD's cores (built with -DDK_SPLAT_FROM_REGISTERS, `api.cpu.kernel_compile_flags`) the other way round: the
 * halves widened by one 128-bit `vcvtph2ps` and broadcast from the register, no store and reload. On a 2-core Zen 5
 * (benchmarks/kernel_ab.py, equal outputs): a Q4_1 product of one activation row 1.05-1.15x in cache (one thread),
 * 1.13-1.20x from memory (two threads, 1536 and 576 wide), of 4 rows 1.07x; Q8_0 1.13-1.17x in cache, 1.01x from
 * memory (there it reads at the bandwidth already). */
ALWAYS_INLINE void head_splat_avx512(const uint8_t* p, __m512* d, __m512* m) {
    __m128 wide = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)p));
    *d = _mm512_broadcastss_ps(wide);
    if (m != NULL) *m = _mm512_broadcastss_ps(_mm_movehdup_ps(wide));
}
#else
ALWAYS_INLINE void head_splat_avx512(const uint8_t* p, __m512* d, __m512* m) {
    float slot[4] __attribute__((aligned(16)));
    __m128 wide;
    __asm__("vcvtph2ps %1, %0" : "=x"(wide) : "m"(*(const char(*)[8])p));
    _mm_store_ps(slot, wide);
    __asm__("vbroadcastss %1, %0" : "=v"(*d) : "m"(slot[0]));
    if (m != NULL) __asm__("vbroadcastss %1, %0" : "=v"(*m) : "m"(slot[1]));
}
#endif

ALWAYS_INLINE __m512 iota16(void) {
    return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}

/* A K-quant super-block's constants once for its 8 chunks, as on AVX2 (`ksuper_avx2`: the same floats), broadcast
 * from memory by each chunk instead of unpacked, widened and multiplied in every chunk. */
ALWAYS_INLINE void ksuper_avx512(int kind, const uint8_t* sb, float* ks) { ksuper_avx2(kind, sb, ks); }

/* Chunk c of a row as two vectors; `ks` holds its super-block's constants (ksuper_avx512) for a K-quant, and
 * `half` (0, 1; -1: unknown) whether a Q4_K chunk is an even or odd sub-block. */
ALWAYS_INLINE void chunk_avx512(int kind, const uint8_t* row, int64_t c, __m512* w, const float* ks, int half) {
    if (kind == DK_F32) {
        w[0] = _mm512_loadu_ps((const float*)row + c * CHUNK);
        w[1] = _mm512_loadu_ps((const float*)row + c * CHUNK + 16);
    } else if (kind == DK_Q4_0 || kind == DK_Q4_1) {
        int one = kind == DK_Q4_1;
        const uint8_t* b = row + c * (one ? 20 : 18);
        __m512 d, m;
        head_splat_avx512(b, &d, one ? &m : NULL);
        __m512 table = one ? _mm512_fmadd_ps(d, iota16(), m)
                           : _mm512_mul_ps(d, _mm512_sub_ps(iota16(), _mm512_set1_ps(8.0f)));
        /* the 16 bytes widened once: a lane's low nibble indexes as it is, its high one after a shift (one
         * widening instead of two: 7% faster in cache on Zen 5) */
        __m512i wide = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(b + (one ? 4 : 2))));
        w[0] = _mm512_permutexvar_ps(wide, table);
        w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(wide, 4), table);
    } else if (kind == DK_Q8_0) {
        const uint8_t* b = row + c * 34;
        __m512 d;
        head_splat_avx512(b, &d, NULL);
        for (int v = 0; v < 2; ++v)
            w[v] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(b + 2 + 16 * v)))), d);
    } else if (kind == DK_Q4_K) {
        const uint8_t* b = row + (c / 8) * 144;
        int64_t j = c % 8;
        __m512 table = _mm512_fmadd_ps(_mm512_set1_ps(ks[j]), iota16(), _mm512_set1_ps(ks[8 + j]));
        __m256i bytes = _mm256_loadu_si256((const __m256i*)(b + 16 + 32 * (j / 2)));
        /* an odd sub-block's quants are the high nibbles (`vpermps` reads only the low 4 bits of an index) */
        if (half == 1) bytes = _mm256_srli_epi16(bytes, 4);
        else if (half != 0) bytes = _mm256_srl_epi16(bytes, _mm_cvtsi32_si128((int)(4 * (j % 2))));
        table_lookup_avx512(table, _mm256_castsi256_si128(bytes), _mm256_extracti128_si256(bytes, 1), w);
    } else {  /* DK_Q6_K */
        const uint8_t* b = row + (c / 8) * 210;
        int64_t k = c % 8, h = k / 4, kk = k % 4;
        __m256i q = q6k_bytes(b, h, kk);
        /* sub-block scales 8h + 2kk and the next: ks[2k], ks[2k + 1] */
        w[0] = _mm512_mul_ps(_mm512_set1_ps(ks[2 * k]),
                             _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))));
        w[1] = _mm512_mul_ps(_mm512_set1_ps(ks[2 * k + 1]),
                             _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))));
    }
}
#endif

/* How far ahead of the chunk being multiplied each weight row asks for its bytes. One core's hardware prefetcher
 * keeps too few lines in flight for R interleaved row streams: on a Zen 5 core a single-row Q4_1 product read 10 GB/s
 * from memory without this and 17 GB/s with it (its in-cache rate), 5.6 KB ahead measuring best (1-11 KB tried).
 * Rows lie one after another, so R rows each prefetching this far ahead cover the tile this many bytes on. */
#define QUANT_PREFETCH_BYTES 5760

/* The most activation rows one tile multiplies (TILE_M_ISA below). */
#define TILE_MAX_M 8

/* ---- the product's tiles ----------------------------------------------------------------------------------------
 * DK_QUANT_TILE(ISA, VEC, NV, ...) defines tile_ISA(kind, x, in, w, row_bytes, R, M, sums): sums[m * R + r] =
 * x[m] . w[r] for R weight rows (row_bytes apart) and M activation rows (in floats apart); always inlined where R,
 * M and kind are constants, so each combination is its own unrolled loop. Each output accumulates its chunks in
 * two vectors (even and odd vectors of the chunk) and reduces them once at the end, the same way in every tile. */
#define DK_QUANT_TILE(ISA, VEC, NV, WIDTH, ZERO, LOADX, FMA, ADD, HSUM)                                      \
    ALWAYS_INLINE void tile_##ISA(int kind, const float* x, int64_t in, const uint8_t* w, int64_t row_bytes,   \
                                  int R, int M, float* sums) {                                                  \
        VEC acc[4][TILE_MAX_M][2];                                                                              \
        for (int r = 0; r < R; ++r)                                                                             \
            for (int m = 0; m < M; ++m) acc[r][m][0] = acc[r][m][1] = ZERO;                                     \
        int64_t chunks = in / CHUNK, step = row_bytes / chunks; /* a chunk's bytes (K-quants: on average) */  \
        float ks[4][16]; /* each weight row's K-quant super-block constants (ksuper_ISA) */                     \
        /* Q4_K two chunks a turn, so each knows its sub-block's parity (chunk_ISA's `half`): one weight row by   \
         * one activation row 1.12-1.19x, by 4 rows 1.06x (in cache, AVX2, 2-core Zen 3; the same sums) */       \
        int64_t turn = kind == DK_Q4_K ? 2 : 1;                                                                 \
        for (int64_t c0 = 0; c0 < chunks; c0 += turn)                                                          \
        _Pragma("GCC unroll 2") for (int64_t half = 0; half < turn; ++half) {                                   \
            int64_t c = c0 + half;                                                                              \
            VEC wv[4][NV];                                                                                      \
            /* a loop of its own: inside the next one it kept the compiler from unrolling that, and the chunk's   \
             * vectors went through memory */                                                                   \
            if (is_kquant(kind) && c % 8 == 0)                                                                  \
                for (int r = 0; r < R; ++r)                                                                     \
                    ksuper_##ISA(kind, w + r * row_bytes + c / 8 * block_bytes(kind), ks[r]);                   \
            for (int r = 0; r < R; ++r) {                                                                       \
                if (kind != DK_F32) /* a panel is in cache already */                                           \
                    __builtin_prefetch(w + r * row_bytes + c * step + QUANT_PREFETCH_BYTES);                    \
                chunk_##ISA(kind, w + r * row_bytes, c, wv[r], ks[r], turn == 2 ? (int)half : -1);              \
            }                                                                                                   \
            for (int m = 0; m < M; ++m)                                                                         \
                for (int v = 0; v < NV; ++v) {                                                                  \
                    VEC xv = LOADX(x + m * in + c * CHUNK + v * WIDTH);                                         \
                    for (int r = 0; r < R; ++r) acc[r][m][v & 1] = FMA(xv, wv[r][v], acc[r][m][v & 1]);         \
                }                                                                                               \
        }                                                                                                       \
        for (int r = 0; r < R; ++r)                                                                             \
            for (int m = 0; m < M; ++m) sums[m * R + r] = HSUM(ADD(acc[r][m][0], acc[r][m][1]));                \
    }

/* Keeps two vectors in registers: GCC otherwise re-reads them from memory as operands of each multiply-add. */
#if defined(__x86_64__) && defined(__GNUC__) && defined(__AVX__)  /* a 256-bit vector needs AVX registers */
#define IN_REGISTERS(a, b) __asm__("" : "+v"(a), "+v"(b))
#else
#define IN_REGISTERS(a, b) ((void)0)
#endif

/* tile_ISA(DK_F32, x, in, w, in * 4, 2, 4, sums) written out: the compiler folded the weight loads of the generic
 * tile into its multiply-adds, loading each weight vector once per activation row; here each is loaded once. The same
 * sums in the same order. */
#define DK_PANEL_TILE_2X4(ISA, VEC, NV, WIDTH, ZERO, LOADX, FMA, ADD, HSUM)                                    \
    ALWAYS_INLINE void panel_tile_2x4_##ISA(const float* x, int64_t in, const float* w, float* sums) {          \
        VEC a[2][4][2];                                                                                         \
        for (int r = 0; r < 2; ++r)                                                                             \
            for (int m = 0; m < 4; ++m) a[r][m][0] = a[r][m][1] = ZERO;                                         \
        for (int64_t i = 0; i < in; i += CHUNK)                                                                 \
            for (int v = 0; v < NV; ++v) {                                                                      \
                VEC w0 = LOADX(w + i + v * WIDTH), w1 = LOADX(w + in + i + v * WIDTH);                          \
                IN_REGISTERS(w0, w1);                                                                           \
                for (int m = 0; m < 4; ++m) {                                                                   \
                    VEC xv = LOADX(x + m * in + i + v * WIDTH);                                                 \
                    a[0][m][v & 1] = FMA(xv, w0, a[0][m][v & 1]);                                               \
                    a[1][m][v & 1] = FMA(xv, w1, a[1][m][v & 1]);                                               \
                }                                                                                               \
            }                                                                                                   \
        for (int r = 0; r < 2; ++r)                                                                             \
            for (int m = 0; m < 4; ++m) sums[m * 2 + r] = HSUM(ADD(a[r][m][0], a[r][m][1]));                    \
    }

#define PORTABLE_ZERO ((dk_v8f){0})
#define PORTABLE_FMA(a, b, c) ((c) + (a) * (b))
#define PORTABLE_ADD(a, b) ((a) + (b))
DK_QUANT_TILE(portable, dk_v8f, 4, 8, PORTABLE_ZERO, load_v8f, PORTABLE_FMA, PORTABLE_ADD, hsum_portable)
DK_PANEL_TILE_2X4(portable, dk_v8f, 4, 8, PORTABLE_ZERO, load_v8f, PORTABLE_FMA, PORTABLE_ADD, hsum_portable)
#if DK_QUANT_AVX2
DK_QUANT_TILE(avx2, __m256, 4, 8, _mm256_setzero_ps(), _mm256_loadu_ps, _mm256_fmadd_ps, _mm256_add_ps, hsum_avx2)
DK_PANEL_TILE_2X4(avx2, __m256, 4, 8, _mm256_setzero_ps(), _mm256_loadu_ps, _mm256_fmadd_ps, _mm256_add_ps, hsum_avx2)
#endif
#if DK_QUANT_AVX512
DK_QUANT_TILE(avx512, __m512, 2, 16, _mm512_setzero_ps(), _mm512_loadu_ps, _mm512_fmadd_ps, _mm512_add_ps,
              _mm512_reduce_add_ps)
DK_PANEL_TILE_2X4(avx512, __m512, 2, 16, _mm512_setzero_ps(), _mm512_loadu_ps, _mm512_fmadd_ps, _mm512_add_ps,
                  _mm512_reduce_add_ps)
#endif

/* ---- AVX2's wide tile: one weight row by 5-6 activation rows -------------------------------------------------
 * The generic tile dequantizes a whole chunk (four vectors) before multiplying it, so 16 registers hold its weights
 * and 2 x 4 accumulators: 4 activation rows. Dequantizing one vector of 8 weights at a time and multiplying it into
 * every row at once leaves room for 2 x 6 accumulators, so 5-6 rows take one pass over the weight row instead of two
 * (4 + 1, 4 + 2: each chunk dequantized twice, each weight byte read twice). The vectors are chunk_avx2's, in its
 * order, and each output sums them in the generic tile's order (even and odd vectors in two accumulators, chunk by
 * chunk): the same sums bit for bit. For every format the products take (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K).
 * benchmarks/kernel_ab.py (8192 x 576 weights, 2 threads, 2-core Zen 3, equal outputs): 5 rows 1.10-1.20x, 6 rows
 * 1.05-1.11x, 9 rows (4 + 5) 1.06-1.11x; 8192 x 1536: 5 rows Q4_1 1.20x, Q8_0 1.03x. 7-8 rows as 6 + 1, 6 + 2
 * measured 0.87-0.95x the 4 + 3, 4 + 4 tiles, so a wide tile takes only a group's last 5-6 rows. Q4_K (8192 x 768):
 * 5 rows 1.31x, 6 rows 1.28x, 10 rows 1.14x; 8192 x 1536: 5 rows 1.24x. Q6_K (8192 x 768): 5 rows 1.44x, 6 rows
 * 1.46x, 10 rows 1.25x (its generic chunk computes 32 quants in a vector before widening them: four vectors live).
 * Wide tiles of 2-4 rows measured 0.97-0.99x the generic ones (Q4_1, 8192 x 576): those keep the generic tiles. */
#define WIDE_MAX_M 6
/* The most bytes of activation rows a wide tile reads per weight row: its rows must stay in L1 (32 KB here) while
 * the weights stream past, or each weight row reads them from L2. SmolLM2's 576-wide products by 5-6 rows (14 KB)
 * and 1536-wide by 5 (30 KB) gain; 1536-wide by 6 rows (36 KB) measured 0.93-1.00x the 4 + 2 tiles. */
#define WIDE_MAX_BYTES (32 * 1024)
#if DK_QUANT_AVX2
/* Vector v (0-3) of a block's 32 weights, the floats chunk_avx2 computes; q points at the quants, d and m are the
 * block's scale and min splatted (Q4_0: m = -8d). A Q4_0 weight d * (q - 8) is exact in float32 (an fp16 scale
 * times a 5-bit integer), and so is -8d, so the fused d * q + (-8d) rounds to that same float: one constant
 * register fewer than subtracting 8 first, which 6 rows' 12 accumulators need. */
ALWAYS_INLINE __m256 wide_vector_avx2(int kind, const uint8_t* q, int v, __m256 d, __m256 m) {
    if (kind == DK_Q8_0) return _mm256_mul_ps(_mm256_cvtepi32_ps(widen8_avx2(q + 8 * v, 1)), d);
    __m256i bytes = widen8_avx2(q + 8 * (v & 1), 0);  /* low nibbles first: bytes 0-7, 8-15, then their high ones */
    __m256i quants = v < 2 ? _mm256_and_si256(bytes, _mm256_set1_epi32(15)) : _mm256_srli_epi32(bytes, 4);
    return _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(quants), m);
}

/* Vector v of a chunk's weights multiplied into each of M activation rows' accumulator for its parity. */
ALWAYS_INLINE void wide_fma_avx2(__m256 acc[][2], const float* xc, int64_t in, int v, __m256 wv, int M) {
    _Pragma("GCC unroll 6") for (int k = 0; k < M; ++k)
        acc[k][v & 1] = _mm256_fmadd_ps(_mm256_loadu_ps(xc + k * in + 8 * v), wv, acc[k][v & 1]);
}

/* sums[k] = x[k] . w for M (5-6) activation rows `in` floats apart and one row of blocks of 32 (`kind`). */
ALWAYS_INLINE void wide_tile_avx2(int kind, const float* x, int64_t in, const uint8_t* w, int M, float* sums) {
    __m256 acc[WIDE_MAX_M][2];
    for (int k = 0; k < M; ++k) acc[k][0] = acc[k][1] = _mm256_setzero_ps();
    int64_t bytes = block_bytes(kind), head = kind == DK_Q4_1 ? 4 : 2;
    for (int64_t c = 0; c < in / CHUNK; ++c) {
        const uint8_t* b = w + c * bytes;
        __builtin_prefetch(b + QUANT_PREFETCH_BYTES);
        __m256 d = half_splat_avx2(b);
        __m256 m = kind == DK_Q4_1 ? half_splat_avx2(b + 2) : _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
        const float* xc = x + c * CHUNK;
        _Pragma("GCC unroll 4") for (int v = 0; v < 4; ++v) {
            __m256 wv = wide_vector_avx2(kind, b + head, v, d, m);
            wide_fma_avx2(acc, xc, in, v, wv, M);
        }
    }
    for (int k = 0; k < M; ++k) sums[k] = hsum_avx2(_mm256_add_ps(acc[k][0], acc[k][1]));
}

/* wide_tile_avx2 for Q4_K: each super-block's constants once for its 8 chunks (ksuper_avx2), the chunks two a turn
 * so each knows its sub-block's nibbles (even: low, odd: high), each vector chunk_avx2's. */
ALWAYS_INLINE void wide_tile_q4k_avx2(const float* x, int64_t in, const uint8_t* w, int M, float* sums) {
    __m256 acc[WIDE_MAX_M][2];
    for (int k = 0; k < M; ++k) acc[k][0] = acc[k][1] = _mm256_setzero_ps();
    float ks[16];
    for (int64_t c0 = 0; c0 < in / CHUNK; c0 += 2) {
        if (c0 % 8 == 0) ksuper_avx2(DK_Q4_K, w + c0 / 8 * 144, ks);
        const uint8_t* qs = w + c0 / 8 * 144 + 16 + 32 * (c0 % 8 / 2);
        __builtin_prefetch(qs + QUANT_PREFETCH_BYTES);
        _Pragma("GCC unroll 2") for (int half = 0; half < 2; ++half) {
            int64_t c = c0 + half, j = c % 8;
            __m256 ds = _mm256_broadcast_ss(ks + j), ndm = _mm256_broadcast_ss(ks + 8 + j);
            const float* xc = x + c * CHUNK;
            _Pragma("GCC unroll 4") for (int v = 0; v < 4; ++v) {
                __m256i bytes = widen8_avx2(qs + 8 * v, 0);
                __m256i quants = half == 0 ? _mm256_and_si256(bytes, _mm256_set1_epi32(15)) : _mm256_srli_epi32(bytes, 4);
                __m256 wv = _mm256_fmadd_ps(ds, _mm256_cvtepi32_ps(quants), ndm);
                _Pragma("GCC unroll 6") for (int k = 0; k < M; ++k)
                    acc[k][v & 1] = _mm256_fmadd_ps(_mm256_loadu_ps(xc + k * in + 8 * v), wv, acc[k][v & 1]);
            }
        }
    }
    for (int k = 0; k < M; ++k) sums[k] = hsum_avx2(_mm256_add_ps(acc[k][0], acc[k][1]));
}

/* wide_tile_avx2 for Q6_K: each super-block's 16 sub-block scales once for its 8 chunks (ksuper_avx2), each chunk's
 * 32 quants computed once in a vector (q6k_bytes) and widened a vector of 8 at a time, as chunk_avx2's. */
ALWAYS_INLINE void wide_tile_q6k_avx2(const float* x, int64_t in, const uint8_t* w, int M, float* sums) {
    __m256 acc[WIDE_MAX_M][2];
    for (int k = 0; k < M; ++k) acc[k][0] = acc[k][1] = _mm256_setzero_ps();
    float ks[16];
    for (int64_t c = 0; c < in / CHUNK; ++c) {
        const uint8_t* b = w + c / 8 * 210;
        if (c % 8 == 0) ksuper_avx2(DK_Q6_K, b, ks);
        __builtin_prefetch(b + 64 * (c % 8 / 4) + QUANT_PREFETCH_BYTES);
        int64_t k8 = c % 8;
        __m256i bytes = q6k_bytes(b, k8 / 4, k8 % 4);
        const float* xc = x + c * CHUNK;
        _Pragma("GCC unroll 4") for (int v = 0; v < 4; ++v) {
            __m128i half = v < 2 ? _mm256_castsi256_si128(bytes) : _mm256_extracti128_si256(bytes, 1);
            __m256i quants = _mm256_cvtepi8_epi32(v & 1 ? _mm_srli_si128(half, 8) : half);
            __m256 wv = _mm256_mul_ps(_mm256_broadcast_ss(ks + 2 * k8 + (v >= 2)), _mm256_cvtepi32_ps(quants));
            wide_fma_avx2(acc, xc, in, v, wv, M);
        }
    }
    for (int k = 0; k < M; ++k) sums[k] = hsum_avx2(_mm256_add_ps(acc[k][0], acc[k][1]));
}
#endif
/* Activation rows a wide tile takes at most on each path (0: none; the generic tiles there). */
#define WIDE_M_avx2 WIDE_MAX_M
#define WIDE_M_avx512 0
#define WIDE_M_portable 0
static inline int wide_kind(int kind) {
    return kind == DK_Q4_0 || kind == DK_Q4_1 || kind == DK_Q8_0 || kind == DK_Q4_K || kind == DK_Q6_K;
}
/* The sums of weight rows [0, nr) (row_bytes apart) by M (5-6) activation rows into sums[k * nr + r], in wide tiles:
 * out of line, so the group's own tiles (the one-row tile of a batch-1 step above all) compile as they did (inlined
 * into each format's group, the wide tiles cost the one-row product 2-4% in cache). */
#if DK_QUANT_AVX2
static __attribute__((noinline)) void wide_rows_avx2(int kind, const float* x, int64_t in, const uint8_t* w,
                                                     int64_t row_bytes, int64_t nr, int M, float* sums) {
    float one[WIDE_MAX_M];
    for (int64_t r = 0; r < nr; ++r) {
        const uint8_t* row = w + r * row_bytes;
        if (kind == DK_Q4_1) {
            if (M == 5) wide_tile_avx2(DK_Q4_1, x, in, row, 5, one);
            else wide_tile_avx2(DK_Q4_1, x, in, row, WIDE_MAX_M, one);
        } else if (kind == DK_Q8_0) {
            if (M == 5) wide_tile_avx2(DK_Q8_0, x, in, row, 5, one);
            else wide_tile_avx2(DK_Q8_0, x, in, row, WIDE_MAX_M, one);
        } else if (kind == DK_Q4_K) {
            if (M == 5) wide_tile_q4k_avx2(x, in, row, 5, one);
            else wide_tile_q4k_avx2(x, in, row, WIDE_MAX_M, one);
        } else if (kind == DK_Q6_K) {
            if (M == 5) wide_tile_q6k_avx2(x, in, row, 5, one);
            else wide_tile_q6k_avx2(x, in, row, WIDE_MAX_M, one);
        } else {
            if (M == 5) wide_tile_avx2(DK_Q4_0, x, in, row, 5, one);
            else wide_tile_avx2(DK_Q4_0, x, in, row, WIDE_MAX_M, one);
        }
        for (int k = 0; k < M; ++k) sums[k * nr + r] = one[k];
    }
}
#define WIDE_ROWS_avx2 wide_rows_avx2
#endif
#define WIDE_ROWS_avx512(kind, x, in, w, row_bytes, nr, M, sums) ((void)0)
#define WIDE_ROWS_portable(kind, x, in, w, row_bytes, nr, M, sums) ((void)0)

/* Output rows per work item (one tile's R at most). */
#define QUANT_GROUP 4
/* Activation rows from which a product dequantizes each weight row once into a panel (`panel_group_ISA`), and the
 * output rows of one panel (a work item then): 16 rows of SmolLM2's widest input (1536) are 96 KB, in L2. Measured
 * on SmolLM2's shapes (benchmarks/quant_products.py, 2-core Zen 5, Q4_1, 10 layers, ms): 5 rows 2.30 against 2.08
 * in registers, 8 rows 3.03 against 2.72, 16 rows 5.08 against 5.32, 32 rows 9.35 against 11.56: below 16 rows
 * the registers' tiles, which overlap dequantizing with multiplying, are faster. */
#ifndef QUANT_PANEL_MIN_ROWS
#define QUANT_PANEL_MIN_ROWS 16
#endif
#define QUANT_PANEL_ROWS 16

/* ---- AVX2: Q4_0, Q4_1 and Q8_0 times activations in 16-bit block fixed point ------------------------------------
 * AVX2 has no instruction that multiplies 4-bit integers into floats: the float product widens each quant to 32
 * bits, converts it and dequantizes it with a multiply-add before the multiply-add that uses it (~22 vector
 * operations a block of 32 weights by one activation row), and is bound by that arithmetic, not by memory (a
 * batch-1 GGUF token read its weights at 42-47% of the bound on a 2-core Zen 3). Here each activation row is first
 * (once per product, by the calling thread, before its parallel region: `i16_rows_avx2`)
 * rounded, block by block, to 16-bit fixed point: x = sx * x16 with sx = max|x| / 32767 over the block's 32 values
 * and x16 = round(x / sx) (|error| <= sx / 2, 2^-16 of the block's largest value: finer than bfloat16, 2^-9 of each
 * value). Then Q4_1's sum over a block, sum_k (d q_k + m) x_k, is d sx (sum_k q_k x16_k) + m (sum_k x_k): the
 * weights are exactly the file's (d, m and the quants as stored), the integer sum is exact (`vpmaddwd`: 16 quants
 * by 16 activations into 8 pairwise sums at once; |sum| < 2^24, so also exact as a float), and the block sums of x
 * are float32 sums of the activations themselves. Q4_0 is the same with m = -8d. ~11 vector operations a block.
 * Standalone (random blocks, one row, 2-core Zen 3): 1.5-1.8x the float product in cache, 1.2-1.8x from memory.
 *
 * An output sums the same vectors in the same order whatever the rows multiplied with it (the tiles differ only
 * in how many weight and activation rows share a load), by runs of 8 blocks (the last run 1-8): with D and M the
 * run's 8 scales and mins (zeros past the run) and SX and ST its 8 activation scales and block sums, acc =
 * fma(M, ST, acc), then per pair k of blocks acc = fma(float(P), DS_k, acc), where P are the pair's 8 integer
 * partial sums (4 a block) and DS_k = D * SX with lanes 2k and 2k + 1 each spread over 4 lanes (`vpermps`); then
 * the lanes' sum (hsum_avx2). A row's result does not depend on its batch, nor on its layout (grouped or stored).
 * The run's scales, mins and the mins' multiply-add come once a run (the grouped layout's in one load and one
 * conversion each), one multiply-add a pair waits on the one before: standalone (one thread, two weight rows 512
 * wide by one activation row, a 2-core Zen 3) 1.4x as fast in cache as pairs of blocks with their own scales, 1.1x
 * from memory on both cores; in the library (`benchmarks/kernel_ab.py`, 8192 rows, 2 threads) 1.17x at one
 * activation row 576 wide, 1.24x 1536 wide, 1.09-1.15x at two, 0.98-1.17x at 5-16.
 *
 * An activation row's blocks are laid out by runs of 8 (I16_GROUP_BYTES each): per pair of blocks 64 int16, in the
 * order the quants come out of a pair's 32 bytes read as 16-bit words (X0: x_2i, X1: x_2i+16, X2: x_2i+1, X3:
 * x_2i+17, i = 0..7, block 2p in the low 128 bits and 2p + 1 in the high), two pairs' X0 side by side, then their
 * X1, X2 and X3 (so that AVX-512 loads both pairs' Xj as one vector: `i16_pair_offset`), 4 pairs, then SX (8
 * floats) and ST (8 floats). A last run of fewer blocks is filled with zeros. After the runs, the same int16 in
 * their natural order, 32 a block, then each block's sx: Q8_0's layout. Q8_0 (signed 8-bit quants, d per block, no min) widens its
 * quants to int16 with one `vpmovsxbw` per 16 and sums q . x16 by `vpmaddwd` the same way (4 products a lane: |sum| < 2^24, exact as a float), then acc =
 * fma(float(P), d * sx, acc) block by block (its float product: ~18 vector operations a block, this one ~10). */
#define I16_GROUP_BYTES 576
#define I16_TILE_MAX_M 8
/* Where pair p (0-3) of a run's blocks starts in the run's layout: its X0; its X1, X2 and X3 64, 128 and 192 bytes on
 * (pairs 0 and 1 share 256 bytes, 2 and 3 the next 256). */
static inline int64_t i16_pair_offset(int64_t p) { return 256 * (p / 2) + 32 * (p % 2); }
/* Bytes of the runs' layout of one activation row; the natural layout (Q8_0's) follows it. */
static inline int64_t i16_grouped_bytes(int64_t in) {
    return (in / CHUNK + GROUP_BLOCKS - 1) / GROUP_BLOCKS * I16_GROUP_BYTES;
}
/* Bytes of one activation row laid out for the products (`i16_prepare_avx2`): both layouts. */
static inline int64_t i16_row_bytes(int64_t in) { return i16_grouped_bytes(in) + in / CHUNK * (64 + 4); }
/* Whether the AVX2 path multiplies `kind` by activations in 16-bit fixed point. */
static inline int i16_kind(int64_t kind) {
    return kind == DK_Q4_0 || kind == DK_Q4_1 || kind == DK_Q8_0 || is_grouped(kind);
}
/* Whether the AVX-512 path does: Q4_0 and Q4_1 only. Its float Q8_0 product already reads at the bandwidth for one
 * activation row, and multiplies more rows faster than the fixed-point one (a float multiply-add a vector a row
 * against `vpmaddwd`, a conversion and a multiply-add of the block's scale: 2-8 rows 1.19-1.38x on a 2-core Zen 5). */
static inline int i16_kind_avx512(int64_t kind) {
    return kind == DK_Q4_0 || kind == DK_Q4_1 || is_grouped(kind);
}
#define I16_KIND_avx2 i16_kind
#define I16_KIND_avx512 i16_kind_avx512
#define I16_KIND_portable(kind) 0

#if DK_QUANT_AVX2
/* The calling thread's buffer of at least `bytes` (grown, never shrunk), or NULL without memory. */
static uint8_t* i16_buffer(int64_t bytes) {
    static __thread uint8_t* buffer = NULL;
    static __thread int64_t capacity = 0;
    if (capacity < bytes) {
        uint8_t* grown = aligned_alloc(64, ((size_t)bytes + 63) / 64 * 64);
        if (grown == NULL) return NULL;
        free(buffer);
        buffer = grown;
        capacity = bytes;
    }
    return buffer;
}

/* The block's largest |value| and its float32 sum ((x0 + x1) + (x2 + x3) by vectors, then hsum_avx2). */
ALWAYS_INLINE void i16_block_stats(const __m256* v, float* largest, float* sum) {
    __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                             _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    /* a NaN anywhere must reach the product: max_ps drops a NaN in its first operand, so look for one apart */
    __m256 nan = _mm256_or_ps(_mm256_or_ps(_mm256_cmp_ps(v[0], v[0], _CMP_UNORD_Q), _mm256_cmp_ps(v[1], v[1], _CMP_UNORD_Q)),
                              _mm256_or_ps(_mm256_cmp_ps(v[2], v[2], _CMP_UNORD_Q), _mm256_cmp_ps(v[3], v[3], _CMP_UNORD_Q)));
    *largest = _mm256_movemask_ps(nan) ? __builtin_nanf("") : _mm_cvtss_f32(h);
    *sum = hsum_avx2(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
}

/* Activation rows x [rows, in] laid out in dst (rows * i16_row_bytes(in) bytes) for `i16_tile_avx2`. */
static void i16_prepare_avx2(const float* x, int64_t rows, int64_t in, uint8_t* dst) {
    int64_t blocks = in / CHUNK, stride = i16_row_bytes(in);
    /* within each 128 bits: the even words, then the odd ones */
    const __m256i evens_odds = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                                0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    for (int64_t m = 0; m < rows; ++m) {
        uint8_t* row = dst + m * stride;
        if (blocks % GROUP_BLOCKS) memset(row + blocks / GROUP_BLOCKS * I16_GROUP_BYTES, 0, I16_GROUP_BYTES);
        for (int64_t b = 0; b < blocks; ++b) {
            const float* xb = x + m * in + b * CHUNK;
            __m256 v[4];
            for (int k = 0; k < 4; ++k) v[k] = _mm256_loadu_ps(xb + 8 * k);
            float largest, sum, sx = 0.0f, inverse = 0.0f;
            i16_block_stats(v, &largest, &sum);
            if (!(largest <= 3.4e38f)) sx = largest;  /* inf or NaN: the block's outputs become NaN, as floats' would */
            else if (largest >= 1e-30f) sx = largest / 32767.0f, inverse = 32767.0f / largest;
            /* (below 1e-30 a block adds under 1e-30 times its weights: rounded to zero) */
            __m256i q[4];
            for (int k = 0; k < 4; ++k) q[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], _mm256_set1_ps(inverse)));
            /* x0..15 and x16..31 as words in order, then each 128 bits' even words before its odd ones and the
             * 64-bit quarters regrouped: [x0, x2, .., x14 | x1, x3, .., x15] and [x16, x18, .. | x17, x19, ..] */
            __m256i lo = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xD8);
            __m256i hi = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xD8);
            uint8_t* natural = row + i16_grouped_bytes(in);
            _mm256_storeu_si256((__m256i*)(natural + 64 * b), lo);
            _mm256_storeu_si256((__m256i*)(natural + 64 * b + 32), hi);
            memcpy(natural + 64 * blocks + 4 * b, &sx, sizeof sx);
            lo = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(lo, evens_odds), 0xD8);
            hi = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(hi, evens_odds), 0xD8);
            uint8_t* run = row + b / GROUP_BLOCKS * I16_GROUP_BYTES;
            uint8_t* pair = run + i16_pair_offset(b % GROUP_BLOCKS / 2);
            int64_t half = 16 * (b % 2);
            _mm_storeu_si128((__m128i*)(pair + 0 + half), _mm256_castsi256_si128(lo));        /* X0 */
            _mm_storeu_si128((__m128i*)(pair + 64 + half), _mm256_castsi256_si128(hi));       /* X1 */
            _mm_storeu_si128((__m128i*)(pair + 128 + half), _mm256_extracti128_si256(lo, 1)); /* X2 */
            _mm_storeu_si128((__m128i*)(pair + 192 + half), _mm256_extracti128_si256(hi, 1)); /* X3 */
            memcpy(run + 512 + 4 * (b % GROUP_BLOCKS), &sx, sizeof sx);   /* SX */
            memcpy(run + 544 + 4 * (b % GROUP_BLOCKS), &sum, sizeof sum); /* ST */
        }
    }
}

/* Asks for the bytes a tile of R (1-2) weight rows from `w` will read QUANT_PREFETCH_BYTES on, at step i of `step`
 * bytes a row: one stream, ahead of the tile's R * step bytes a step. Its rows lie one after another, so the next
 * rows' first bytes follow. (Each of two rows prefetching itself, two streams into the same memory, read a one-row
 * Q8_0 product of SmolLM2's 612-byte rows from memory 1.23x slower on a 2-core Zen 3: `benchmarks/kernel_ab.py
 * --formats Q8_0 --rows 1 --out 262144 --width 576`; 1536 wide and Q4_1, bound by arithmetic there, the same.) */
ALWAYS_INLINE void i16_prefetch(const uint8_t* w, int R, int64_t step, int64_t i) {
    __builtin_prefetch(w + QUANT_PREFETCH_BYTES + R * step * i);
}

/* A run's n (1-8) fp16 values from `b`, `step` bytes apart (2: the grouped layouts' scales or mins one after another;
 * a block's bytes: the stored blocks'), as 8 floats, zeros past n. A grouped run's 16 bytes from b lie in the run
 * (n blocks of 18 or 20 bytes), whatever follows its n values is masked off (bitwise: a NaN there is gone too). */
ALWAYS_INLINE __m256 run_halves_avx2(const uint8_t* b, int64_t step, int64_t n) {
    if (step == 2) {
        __m256 all = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)b));
        if (n == GROUP_BLOCKS) return all;
        __m256i kept = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        return _mm256_and_ps(all, _mm256_castsi256_ps(kept));
    }
    uint16_t h[GROUP_BLOCKS] = {0};  /* (in registers: lanes inserted one by one, no store to forward) */
    for (int64_t j = 0; j < n; ++j) memcpy(&h[j], b + j * step, 2);
    return _mm256_cvtph_ps(_mm_setr_epi16((short)h[0], (short)h[1], (short)h[2], (short)h[3], (short)h[4], (short)h[5],
                                          (short)h[6], (short)h[7]));
}

/* sums[m * R + r] for R (1-2) weight rows (`row_bytes` apart, `blocks` blocks of Q4_0 or Q4_1 each, as stored or
 * grouped) by M (1-8) activation rows laid out at xi (`stride` bytes apart). An inf or NaN activation makes its
 * block's outputs NaN. A grouped run's scales (and mins) come in one load and one conversion, a pair's quants in
 * one 32-byte load (the stored blocks' are gathered one by one, and take two loads and an insert): the same values
 * in the same registers, so both layouts give the same bits. */
ALWAYS_INLINE void i16_tile_avx2(int kind, const uint8_t* xi, int64_t stride, const uint8_t* w, int64_t row_bytes,
                                 int R, int M, int64_t blocks, float* sums) {
    int one = kind == DK_Q4_1 || kind == DK_Q4_1G, grouped = is_grouped(kind);
    int64_t bytes = one ? 20 : 18, head = bytes - 16;
    const __m256i nibble = _mm256_set1_epi16(15);
    const __m256i spread[4] = {_mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3),
                               _mm256_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5), _mm256_setr_epi32(6, 6, 6, 6, 7, 7, 7, 7)};
    __m256 acc[2][I16_TILE_MAX_M], ds[2][2];
    float ds_stack[2][I16_TILE_MAX_M][8] __attribute__((aligned(32)));
    for (int r = 0; r < R; ++r)
        for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();
    for (int64_t g = 0; g * GROUP_BLOCKS < blocks; ++g) {
        int64_t n = blocks - g * GROUP_BLOCKS < GROUP_BLOCKS ? blocks - g * GROUP_BLOCKS : GROUP_BLOCKS;
        const uint8_t* run[2];
        __m256 d[2], mins[2];
        for (int64_t line = 0; line < R * GROUP_BLOCKS * bytes; line += 64)
            i16_prefetch(w + line, R, GROUP_BLOCKS * bytes, g);
        for (int r = 0; r < R; ++r) {
            run[r] = w + r * row_bytes + g * GROUP_BLOCKS * bytes;
            d[r] = run_halves_avx2(run[r], grouped ? 2 : bytes, n);
            /* Q4_0's weight d (q - 8) = d q + (-8d), with -8d exact */
            mins[r] = one ? run_halves_avx2(run[r] + (grouped ? 2 * n : 2), grouped ? 2 : bytes, n)
                          : _mm256_mul_ps(d[r], _mm256_set1_ps(-8.0f));
        }
        /* D * SX once a run (in registers for 1-2 activation rows; for more, whose accumulators fill the
         * registers, on the stack, each pair's lanes spread from there by one `vpermps` with a memory operand) */
        for (int m = 0; m < M; ++m) {
            const float* xs = (const float*)(xi + m * stride + g * I16_GROUP_BYTES + 512);
            __m256 st = _mm256_loadu_ps(xs + 8);
            for (int r = 0; r < R; ++r) {
                acc[r][m] = _mm256_fmadd_ps(mins[r], st, acc[r][m]);
                if (M <= 2) ds[r][m] = _mm256_mul_ps(d[r], _mm256_loadu_ps(xs));
                else _mm256_store_ps(ds_stack[r][m], _mm256_mul_ps(d[r], _mm256_loadu_ps(xs)));
            }
        }
        for (int64_t k = 0; k < (n + 1) / 2; ++k) {
            int whole = 2 * k + 1 < n;
            __m256i v[2][4];
            for (int r = 0; r < R; ++r) {
                __m256i quants;
                if (grouped) {
                    const uint8_t* q = run[r] + head * n + 32 * k;
                    quants = whole ? _mm256_loadu_si256((const __m256i*)q)  /* an odd last block: zeros above */
                                   : _mm256_inserti128_si256(_mm256_setzero_si256(), _mm_loadu_si128((const __m128i*)q), 0);
                } else {
                    const uint8_t* b = run[r] + 2 * k * bytes + head;
                    __m128i qhi = whole ? _mm_loadu_si128((const __m128i*)(b + bytes)) : _mm_setzero_si128();
                    quants = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)b)), qhi, 1);
                }
                v[r][0] = _mm256_and_si256(quants, nibble);
                v[r][1] = _mm256_and_si256(_mm256_srli_epi16(quants, 4), nibble);
                v[r][2] = _mm256_and_si256(_mm256_srli_epi16(quants, 8), nibble);
                v[r][3] = _mm256_srli_epi16(quants, 12);
            }
            for (int m = 0; m < M; ++m) {
                const uint8_t* pair = xi + m * stride + g * I16_GROUP_BYTES + i16_pair_offset(k);
                __m256i x0 = _mm256_loadu_si256((const __m256i*)pair), x1 = _mm256_loadu_si256((const __m256i*)(pair + 64));
                __m256i x2 = _mm256_loadu_si256((const __m256i*)(pair + 128)), x3 = _mm256_loadu_si256((const __m256i*)(pair + 192));
                for (int r = 0; r < R; ++r) {
                    __m256i P = _mm256_add_epi32(_mm256_add_epi32(_mm256_madd_epi16(v[r][0], x0), _mm256_madd_epi16(v[r][1], x1)),
                                                 _mm256_add_epi32(_mm256_madd_epi16(v[r][2], x2), _mm256_madd_epi16(v[r][3], x3)));
                    __m256 scale = _mm256_permutevar8x32_ps(M > 2 ? _mm256_load_ps(ds_stack[r][m]) : ds[r][m], spread[k]);
                    acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(P), scale, acc[r][m]);
                }
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int m = 0; m < M; ++m) sums[m * R + r] = hsum_avx2(acc[r][m]);
}

/* i16_tile_avx2 for Q8_0, from the natural layout at xn (`stride` bytes apart). */
ALWAYS_INLINE void i16_tile_q8_avx2(const uint8_t* xn, int64_t stride, const uint8_t* w, int64_t row_bytes, int R,
                                    int M, int64_t blocks, float* sums) {
    __m256 acc[2][I16_TILE_MAX_M];
    for (int r = 0; r < R; ++r)
        for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
        __m256i v[2][2];
        __m256 d[2];
        i16_prefetch(w, R, 34, b);
        for (int r = 0; r < R; ++r) {
            const uint8_t* block = w + r * row_bytes + b * 34;
            v[r][0] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(block + 2)));
            v[r][1] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(block + 18)));
            d[r] = half_splat_avx2(block);
        }
        for (int m = 0; m < M; ++m) {
            const uint8_t* x = xn + m * stride;
            __m256i x0 = _mm256_loadu_si256((const __m256i*)(x + 64 * b));
            __m256i x1 = _mm256_loadu_si256((const __m256i*)(x + 64 * b + 32));
            __m256 sx = _mm256_broadcast_ss((const float*)(x + 64 * blocks) + b);
            for (int r = 0; r < R; ++r) {
                __m256i P = _mm256_add_epi32(_mm256_madd_epi16(v[r][0], x0), _mm256_madd_epi16(v[r][1], x1));
                acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(P), _mm256_mul_ps(d[r], sx), acc[r][m]);
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int m = 0; m < M; ++m) sums[m * R + r] = hsum_avx2(acc[r][m]);
}

/* One tile of `kind` (Q4_0, Q4_1 or Q8_0): its layout of the activation rows at xm. */
ALWAYS_INLINE void i16_any_tile_avx2(int kind, const uint8_t* xm, int64_t stride, int64_t in, const uint8_t* w,
                                     int64_t row_bytes, int R, int M, int64_t blocks, float* sums) {
    if (kind == DK_Q8_0) i16_tile_q8_avx2(xm + i16_grouped_bytes(in), stride, w, row_bytes, R, M, blocks, sums);
    else if (kind == DK_Q4_1) i16_tile_avx2(DK_Q4_1, xm, stride, w, row_bytes, R, M, blocks, sums);
    else if (kind == DK_Q4_1G) i16_tile_avx2(DK_Q4_1G, xm, stride, w, row_bytes, R, M, blocks, sums);
    else if (kind == DK_Q4_0G) i16_tile_avx2(DK_Q4_0G, xm, stride, w, row_bytes, R, M, blocks, sums);
    else i16_tile_avx2(DK_Q4_0, xm, stride, w, row_bytes, R, M, blocks, sums);
}

/* DK_I16_GROUP(ISA, TWO_MAX) defines i16_group_ISA: the outputs [o0, o0 + nr) (nr <= QUANT_PANEL_ROWS) of Q4_0, Q4_1
 * or Q8_0 weights for every activation row (laid out at xi), stored with bias and residual, in i16_any_tile_ISA's
 * tiles: two weight rows by 1-TWO_MAX activation rows, else one weight row by up to 8. AVX2 takes two rows by one
 * only (each output's multiply-adds wait on the one before, and a second row's fill the gaps); AVX-512 by 1-4 (each
 * activation vector loaded once for both: 2 rows 1.13x, 3-4 rows 1.04x from memory on a 2-core Zen 5). Every output
 * is summed in its one order whatever the tile: the same bits. */
#define DK_I16_GROUP(ISA, TWO_MAX)                                                                              \
    static void i16_group_##ISA(int kind, const uint8_t* xi, int64_t rows, int64_t in, const uint8_t* w,        \
                                int64_t row_bytes, int64_t o0, int64_t nr, const float* bias,                   \
                                const float* residual, float* out, int64_t ld) {                                \
        int64_t blocks = in / CHUNK, stride = i16_row_bytes(in);                                                \
        const uint8_t* wr = w + o0 * row_bytes;                                                                 \
        float sums[QUANT_PANEL_ROWS * I16_TILE_MAX_M];                                                          \
        for (int64_t m = 0; m < rows; m += I16_TILE_MAX_M) {                                                    \
            int64_t nm = rows - m < I16_TILE_MAX_M ? rows - m : I16_TILE_MAX_M;                                 \
            const uint8_t* xm = xi + m * stride;                                                                \
            int64_t r = 0;                                                                                      \
            if (nm <= (TWO_MAX))                                                                                \
                for (; r + 2 <= nr; r += 2) {                                                                   \
                    float two[8];                                                                               \
                    const uint8_t* pair = wr + r * row_bytes;                                                   \
                    if (nm == 1 || (TWO_MAX) < 2)                                                               \
                        i16_any_tile_##ISA(kind, xm, stride, in, pair, row_bytes, 2, 1, blocks, two);           \
                    else if (nm == 2 || (TWO_MAX) < 3)                                                          \
                        i16_any_tile_##ISA(kind, xm, stride, in, pair, row_bytes, 2, 2, blocks, two);           \
                    else if (nm == 3 || (TWO_MAX) < 4)                                                          \
                        i16_any_tile_##ISA(kind, xm, stride, in, pair, row_bytes, 2, 3, blocks, two);           \
                    else                                                                                        \
                        i16_any_tile_##ISA(kind, xm, stride, in, pair, row_bytes, 2, 4, blocks, two);           \
                    for (int64_t k = 0; k < nm; ++k) {                                                          \
                        sums[k * nr + r] = two[k * 2];                                                          \
                        sums[k * nr + r + 1] = two[k * 2 + 1];                                                  \
                    }                                                                                           \
                }                                                                                               \
            for (; r < nr; ++r) {                                                                               \
                float one[I16_TILE_MAX_M];                                                                      \
                const uint8_t* row = wr + r * row_bytes;                                                        \
                switch (nm) {                                                                                   \
                    case 1: i16_any_tile_##ISA(kind, xm, stride, in, row, row_bytes, 1, 1, blocks, one); break; \
                    case 2: i16_any_tile_##ISA(kind, xm, stride, in, row, row_bytes, 1, 2, blocks, one); break; \
                    case 3: i16_any_tile_##ISA(kind, xm, stride, in, row, row_bytes, 1, 3, blocks, one); break; \
                    case 4: i16_any_tile_##ISA(kind, xm, stride, in, row, row_bytes, 1, 4, blocks, one); break; \
                    case 5: i16_any_tile_##ISA(kind, xm, stride, in, row, row_bytes, 1, 5, blocks, one); break; \
                    case 6: i16_any_tile_##ISA(kind, xm, stride, in, row, row_bytes, 1, 6, blocks, one); break; \
                    case 7: i16_any_tile_##ISA(kind, xm, stride, in, row, row_bytes, 1, 7, blocks, one); break; \
                    default: i16_any_tile_##ISA(kind, xm, stride, in, row, row_bytes, 1, 8, blocks, one); break;\
                }                                                                                               \
                for (int64_t k = 0; k < nm; ++k) sums[k * nr + r] = one[k];                                     \
            }                                                                                                   \
            for (int64_t k = 0; k < nm; ++k)                                                                    \
                for (int64_t q = 0; q < nr; ++q) {                                                              \
                    float v = sums[k * nr + q];                                                                 \
                    if (bias) v += bias[o0 + q];                                                                \
                    if (residual) v += residual[(m + k) * ld + o0 + q];                                         \
                    out[(m + k) * ld + o0 + q] = v;                                                             \
                }                                                                                               \
        }                                                                                                       \
    }
DK_I16_GROUP(avx2, 1)
#endif

#if DK_QUANT_AVX512 && defined(__AVX512BW__)
/* ---- AVX-512: the same fixed-point products, two pairs of blocks a vector ---------------------------------------
 * The AVX-512 path's float products take a block's 16 weights from a table (`vpermps`), about five shuffles a block
 * of 32 weights, and were bound by that port: a batch-1 GGUF token on a 2-core Zen 5 read its weights at 56-60% of
 * the bandwidth, and AVX2's fixed-point tiles (256 bits) ran the same one-row product 1.37x faster there. These
 * tiles are AVX2's arithmetic (`i16_tile_avx2`: the same activation layout, integer sums, d * sx and the mins' term)
 * with 512-bit vectors: a run's two 64-byte halves hold 4 blocks' quants each, masked and shifted to int16 once for
 * every activation row, each quad's 4 partial-sum vectors one `vpdpwssd` chain (VNNI; `vpmaddwd` and adds without
 * it, the same integers), and each output accumulates 16 lanes, one multiply-add a quad: its own order, the same in
 * every tile, so a row's result does not depend on its batch here either (AVX2's order instead, an 8-lane chain a
 * pair with the 512-bit sums split in halves, measured 1.11-1.22x slower at 2-16 activation rows and the same at
 * one). `laid_out_for` groups Q4_0 and Q4_1 for this path; blocks as stored gather their quants into the same lanes
 * (four 16-byte inserts a quad), so both layouts give the same bits.
 * Against the float tiles and panels they replace (2-core Zen 5, two threads, `benchmarks/kernel_ab.py --before
 * 64c0088 --stored-before`): Q4_1 131072 x 1536 (from memory) 1.54x at one activation row, 1.36x at 2, 1.76x at 4
 * and 8; 32768 x 1536 1.80x at one, 1.56-1.66x at 2-32; Q4_0 the same. */
ALWAYS_INLINE __m512i i16_dot4_avx512(const __m512i* v, const uint8_t* x) {
    __m512i x0 = _mm512_loadu_si512(x), x1 = _mm512_loadu_si512(x + 64);
    __m512i x2 = _mm512_loadu_si512(x + 128), x3 = _mm512_loadu_si512(x + 192);
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(_mm512_dpwssd_epi32(_mm512_madd_epi16(v[0], x0), v[1], x1),
                                                   v[2], x2), v[3], x3);
#else
    return _mm512_add_epi32(_mm512_add_epi32(_mm512_madd_epi16(v[0], x0), _mm512_madd_epi16(v[1], x1)),
                            _mm512_add_epi32(_mm512_madd_epi16(v[2], x2), _mm512_madd_epi16(v[3], x3)));
#endif
}

/* Sums for Q4_0 or Q4_1, grouped or as stored, as i16_tile_avx2 computes them, in an order of
 * their own: each output's 16 lanes take a run's mins term in the low 8 (masked), then per quad of blocks one
 * multiply-add of its 16 converted integer sums by d * sx spread 4 lanes a block (one `vpermps` a quad); the low 8
 * lanes plus the high 8 summed at the end. */
ALWAYS_INLINE void i16_tile_avx512(int kind, const uint8_t* xi, int64_t stride, const uint8_t* w, int64_t row_bytes,
                                   int R, int M, int64_t blocks, float* sums) {
    int one = kind == DK_Q4_1 || kind == DK_Q4_1G, grouped = is_grouped(kind);
    int64_t bytes = one ? 20 : 18, head = bytes - 16;
    const __m512i nibble = _mm512_set1_epi16(15);
    const __m512i spread[2] = {_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                               _mm512_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7)};
    __m512 acc[2][I16_TILE_MAX_M];
    __m512 ds[2][I16_TILE_MAX_M];
    for (int r = 0; r < R; ++r)
        for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
    for (int64_t g = 0; g * GROUP_BLOCKS < blocks; ++g) {
        int64_t n = blocks - g * GROUP_BLOCKS < GROUP_BLOCKS ? blocks - g * GROUP_BLOCKS : GROUP_BLOCKS;
        const uint8_t* run[2];
        for (int64_t line = 0; line < R * GROUP_BLOCKS * bytes; line += 64)
            i16_prefetch(w + line, R, GROUP_BLOCKS * bytes, g);
        for (int r = 0; r < R; ++r) {
            run[r] = w + r * row_bytes + g * GROUP_BLOCKS * bytes;
            __m256 d = run_halves_avx2(run[r], grouped ? 2 : bytes, n);
            __m256 mins = one ? run_halves_avx2(run[r] + (grouped ? 2 * n : 2), grouped ? 2 : bytes, n)
                              : _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
            for (int m = 0; m < M; ++m) {
                const float* xs = (const float*)(xi + m * stride + g * I16_GROUP_BYTES + 512);
                acc[r][m] = _mm512_mask3_fmadd_ps(_mm512_castps256_ps512(mins), _mm512_castps256_ps512(_mm256_loadu_ps(xs + 8)),
                                                  acc[r][m], 0x00FF);
                ds[r][m] = _mm512_castps256_ps512(_mm256_mul_ps(d, _mm256_loadu_ps(xs)));
            }
        }
        int64_t pairs = (n + 1) / 2;
        for (int64_t q = 0; 2 * q < pairs; ++q) {
            int64_t quad_blocks = n - 4 * q < 4 ? n - 4 * q : 4;
            __m512i v[2][4];
            for (int r = 0; r < R; ++r) {
                __m512i quants = _mm512_setzero_si512();
                if (grouped) {
                    /* a last run's missing blocks read as zeros (and are not read) */
                    const uint8_t* at = run[r] + head * n + 64 * q;
                    quants = quad_blocks == 4 ? _mm512_loadu_si512(at)
                                              : _mm512_maskz_loadu_epi8((__mmask64)((1ULL << (16 * quad_blocks)) - 1), at);
                } else {  /* the stored blocks' quants gathered 16 bytes at a time into the same lanes */
                    const uint8_t* at = run[r] + 4 * q * bytes + head;
                    quants = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i*)at));
                    if (quad_blocks > 1) quants = _mm512_inserti32x4(quants, _mm_loadu_si128((const __m128i*)(at + bytes)), 1);
                    if (quad_blocks > 2) quants = _mm512_inserti32x4(quants, _mm_loadu_si128((const __m128i*)(at + 2 * bytes)), 2);
                    if (quad_blocks > 3) quants = _mm512_inserti32x4(quants, _mm_loadu_si128((const __m128i*)(at + 3 * bytes)), 3);
                }
                v[r][0] = _mm512_and_si512(quants, nibble);
                v[r][1] = _mm512_and_si512(_mm512_srli_epi16(quants, 4), nibble);
                v[r][2] = _mm512_and_si512(_mm512_srli_epi16(quants, 8), nibble);
                v[r][3] = _mm512_srli_epi16(quants, 12);
            }
            for (int m = 0; m < M; ++m) {
                const uint8_t* quad = xi + m * stride + g * I16_GROUP_BYTES + i16_pair_offset(2 * q);
                for (int r = 0; r < R; ++r) {
                    __m512 P = _mm512_cvtepi32_ps(i16_dot4_avx512(v[r], quad));
                    acc[r][m] = _mm512_fmadd_ps(P, _mm512_permutexvar_ps(spread[q], ds[r][m]), acc[r][m]);
                }
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int m = 0; m < M; ++m)
            sums[m * R + r] = hsum_avx2(_mm256_add_ps(_mm512_castps512_ps256(acc[r][m]),
                                                      _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r][m]), 1))));
}

/* i16_any_tile_avx2 with Q4_0 and Q4_1 on the 512-bit tiles. */
ALWAYS_INLINE void i16_any_tile_avx512(int kind, const uint8_t* xm, int64_t stride, int64_t in, const uint8_t* w,
                                       int64_t row_bytes, int R, int M, int64_t blocks, float* sums) {
    if (kind == DK_Q4_1G) i16_tile_avx512(DK_Q4_1G, xm, stride, w, row_bytes, R, M, blocks, sums);
    else if (kind == DK_Q4_0G) i16_tile_avx512(DK_Q4_0G, xm, stride, w, row_bytes, R, M, blocks, sums);
    else if (kind == DK_Q4_1) i16_tile_avx512(DK_Q4_1, xm, stride, w, row_bytes, R, M, blocks, sums);
    else if (kind == DK_Q4_0) i16_tile_avx512(DK_Q4_0, xm, stride, w, row_bytes, R, M, blocks, sums);
    else i16_any_tile_avx2(kind, xm, stride, in, w, row_bytes, R, M, blocks, sums);
}

/* i16_group_avx2 on the 512-bit tiles (Q4_0 and Q4_1; other kinds on AVX2's). */
DK_I16_GROUP(avx512, 4)
#endif

/* Weight rows per tile of 3-4 activation rows (in registers or on a panel): two where the registers hold 2 x 4 x 2
 * accumulators (AVX-512's 32), else one. */
#define PANEL_R_avx512 2
#define PANEL_R_avx2 1
#define PANEL_R_portable 1
/* Weight rows per tile of ONE activation row (a batch-1 step): two on AVX2, whose one-row tile is bound by its
 * multiply-adds' latency (two accumulator chains an output, each step waiting for the one before), so a second weight
 * row's independent chains fill the gaps: each output's sum is the same, in the same order (a Q4_1 token 1.03x on a
 * 2-core Zen 3). Two on AVX-512 too, whose one-row tile is as latency-bound (four interleaved rows measured 1.09x
 * slower than one on a Zen 5; one against two there, kernel_ab: 0.93x in cache, 1.04x from memory, Q4_K 0.85x in
 * cache): on a 2-core Intel Xeon one Q4_1 row in cache 1.04x
 * (576 wide) and 1.10x (1536), Q8_0 1.06x, a batch-1 GGUF token 1.05x on top of the scales' broadcast from memory
 * (`head_splat_avx512`), two engines alternating in one process, same tokens. */
#define ONE_ROW_R_avx512 2
#define ONE_ROW_R_avx2 2
#define ONE_ROW_R_portable 1
/* Activation rows per tile of one weight row: 8 where the registers hold 8 x 2 accumulators beside the weight
 * vectors (AVX-512's 32), else 4; TILE_M_UPTO(ISA, k) is the tile for k rows (k where the ISA takes it). With 5-8
 * rows in one tile instead of two, each chunk is dequantized once for all of them: SmolLM2's Q4_1 layer products
 * (30 layers, 2-core Zen 5, the two libraries alternating in one process, equal outputs) 1.19x as fast at 5 rows,
 * 1.14x at 6, 1.12x at 7, 1.07x at 8 (a speculative step's verification rows); 1-4 rows run the same code. */
#define TILE_M_avx512 8
#define TILE_M_avx2 4
#define TILE_M_portable 4
#define TILE_M_UPTO(ISA, k) (TILE_M_##ISA < (k) ? TILE_M_##ISA : (k))

/* The activation rows from which each ISA's product takes the panels: AVX-512's 8-row tiles in registers beat the
 * panel up to 20 rows (Q4_1 layer products, 30 layers, 2-core Zen 5, in one process: 16 rows 1.13x, 17 1.06x, 20
 * 1.08x the panel's speed; 23 0.91x, 24 0.92x, 32 0.88x); the 4-row tiles elsewhere up to 15 (above). */
#define PANEL_MIN_ROWS_avx512 21
#define PANEL_MIN_ROWS_avx2 QUANT_PANEL_MIN_ROWS
#define PANEL_MIN_ROWS_portable QUANT_PANEL_MIN_ROWS

/* Output rows per work item for a product of `rows` activation rows on a path that takes the panels from
 * `panel_min_rows`. */
static inline int64_t group_span(int64_t kind, int64_t rows, int64_t panel_min_rows) {
    if (kind == DK_Q4_1X8) return 8;  /* its groups of 8 interleaved rows (X8_ROWS) */
    return rows >= panel_min_rows ? QUANT_PANEL_ROWS : QUANT_GROUP;
}

/* The calling thread's panel of at least `floats` floats (grown, never shrunk), or NULL without memory. */
static float* quant_panel(int64_t floats) {
    static __thread float* panel = NULL;
    static __thread int64_t capacity = 0;
    if (capacity < floats) {
        /* whole cache lines: a vector load that straddles two lines costs two */
        float* grown = aligned_alloc(64, ((size_t)floats * sizeof(float) + 63) / 64 * 64);
        if (grown == NULL) return NULL;
        free(panel);
        panel = grown;
        capacity = floats;
    }
    return panel;
}

/* A weight row of `chunks` chunks (`row_bytes` bytes) dequantized into dst: the floats the tiles multiply. */
ALWAYS_INLINE void dequantize_row_portable(int kind, const uint8_t* row, int64_t row_bytes, int64_t chunks,
                                           float* dst) {
    for (int64_t c = 0; c < chunks; ++c) {
        __builtin_prefetch(row + c * (row_bytes / chunks) + QUANT_PREFETCH_BYTES);
        chunk_scalar(kind, row, c, dst + c * CHUNK);
    }
}
/* The same with an ISA's chunks (NV vectors of WIDTH floats each), a K-quant's super-block constants computed once
 * for its 8 chunks (`ksuper_ISA`) as the tiles compute them. */
#define DK_DEQUANTIZE_ROW(ISA, VEC, NV, WIDTH, STORE)                                                           \
    ALWAYS_INLINE void dequantize_row_##ISA(int kind, const uint8_t* row, int64_t row_bytes, int64_t chunks,    \
                                            float* dst) {                                                       \
        int64_t step = row_bytes / chunks;  /* a chunk's bytes (K-quants: on average) */                       \
        float ks[16];                                                                                           \
        for (int64_t c = 0; c < chunks; ++c) {                                                                  \
            __builtin_prefetch(row + c * step + QUANT_PREFETCH_BYTES);                                          \
            if (is_kquant(kind) && c % 8 == 0) ksuper_##ISA(kind, row + c / 8 * block_bytes(kind), ks);         \
            VEC v[NV];                                                                                          \
            chunk_##ISA(kind, row, c, v, ks, -1);                                                               \
            for (int k = 0; k < NV; ++k) STORE(dst + c * CHUNK + WIDTH * k, v[k]);                              \
        }                                                                                                       \
    }
#if DK_QUANT_AVX2
DK_DEQUANTIZE_ROW(avx2, __m256, 4, 8, _mm256_storeu_ps)
#endif
#if DK_QUANT_AVX512
DK_DEQUANTIZE_ROW(avx512, __m512, 2, 16, _mm512_storeu_ps)
#endif

/* ---- Q4_1 interleaved by 8 weight rows (DK_Q4_1X8) ------------------------------------------------------------
 * The same bytes as Q4_1, regrouped when a model loads under DECODEKIT_GGUF_INTERLEAVE=on (quant.py's
 * `interleave_q4_1`, stored_matrices.py's `laid_out_for`): each 8 rows (row_bytes * 8 bytes, rows 8g..8g+7) hold,
 * chunk by chunk, 160 bytes: the 8 rows' fp16 scales d, their 8 fp16 mins m, then 4 x 32 bytes, dword j of the t-th
 * 32 being row j's quant bytes 4t..4t+3. A vector's 8 lanes are then 8 output rows: the product broadcasts one
 * activation into 8 rows' weights, the 8 scales and mins are one load each, and no output needs a horizontal sum. A
 * dword vector holds 8 quants a row: nibble i (bits 4i..4i+3) of dword t is the row's weight X8_WEIGHT(t, i), and is
 * isolated by ONE and (i < 7: q * 2^4i, exactly, converted exactly) or a shift (i = 7); the scale it is multiplied by
 * is d * 2^-4i (exact), so (d * 2^-4i) * (q * 2^4i) = d * q exactly and the fused d * q + m rounds once: each weight is
 * the float the Q4_1 chunk computes. Row-major Q4_1 on AVX2 widens each 8 bytes (a shuffle), shifts half its quants
 * and splats two fp16 halves a chunk: ~24 vector operations a chunk of a row; here ~16 (3.5 ands, half a shift, 4
 * conversions, 8 multiply-adds, the scales once for 8 rows).
 * Standalone, one row, in cache, one thread of a 2-core Zen 3: 1.9-2.0 ns a chunk of a row against 2.6-2.9
 * row-major; from memory, 2 threads, 1.1-1.5 against 1.8-2.1. But each activation is broadcast into the 8 rows'
 * lanes, one broadcast a multiply-add, and with four accumulators an output (the multiply-adds' latency) a tile
 * holds at most two activation rows: SmolLM2's layer products 1.12x (1 row), 1.07-1.11x (2), 0.81x (4), 0.79x (8).
 * So it is opt-in, for batch-1 decoding.
 *
 * Each output sums in one order whatever the rows: chunk by chunk, nibble i of dword t into accumulator i & 3 (t
 * before i), then (a0 + a1) + (a2 + a3). */
#define X8_ROWS 8
#define X8_CHUNK_BYTES (X8_ROWS * 20)
#define X8_WEIGHT(t, i) (4 * (t) + ((i) >> 1) + 16 * ((i) & 1))
/* 32 of the 160-byte chunks ahead (a prefetch per 64 bytes of the one stream a group reads) */
#define X8_PREFETCH_BYTES 5120

/* Chunk c's 8 x 32 weights as panel[(t * 8 + i) * 8 + j] = row j's weight X8_WEIGHT(t, i) (the portable path). */
ALWAYS_INLINE void x8_chunk_scalar(const uint8_t* p, float* panel) {
    for (int j = 0; j < X8_ROWS; ++j) {
        float d = half_at(p + 2 * j), m = half_at(p + 16 + 2 * j);
        for (int t = 0; t < 4; ++t)
            for (int s = 0; s < 4; ++s) {
                uint8_t b = p[32 + 32 * t + 4 * j + s];
                panel[(t * 8 + 2 * s) * 8 + j] = d * (float)(b & 15) + m;
                panel[(t * 8 + 2 * s + 1) * 8 + j] = d * (float)(b >> 4) + m;
            }
    }
}

/* A group's 8 outputs `sums` for activation row m stored at columns g0.. of out, with bias and residual. */
#define DK_X8_STORE(m, g0, sums)                                                                                \
    for (int j = 0; j < X8_ROWS; ++j) {                                                                         \
        float v = (sums)[j];                                                                                    \
        if (bias) v += bias[(g0) + j];                                                                          \
        if (residual) v += residual[(m) * ld + (g0) + j];                                                       \
        out[(m) * ld + (g0) + j] = v;                                                                           \
    }
/* The outputs of interleaved rows [o0, o0 + nr) (multiples of 8) for `rows` activation rows, a chunk of a group
 * dequantized at a time for each activation row (the portable path, which only tests and DECODEKIT_QUANT_ISA reach:
 * the layout is made for the AVX2 path). */
static void x8_group_portable(const float* x, int64_t rows, int64_t in, const uint8_t* w, int64_t row_bytes,
                              int64_t o0, int64_t nr, const float* bias, const float* residual, float* out,
                              int64_t ld) {
    float own[X8_ROWS * CHUNK], sums[X8_ROWS];
    for (int64_t g0 = o0; g0 < o0 + nr; g0 += X8_ROWS)
        for (int64_t m = 0; m < rows; ++m) {
            float acc[X8_ROWS][4] = {{0}};
            for (int64_t c = 0; c < in / CHUNK; ++c) {
                x8_chunk_scalar(w + g0 * row_bytes + c * X8_CHUNK_BYTES, own);
                for (int j = 0; j < X8_ROWS; ++j)
                    for (int t = 0; t < 4; ++t)
                        for (int i = 0; i < 8; ++i)
                            acc[j][i & 3] += x[m * in + c * CHUNK + X8_WEIGHT(t, i)] * own[(t * 8 + i) * 8 + j];
            }
            for (int j = 0; j < X8_ROWS; ++j) sums[j] = (acc[j][0] + acc[j][1]) + (acc[j][2] + acc[j][3]);
            DK_X8_STORE(m, g0, sums)
        }
}

#if DK_QUANT_AVX2
/* Group gp's chunk c: its 8 rows' scales d * 2^-4i (i = 0..7; d * 2^-28 is not needed: nibble 7 is shifted down) in
 * ds[i], for multiply-adds that read them from memory, and its mins m. */
ALWAYS_INLINE __m256 x8_scales_avx2(const uint8_t* p, float ds[8][8]) {
    __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
    _mm256_store_ps(ds[0], d);
    _mm256_store_ps(ds[7], d);
    for (int i = 1; i < 7; ++i) _mm256_store_ps(ds[i], _mm256_mul_ps(d, _mm256_set1_ps(1.0f / (float)(1 << (4 * i)))));
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 16)));
}

/* Nibble i of the 8 rows' dwords `dw` as their weights: q * 2^4i by one and (q itself by a shift for i = 7),
 * converted exactly, times `di` = d * 2^-4i (exact), plus m: the float d * q + m, rounded once. */
ALWAYS_INLINE __m256 x8_weights_avx2(__m256i dw, int i, __m256 di, __m256 m) {
    __m256i q = i < 7 ? _mm256_and_si256(dw, _mm256_set1_epi32(15 << (4 * (i % 7)))) : _mm256_srli_epi32(dw, 28);
    return _mm256_fmadd_ps(di, _mm256_cvtepi32_ps(q), m);
}

ALWAYS_INLINE void x8_prefetch(const uint8_t* p) {
    __builtin_prefetch(p + X8_PREFETCH_BYTES);
    __builtin_prefetch(p + X8_PREFETCH_BYTES + 64);
    __builtin_prefetch(p + X8_PREFETCH_BYTES + 128);
}

/* The 8 outputs of a group for M (1-2) activation rows x (`in` apart), each chunk dequantized in registers once for
 * both: sums[k] = the outputs for row k. Each output sums its chunk's products in four accumulators, nibble i of
 * dword t into accumulator i & 3 (t before i), chunk by chunk, then (a0 + a1) + (a2 + a3): the same order for one
 * row or two, so a row's result does not depend on the rows beside it. Four chains a row keep the multiply-adds'
 * latency covered; 2 x 4 accumulators fill the registers, so the scales are read from memory. (Three or four rows
 * a tile would need 12-16 accumulators; a tile over two groups or over pairs of rows, broadcasting 4 activations,
 * measured slower here.) */
ALWAYS_INLINE void x8_tile_avx2(const float* x, int64_t in, int64_t chunks, const uint8_t* gp, int M, __m256* sums) {
    __m256 acc[2][4];
    _Pragma("GCC unroll 2") for (int k = 0; k < M; ++k)
        acc[k][0] = acc[k][1] = acc[k][2] = acc[k][3] = _mm256_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
        const uint8_t* p = gp + c * X8_CHUNK_BYTES;
        x8_prefetch(p);
        float ds[8][8] __attribute__((aligned(32)));
        __m256 m = x8_scales_avx2(p, ds);
        const float* xc = x + c * CHUNK;
        _Pragma("GCC unroll 4") for (int t = 0; t < 4; ++t) {
            __m256i dw = _mm256_loadu_si256((const __m256i*)(p + 32 + 32 * t));
            _Pragma("GCC unroll 8") for (int i = 0; i < 8; ++i) {
                __m256 wv = x8_weights_avx2(dw, i, _mm256_load_ps(ds[i]), m);
                _Pragma("GCC unroll 2") for (int k = 0; k < M; ++k)
                    acc[k][i & 3] = _mm256_fmadd_ps(_mm256_broadcast_ss(xc + k * in + X8_WEIGHT(t, i)), wv,
                                                    acc[k][i & 3]);
            }
        }
    }
    _Pragma("GCC unroll 2") for (int k = 0; k < M; ++k)
        sums[k] = _mm256_add_ps(_mm256_add_ps(acc[k][0], acc[k][1]), _mm256_add_ps(acc[k][2], acc[k][3]));
}

/* x8_tile_avx2 of one activation row with the scales in registers (12 of 16 hold the 4 accumulators, the 7 scales
 * and the mins): the same sums. */
ALWAYS_INLINE __m256 x8_one_avx2(const float* x, int64_t chunks, const uint8_t* gp) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t c = 0; c < chunks; ++c) {
        const uint8_t* p = gp + c * X8_CHUNK_BYTES;
        x8_prefetch(p);
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
        __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 16)));
        __m256 di[8];
        di[0] = di[7] = d;
        for (int i = 1; i < 7; ++i) di[i] = _mm256_mul_ps(d, _mm256_set1_ps(1.0f / (float)(1 << (4 * i))));
        const float* xc = x + c * CHUNK;
        _Pragma("GCC unroll 4") for (int t = 0; t < 4; ++t) {
            __m256i dw = _mm256_loadu_si256((const __m256i*)(p + 32 + 32 * t));
            _Pragma("GCC unroll 8") for (int i = 0; i < 8; ++i) {
                __m256 wv = x8_weights_avx2(dw, i, di[i], m);
                acc[i & 3] = _mm256_fmadd_ps(_mm256_broadcast_ss(xc + X8_WEIGHT(t, i)), wv, acc[i & 3]);
            }
        }
    }
    return _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
}

/* Interleaved rows [o0, o0 + nr) (multiples of 8), a group at a time, 2 activation rows a tile. */
static void x8_group_avx2(const float* x, int64_t rows, int64_t in, const uint8_t* w, int64_t row_bytes,
                          int64_t o0, int64_t nr, const float* bias, const float* residual, float* out, int64_t ld) {
    int64_t chunks = in / CHUNK;
    float sums[X8_ROWS];
    __m256 s[2];
    for (int64_t g0 = o0; g0 < o0 + nr; g0 += X8_ROWS) {
        const uint8_t* gp = w + g0 * row_bytes;
        for (int64_t m = 0; m < rows; m += 2) {
            int M = rows - m >= 2 ? 2 : 1;
            if (M == 2) x8_tile_avx2(x + m * in, in, chunks, gp, 2, s);
            else s[0] = x8_one_avx2(x + m * in, chunks, gp);
            for (int k = 0; k < M; ++k) {
                _mm256_storeu_ps(sums, s[k]);
                DK_X8_STORE(m + k, g0, sums)
            }
        }
    }
}
/* AVX-512 keeps row-major Q4_1 (its table of 16 weights); an interleaved weight handed to it runs the AVX2 code. */
#define x8_group_avx512 x8_group_avx2
#endif

/* Chunk p's 8 x 32 weights as x8_chunk_scalar lays them out, in vectors where the CPU has AVX2 (the same floats). */
ALWAYS_INLINE void x8_chunk(const uint8_t* p, float* panel) {
#if DK_QUANT_AVX2
    float ds[8][8] __attribute__((aligned(32)));
    __m256 m = x8_scales_avx2(p, ds);
    for (int t = 0; t < 4; ++t) {
        __m256i dw = _mm256_loadu_si256((const __m256i*)(p + 32 + 32 * t));
        _Pragma("GCC unroll 8") for (int i = 0; i < 8; ++i)
            _mm256_store_ps(panel + (t * 8 + i) * 8, x8_weights_avx2(dw, i, _mm256_load_ps(ds[i]), m));
    }
#else
    x8_chunk_scalar(p, panel);
#endif
}

/* Interleaved rows [o0, o0 + nr) (multiples of 8) dequantized back to row-major float rows out [nr, in] (the
 * weights BLAS multiplies above GGUF_NATIVE_MAX_ROWS rows). */
static void x8_dequantize(const uint8_t* w, int64_t row_bytes, int64_t o0, int64_t nr, int64_t in, float* out) {
    float own[X8_ROWS * CHUNK] __attribute__((aligned(32)));
    for (int64_t g0 = o0; g0 < o0 + nr; g0 += X8_ROWS)
        for (int64_t c = 0; c < in / CHUNK; ++c) {
            x8_chunk(w + g0 * row_bytes + c * X8_CHUNK_BYTES, own);
            for (int j = 0; j < X8_ROWS; ++j)
                for (int t = 0; t < 4; ++t)
                    for (int i = 0; i < 8; ++i)
                        out[(g0 - o0 + j) * in + c * CHUNK + X8_WEIGHT(t, i)] = own[(t * 8 + i) * 8 + j];
        }
}


/* The outputs [o0, o0 + nr) (nr <= QUANT_GROUP) for every activation row, in tiles of one weight row by up to 4
 * activation rows (two weight rows by 3-4 where the registers hold them), stored with bias and residual. One weight
 * row at a time is one stream of memory per thread: one row's product took 4 weight rows interleaved before, and one
 * at a time measured a SmolLM2 token as stored (Q4_1) 1.09x as fast (2-core Zen 5, two engines alternating in one
 * process); two rows' took 2x2 tiles, no faster than 1x2. */
#define DK_QUANT_GROUP(ISA)                                                                                     \
    ALWAYS_INLINE void group_##ISA(int kind, const float* x, int64_t rows, int64_t in, const uint8_t* w,       \
                                   int64_t row_bytes, int64_t o0, int64_t nr, const float* bias,                \
                                   const float* residual, float* out, int64_t ld) {                             \
        float sums[QUANT_GROUP * TILE_MAX_M];                                                                   \
        const uint8_t* wr = w + o0 * row_bytes;                                                                 \
        int wide = WIDE_M_##ISA > TILE_M_##ISA && wide_kind(kind);                                             \
        for (int64_t m = 0; m < rows;) {                                                                        \
            int64_t left = rows - m, nm = left >= TILE_M_##ISA ? TILE_M_##ISA : left;                           \
            if (wide && left > TILE_M_##ISA && left <= WIDE_M_##ISA && left * in * 4 <= WIDE_MAX_BYTES) nm = left; \
            const float* xm = x + m * in;                                                                       \
            int64_t r = 0;                                                                                      \
            if (nm > TILE_M_##ISA) { /* 5-6 rows in one pass (AVX2's wide tiles) */                              \
                WIDE_ROWS_##ISA(kind, xm, in, wr, row_bytes, nr, (int)nm, sums);                                   \
                r = nr;                                                                                         \
            }                                                                                                   \
            /* where the registers hold them (AVX-512), pairs of weight rows: each activation vector loaded       \
             * once for two (4-12 rows of SmolLM2's products 4-5% faster than one weight row at a time; 5 rows     \
             * 1.09x and 13 rows 1.05x against one weight row by 5; two by 6 measured no faster than one by 6) */  \
            if (PANEL_R_##ISA == 2 && nm >= 3 && nm <= 5)                                                      \
                for (; r + 2 <= nr; r += 2) {                                                                   \
                    float two[10];                                                                              \
                    if (nm == 3) tile_##ISA(kind, xm, in, wr + r * row_bytes, row_bytes, 2, 3, two);            \
                    else if (nm == 4) tile_##ISA(kind, xm, in, wr + r * row_bytes, row_bytes, 2, 4, two);       \
                    else tile_##ISA(kind, xm, in, wr + r * row_bytes, row_bytes, 2, TILE_M_UPTO(ISA, 5), two);  \
                    for (int64_t k = 0; k < nm; ++k) {                                                          \
                        sums[k * nr + r] = two[k * 2];                                                          \
                        sums[k * nr + r + 1] = two[k * 2 + 1];                                                  \
                    }                                                                                           \
                }                                                                                               \
            if (ONE_ROW_R_##ISA == 2 && nm == 1)                                                               \
                for (; r + 2 <= nr; r += 2) {                                                                   \
                    float two[2];                                                                               \
                    tile_##ISA(kind, xm, in, wr + r * row_bytes, row_bytes, 2, 1, two);                         \
                    sums[r] = two[0];                                                                           \
                    sums[r + 1] = two[1];                                                                       \
                }                                                                                               \
            for (; r < nr; ++r) {                                                                               \
                float one[TILE_MAX_M];                                                                          \
                switch (nm) {                                                                                   \
                    case 1: tile_##ISA(kind, xm, in, wr + r * row_bytes, row_bytes, 1, 1, one); break;          \
                    case 2: tile_##ISA(kind, xm, in, wr + r * row_bytes, row_bytes, 1, 2, one); break;          \
                    case 3: tile_##ISA(kind, xm, in, wr + r * row_bytes, row_bytes, 1, 3, one); break;          \
                    case 4: tile_##ISA(kind, xm, in, wr + r * row_bytes, row_bytes, 1, 4, one); break;          \
                    /* 5-8 activation rows where the registers hold 16 accumulators (AVX-512's 32): each chunk   \
                     * dequantized once for all of them, not once per 4 */                                       \
                    case 5: tile_##ISA(kind, xm, in, wr + r * row_bytes, row_bytes, 1, TILE_M_UPTO(ISA, 5), one); break; \
                    case 6: tile_##ISA(kind, xm, in, wr + r * row_bytes, row_bytes, 1, TILE_M_UPTO(ISA, 6), one); break; \
                    case 7: tile_##ISA(kind, xm, in, wr + r * row_bytes, row_bytes, 1, TILE_M_UPTO(ISA, 7), one); break; \
                    default: tile_##ISA(kind, xm, in, wr + r * row_bytes, row_bytes, 1, TILE_M_##ISA, one); break; \
                }                                                                                               \
                for (int64_t k = 0; k < nm; ++k) sums[k * nr + r] = one[k];                                     \
            }                                                                                                   \
            for (int64_t k = 0; k < nm; ++k)                                                                    \
                for (int64_t r = 0; r < nr; ++r) {                                                              \
                    float v = sums[k * nr + r];                                                                 \
                    if (bias) v += bias[o0 + r];                                                                \
                    if (residual) v += residual[(m + k) * ld + o0 + r];                                         \
                    out[(m + k) * ld + o0 + r] = v;                                                             \
                }                                                                                               \
            m += nm;                                                                                            \
        }                                                                                                       \
    }                                                                                                           \
    /* The outputs [o0, o0 + nr) (nr <= QUANT_PANEL_ROWS) of many activation rows: the nr weight rows dequantized  \
     * once into `panel` (nr x in floats, chunk by chunk as the tiles dequantize them), then multiplied from there \
     * in tiles of PR weight rows x up to 4 activation rows: each weight dequantized once per product instead of \
     * once per 4 activation rows, and each activation vector loaded once for PR weight rows. Without a panel    \
     * (no memory) it runs `group_ISA`; both sum every output in the same order, so the result is the same. */   \
    ALWAYS_INLINE void panel_group_##ISA(int kind, const float* x, int64_t rows, int64_t in, const uint8_t* w,  \
                                         int64_t row_bytes, int64_t o0, int64_t nr, const float* bias,          \
                                         const float* residual, float* out, int64_t ld, int PR) {               \
        float* panel = quant_panel(nr * in);                                                                    \
        if (panel == NULL) {                                                                                    \
            for (int64_t g = 0; g < nr; g += QUANT_GROUP)                                                       \
                group_##ISA(kind, x, rows, in, w, row_bytes, o0 + g, nr - g < QUANT_GROUP ? nr - g : QUANT_GROUP,\
                            bias, residual, out, ld);                                                          \
            return;                                                                                             \
        }                                                                                                       \
        for (int64_t r = 0; r < nr; ++r)                                                                        \
            dequantize_row_##ISA(kind, w + (o0 + r) * row_bytes, row_bytes, in / CHUNK, panel + r * in);        \
        const uint8_t* p = (const uint8_t*)panel;                                                               \
        int64_t pb = in * (int64_t)sizeof(float);                                                               \
        float sums[16] = {0};  /* every tile writes it: zeroed once for the compiler's sake */                 \
        for (int64_t m = 0; m < rows; m += 4) {                                                                 \
            int nm = rows - m < 4 ? (int)(rows - m) : 4;                                                        \
            const float* xm = x + m * in;                                                                       \
            for (int64_t r = 0; r < nr; r += PR) {                                                              \
                int R = nr - r < PR ? (int)(nr - r) : PR;                                                       \
                const uint8_t* wr = p + r * pb;                                                                 \
                switch (R * 4 + nm) {  /* each (R, M) its own unrolled tile */                                  \
                    case 5: tile_##ISA(DK_F32, xm, in, wr, pb, 1, 1, sums); break;                              \
                    case 6: tile_##ISA(DK_F32, xm, in, wr, pb, 1, 2, sums); break;                              \
                    case 7: tile_##ISA(DK_F32, xm, in, wr, pb, 1, 3, sums); break;                              \
                    case 8: tile_##ISA(DK_F32, xm, in, wr, pb, 1, 4, sums); break;                              \
                    case 9: tile_##ISA(DK_F32, xm, in, wr, pb, 2, 1, sums); break;                              \
                    case 10: tile_##ISA(DK_F32, xm, in, wr, pb, 2, 2, sums); break;                             \
                    case 11: tile_##ISA(DK_F32, xm, in, wr, pb, 2, 3, sums); break;                             \
                    default: panel_tile_2x4_##ISA(xm, in, (const float*)wr, sums); break;                       \
                }                                                                                               \
                for (int k = 0; k < nm; ++k)                                                                    \
                    for (int q = 0; q < R; ++q) {                                                               \
                        int64_t o = o0 + r + q;                                                                 \
                        float v = sums[k * R + q];                                                              \
                        if (bias) v += bias[o];                                                                 \
                        if (residual) v += residual[(m + k) * ld + o];                                          \
                        out[(m + k) * ld + o] = v;                                                              \
                    }                                                                                           \
            }                                                                                                   \
        }                                                                                                       \
    }                                                                                                           \
    /* one group of output rows, the way its rows take: QUANT_GROUP rows in registers, or a panel of            \
     * QUANT_PANEL_ROWS for PANEL_MIN_ROWS_ISA activation rows and more (`span` says which) */                 \
    ALWAYS_INLINE void any_group_##ISA(int kind, const float* x, const uint8_t* xi, int64_t rows, int64_t in,  \
                                       const uint8_t* w, int64_t row_bytes, int64_t o0, int64_t nr,             \
                                       const float* bias, const float* residual, float* out, int64_t ld) {      \
        if (xi != NULL && I16_KIND_##ISA(kind)) /* activations in 16-bit fixed point, any rows */               \
            I16_GROUP_##ISA(kind, xi, rows, in, w, row_bytes, o0, nr, bias, residual, out, ld);                 \
        else if (rows >= PANEL_MIN_ROWS_##ISA)                                                                  \
            panel_group_##ISA(kind, x, rows, in, w, row_bytes, o0, nr, bias, residual, out, ld, PANEL_R_##ISA); \
        else                                                                                                    \
            group_##ISA(kind, x, rows, in, w, row_bytes, o0, nr, bias, residual, out, ld);                      \
    }                                                                                                           \
    /* one group of output rows of weights of type `kind`: the one place each type's tiles are instantiated (the  \
     * products below all call it, out of line: a call per group of 4-16 output rows, where inlining it into each \
     * took the compiler three times as long, quant.c's -O3 build past two minutes on a 2-core Zen 3) */         \
    static void grouped_rows_##ISA(int kind, const float* x, int64_t rows, int64_t in, const uint8_t* w,        \
                                  int64_t row_bytes, int64_t o0, int64_t nr, const float* bias,                 \
                                  const float* residual, float* out, int64_t ld);                               \
    static __attribute__((noinline)) void kind_group_##ISA(int kind, const float* x, const uint8_t* xi,         \
                                                           int64_t rows, int64_t in,                            \
                                                           const uint8_t* w, int64_t row_bytes, int64_t o0,     \
                                                           int64_t nr, const float* bias, const float* residual,\
                                                           float* out, int64_t ld) {                            \
        switch (kind) {                                                                                         \
            case DK_Q4_0: any_group_##ISA(DK_Q4_0, x, xi, rows, in, w, row_bytes, o0, nr, bias, residual, out, ld); break; \
            case DK_Q4_1: any_group_##ISA(DK_Q4_1, x, xi, rows, in, w, row_bytes, o0, nr, bias, residual, out, ld); break; \
            case DK_Q4_1X8: x8_group_##ISA(x, rows, in, w, row_bytes, o0, nr, bias, residual, out, ld); break;       \
            case DK_Q8_0: any_group_##ISA(DK_Q8_0, x, xi, rows, in, w, row_bytes, o0, nr, bias, residual, out, ld); break; \
            case DK_Q4_0G:                                                                                      \
            case DK_Q4_1G:                                                                                      \
                if (xi != NULL) I16_GROUP_##ISA(kind, xi, rows, in, w, row_bytes, o0, nr, bias, residual, out, ld); \
                else grouped_rows_##ISA(kind, x, rows, in, w, row_bytes, o0, nr, bias, residual, out, ld);       \
                break;                                                                                          \
            case DK_Q4_K: any_group_##ISA(DK_Q4_K, x, xi, rows, in, w, row_bytes, o0, nr, bias, residual, out, ld); break; \
            default: any_group_##ISA(DK_Q6_K, x, xi, rows, in, w, row_bytes, o0, nr, bias, residual, out, ld); break; \
        }                                                                                                       \
    }                                                                                                           \
    /* a grouped layout's rows where the fixed-point tiles do not run (other paths, float32 activations, no memory \
     * for the activations' layout): each row back in the file's layout, then that type's product, one row at a  \
     * time (slow, and never the way decodekit multiplies them: `laid_out_for` groups blocks only for those tiles) */\
    static void grouped_rows_##ISA(int kind, const float* x, int64_t rows, int64_t in, const uint8_t* w,        \
                                  int64_t row_bytes, int64_t o0, int64_t nr, const float* bias,                 \
                                  const float* residual, float* out, int64_t ld) {                              \
        uint8_t row[row_bytes];                                                                                 \
        for (int64_t r = o0; r < o0 + nr; ++r) {                                                                \
            ungroup_row(kind, w + r * row_bytes, row, in / CHUNK);                                              \
            kind_group_##ISA(grouped_base(kind), x, NULL, rows, in, row, row_bytes, 0, 1, bias ? bias + r : NULL, \
                             residual ? residual + r : NULL, out + r, ld);                                      \
        }                                                                                                       \
    }                                                                                                           \
    /* the whole product on one path */                                                                        \
    static void linear_##ISA(int kind, const float* x, int64_t rows, int64_t in, const uint8_t* w,             \
                             int64_t out_rows, const float* bias, const float* residual, float* out, int64_t ld,\
                             int64_t row_bytes, int parallel, int fixed) {                                      \
        int64_t span = group_span(kind, rows, PANEL_MIN_ROWS_##ISA);                                            \
        int64_t groups = (out_rows + span - 1) / span;                                                          \
        const uint8_t* xi = I16_ROWS_##ISA(fixed && I16_KIND_##ISA(kind), x, rows, in);                         \
        DK_QUANT_FOR_GROUPS(parallel) for (int64_t g = 0; g < groups; ++g) {                                    \
            int64_t o0 = g * span, nr = out_rows - o0 < span ? out_rows - o0 : span;                            \
            kind_group_##ISA(kind, x, xi, rows, in, w, row_bytes, o0, nr, bias, residual, out, ld);             \
        }                                                                                                       \
    }

/* A stack of parts (q, k and v; gate and up), each its own format and rows, multiplied into its columns of one
 * output in ONE parallel region: the groups of all parts are numbered in a row and split over the threads together.
 * A batch-1 GGUF layer opened seven parallel regions, one per part; this makes it four, and each group's arithmetic
 * is the one `linear_ISA` does. */
#define DK_QUANT_PARTS(ISA)                                                                                     \
    static void parts_##ISA(int64_t parts, const int64_t* kinds, const uint8_t* const* blocks,                 \
                            const int64_t* starts, const int64_t* part_rows, const float* x, int64_t rows,      \
                            int64_t in, const float* bias, const float* residual, float* out, int64_t ld,       \
                            int parallel, int fixed) {                                                          \
        int64_t first[DK_QUANT_MAX_PARTS + 1] = {0}, span[DK_QUANT_MAX_PARTS];                                  \
        int any_i16 = 0;                                                                                        \
        for (int64_t p = 0; p < parts; ++p) {                                                                   \
            span[p] = group_span(kinds[p], rows, PANEL_MIN_ROWS_##ISA);                                         \
            first[p + 1] = first[p] + (part_rows[p] + span[p] - 1) / span[p];                                   \
            any_i16 |= I16_KIND_##ISA(kinds[p]);                                                                \
        }                                                                                                       \
        const uint8_t* xi = I16_ROWS_##ISA(fixed && any_i16, x, rows, in);                                      \
        DK_QUANT_FOR_GROUPS(parallel) for (int64_t g = 0; g < first[parts]; ++g) {                              \
            dk_side_prefetch(DK_QUANT_THREAD, DK_QUANT_THREADS, g, first[parts]);                               \
            int64_t p = 0;                                                                                      \
            while (g >= first[p + 1]) ++p;                                                                      \
            int64_t o0 = (g - first[p]) * span[p], left = part_rows[p] - o0;                                    \
            int64_t nr = left < span[p] ? left : span[p], start = starts[p];                                    \
            int64_t row_bytes = dk_quant_row_bytes(kinds[p], in);                                               \
            const float* b = bias ? bias + start : 0;                                                           \
            const float* r = residual ? residual + start : 0;                                                   \
            kind_group_##ISA((int)kinds[p], x, xi, rows, in, blocks[p], row_bytes, o0, nr, b, r, out + start, ld); \
        }                                                                                                       \
    }

/* A gate/up product (two parts of `inter` rows each: gate into columns [0, inter) of gate_up, up into [inter,
 * 2 inter)) whose threads each take the same rows of both parts and SiLU-gate them right after their products
 * (`dk_silu_mul_range`, into gated [rows, inter]): the gating reads only what the thread has just written, in its own
 * cache, inside the product's parallel region. Split by groups over both parts in a row, the gate half went to one
 * core and the up half to the other, and the gating was a pass of its own reading across cores. Each group's
 * arithmetic is the one `linear_ISA` does. Shares of the rows start at multiples of 8 (the gating's vectors). */
#define DK_QUANT_GATED(ISA)                                                                                     \
    static void gated_##ISA(const int64_t* kinds, const uint8_t* const* blocks, int64_t inter, const float* x,   \
                            int64_t rows, int64_t in, float* gate_up, float* gated, int parallel, int fixed) {   \
        int64_t spans[2] = {group_span(kinds[0], rows, PANEL_MIN_ROWS_##ISA),                                   \
                            group_span(kinds[1], rows, PANEL_MIN_ROWS_##ISA)};                                  \
        int64_t unit = spans[0] > spans[1] ? spans[0] : spans[1];                                               \
        unit = unit < 8 ? 8 : unit; /* a multiple of either span (4, 8 or 16) */                                \
        int64_t units = (inter + unit - 1) / unit;                                                              \
        const uint8_t* xi = I16_ROWS_##ISA(fixed && (I16_KIND_##ISA(kinds[0]) || I16_KIND_##ISA(kinds[1])), x, rows, in); \
        DK_QUANT_PARALLEL(parallel) {                                                                           \
            int64_t b = units * DK_QUANT_THREAD / DK_QUANT_THREADS * unit;                                      \
            int64_t e = units * (DK_QUANT_THREAD + 1) / DK_QUANT_THREADS * unit;                                \
            e = e < inter ? e : inter;                                                                          \
            for (int64_t p = 0; p < 2; ++p) {                                                                   \
                int64_t row_bytes = dk_quant_row_bytes(kinds[p], in);                                           \
                int64_t span = spans[p];                                                                        \
                for (int64_t o0 = b; o0 < e; o0 += span) {                                                      \
                    int64_t nr = e - o0 < span ? e - o0 : span;                                                 \
                    float* o = gate_up + p * inter;                                                             \
                    kind_group_##ISA((int)kinds[p], x, xi, rows, in, blocks[p], row_bytes, o0, nr, 0, 0, o,     \
                                     2 * inter);                                                                \
                }                                                                                               \
            }                                                                                                   \
            if (b < e) dk_silu_mul_range(gate_up, gated, rows, inter, b, e);                                    \
        }                                                                                                       \
    }

void dk_silu_mul_range(const float* gate_up, float* out, int64_t rows, int64_t inter, int64_t begin, int64_t end);

/* Parts of one stacked product at most (layers.c's DK_STACK_PARTS). */
#define DK_QUANT_MAX_PARTS 4

#ifdef _OPENMP
#define DK_PRAGMA(x) _Pragma(#x)
#define DK_QUANT_FOR_GROUPS(parallel) DK_PRAGMA(omp parallel for schedule(static) if (parallel))
#define DK_QUANT_PARALLEL(parallel) DK_PRAGMA(omp parallel if (parallel))
#define DK_QUANT_THREAD omp_get_thread_num()
#define DK_QUANT_THREADS omp_get_num_threads()
#else
#define DK_QUANT_FOR_GROUPS(parallel) (void)(parallel);
#define DK_QUANT_PARALLEL(parallel) (void)(parallel);
#define DK_QUANT_THREAD 0
#define DK_QUANT_THREADS 1
#endif

int64_t dk_quant_row_bytes(int64_t kind, int64_t in);
void dk_side_prefetch(int64_t part, int64_t parts, int64_t unit, int64_t units);

/* The activation rows laid out for the fixed-point products (`i16_prepare_avx2`) in the calling thread's
 * buffer, once per product before its parallel region (`any`: the product has such weights); NULL on the other paths,
 * for other weights, or without memory (then the float tiles run). */
#if DK_QUANT_AVX2
static const uint8_t* i16_rows_avx2(int any, const float* x, int64_t rows, int64_t in) {
    if (!any || rows == 0) return NULL;
    uint8_t* rows_laid_out = i16_buffer(rows * i16_row_bytes(in));
    if (rows_laid_out != NULL) i16_prepare_avx2(x, rows, in, rows_laid_out);
    return rows_laid_out;
}
#define I16_ROWS_avx2 i16_rows_avx2
#define I16_GROUP_avx2 i16_group_avx2
#endif
#define I16_ROWS_portable(any, x, rows, in) ((void)(any), (const uint8_t*)NULL)
#define I16_GROUP_portable(...) ((void)0)
#if DK_QUANT_AVX512
/* AVX-512's Q4_0, Q4_1 and Q8_0: AVX2's activation layout, its grouped layouts on the 512-bit tiles (AVX512BW) */
#define I16_ROWS_avx512 i16_rows_avx2
#if defined(__AVX512BW__)
#define I16_GROUP_avx512 i16_group_avx512
#else
#define I16_GROUP_avx512 i16_group_avx2
#endif
#endif

DK_QUANT_GROUP(portable)
DK_QUANT_PARTS(portable)
DK_QUANT_GATED(portable)
#if DK_QUANT_AVX2
DK_QUANT_GROUP(avx2)
DK_QUANT_PARTS(avx2)
DK_QUANT_GATED(avx2)
#endif
#if DK_QUANT_AVX512
DK_QUANT_GROUP(avx512)
DK_QUANT_PARTS(avx512)
DK_QUANT_GATED(avx512)
#endif

/* Or'd into a product's `isa`: multiply float32 activations on every path (AVX2's Q4_0, Q4_1 and Q8_0 products and
 * AVX-512's Q4_0 and Q4_1 otherwise round them to 16-bit fixed point per block: `i16_prepare_avx2`). */
#define DK_QUANT_FLOAT_ACTIVATIONS 8

/* Whether a product's `isa` argument keeps the fixed-point activations (no DK_QUANT_FLOAT_ACTIVATIONS), the flag
 * cleared from *isa so that it names the path alone. */
static inline int fixed_point_asked(int64_t* isa) {
    int fixed = !(*isa & DK_QUANT_FLOAT_ACTIVATIONS);
    *isa &= ~(int64_t)DK_QUANT_FLOAT_ACTIVATIONS;
    return fixed;
}

/* The best path this library was compiled with: 2 AVX-512, 1 AVX2 + FMA, 0 portable C. */
int dk_quant_isa(void) {
    return DK_QUANT_AVX512 ? 2 : DK_QUANT_AVX2 ? 1 : 0;
}

/* Whether `rows` rows of type `kind` are whole groups of its layout (an interleaved type's 8 rows). */
static inline int whole_groups(int64_t kind, int64_t rows) {
    return kind != DK_Q4_1X8 || rows % X8_ROWS == 0;
}

/* Bytes of one row of `in` weights of type `kind`; 0 for a type these kernels do not take or a row length that is
 * not a whole number of its blocks. */
int64_t dk_quant_row_bytes(int64_t kind, int64_t in) {
    int64_t per = block_weights(kind), bytes = block_bytes(kind);
    if (bytes == 0 || in <= 0 || in % per != 0) return 0;
    return in / per * bytes;
}

/* out[m * ld + o] = sum_i x[m * in + i] * W[o, i] (+ bias[o]) (+ residual[m * ld + o]) for the `rows` float32 rows
 * of x and the `out_rows` rows of W, stored as GGUF blocks of type `kind` row after row (`dk_quant_row_bytes(kind,
 * in)` bytes each), on path `isa` (capped at `dk_quant_isa()`; with DK_QUANT_FLOAT_ACTIVATIONS or'd in, float32
 * activations whatever the path). From 64K weight-row products the groups of 4
 * output rows are split over torch's threads. Returns 0, or -1 (nothing computed) for a type or width it does not
 * take. */
int dk_quant_linear(int64_t kind, const float* x, int64_t rows, int64_t in, const uint8_t* w, int64_t out_rows,
                    const float* bias, const float* residual, float* out, int64_t ld, int64_t isa) {
    int64_t row_bytes = dk_quant_row_bytes(kind, in);
    if (row_bytes == 0 || rows < 0 || out_rows < 0 || !whole_groups(kind, out_rows)) return -1;
    int parallel = out_rows * in * (rows < 8 ? rows : 8) >= 65536 && out_rows > QUANT_GROUP;
    int fixed = fixed_point_asked(&isa);
#if DK_QUANT_AVX512
    if (isa >= 2) { linear_avx512((int)kind, x, rows, in, w, out_rows, bias, residual, out, ld, row_bytes, parallel, fixed); return 0; }
#endif
#if DK_QUANT_AVX2
    if (isa >= 1) { linear_avx2((int)kind, x, rows, in, w, out_rows, bias, residual, out, ld, row_bytes, parallel, fixed); return 0; }
#endif
    (void)isa;
    linear_portable((int)kind, x, rows, in, w, out_rows, bias, residual, out, ld, row_bytes, parallel, fixed);
    return 0;
}

/* `dk_quant_linear` of a stack of `parts` (at most 4) weights sharing x: part p, of type kinds[p] with part_rows[p]
 * rows at blocks[p], fills columns [starts[p], starts[p] + part_rows[p]) of out (and reads those of bias and
 * residual), all parts' groups in one parallel region. Each output is computed as `dk_quant_linear` computes it.
 * Returns 0, or -1 (nothing computed) for a type or width it does not take or more than 4 parts. */
int dk_quant_linear_parts(int64_t parts, const int64_t* kinds, const uint8_t* const* blocks, const int64_t* starts,
                          const int64_t* part_rows, const float* x, int64_t rows, int64_t in, const float* bias,
                          const float* residual, float* out, int64_t ld, int64_t isa) {
    if (parts < 1 || parts > DK_QUANT_MAX_PARTS || rows < 0) return -1;
    int64_t total_rows = 0;
    for (int64_t p = 0; p < parts; ++p) {
        if (dk_quant_row_bytes(kinds[p], in) == 0 || part_rows[p] < 0 || !whole_groups(kinds[p], part_rows[p]))
            return -1;
        total_rows += part_rows[p];
    }
    int parallel = total_rows * in * (rows < 8 ? rows : 8) >= 65536 && total_rows > QUANT_GROUP;
    int fixed = fixed_point_asked(&isa);
#if DK_QUANT_AVX512
    if (isa >= 2) { parts_avx512(parts, kinds, blocks, starts, part_rows, x, rows, in, bias, residual, out, ld, parallel, fixed); return 0; }
#endif
#if DK_QUANT_AVX2
    if (isa >= 1) { parts_avx2(parts, kinds, blocks, starts, part_rows, x, rows, in, bias, residual, out, ld, parallel, fixed); return 0; }
#endif
    (void)isa;
    parts_portable(parts, kinds, blocks, starts, part_rows, x, rows, in, bias, residual, out, ld, parallel, fixed);
    return 0;
}

/* `dk_quant_linear_parts` of a gate/up stack (part 0 the gate's `inter` rows, part 1 the up's, into gate_up [rows,
 * 2 inter]) and dk_silu_mul of its output into gated [rows, inter], in one parallel region (`DK_QUANT_GATED`): the
 * same values as the two calls. Returns 0, or -1 (nothing computed) for a type or width it does not take. */
int dk_quant_gated(const int64_t* kinds, const uint8_t* const* blocks, int64_t inter, const float* x, int64_t rows,
                   int64_t in, float* gate_up, float* gated, int64_t isa) {
    if (rows < 0 || inter < 1 || dk_quant_row_bytes(kinds[0], in) == 0 || dk_quant_row_bytes(kinds[1], in) == 0
        || !whole_groups(kinds[0], inter) || !whole_groups(kinds[1], inter))
        return -1;
    int parallel = 2 * inter * in * (rows < 8 ? rows : 8) >= 65536 && 2 * inter > QUANT_GROUP;
    int fixed = fixed_point_asked(&isa);
#if DK_QUANT_AVX512
    if (isa >= 2) { gated_avx512(kinds, blocks, inter, x, rows, in, gate_up, gated, parallel, fixed); return 0; }
#endif
#if DK_QUANT_AVX2
    if (isa >= 1) { gated_avx2(kinds, blocks, inter, x, rows, in, gate_up, gated, parallel, fixed); return 0; }
#endif
    (void)isa;
    gated_portable(kinds, blocks, inter, x, rows, in, gate_up, gated, parallel, fixed);
    return 0;
}

/* Rows of W dequantized to float32 on path `isa`, out [out_rows, in] (the panels the GEMM of many rows reads),
 * split over torch's threads from 64K weights. Returns 0, or -1 for a type or width it does not take. */
int dk_quant_dequantize(int64_t kind, const uint8_t* w, int64_t out_rows, int64_t in, float* out, int64_t isa) {
    int64_t row_bytes = dk_quant_row_bytes(kind, in);
    if (row_bytes == 0 || out_rows < 0 || !whole_groups(kind, out_rows)) return -1;
    int64_t chunks = in / CHUNK;
    int parallel = out_rows * in >= 65536;
    (void)parallel;
    if (kind == DK_Q4_1X8) {
        (void)isa;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) if (parallel)
#endif
        for (int64_t g0 = 0; g0 < out_rows; g0 += X8_ROWS) x8_dequantize(w, row_bytes, g0, X8_ROWS, in, out + g0 * in);
        return 0;
    }
#ifdef _OPENMP
#pragma omp parallel for schedule(static) if (parallel)
#endif
    for (int64_t o = 0; o < out_rows; ++o) {
        const uint8_t* row = w + o * row_bytes;
        float* dst = out + o * in;
        uint8_t stored[is_grouped(kind) ? row_bytes : 1];  /* a grouped row back in the file's layout */
        if (is_grouped(kind)) {
            ungroup_row(kind, row, stored, chunks);
            row = stored;
        }
        int64_t as = is_grouped(kind) ? grouped_base(kind) : kind;
#if DK_QUANT_AVX512
        if (isa >= 2) {
            dequantize_row_avx512((int)as, row, row_bytes, chunks, dst);
            continue;
        }
#endif
#if DK_QUANT_AVX2
        if (isa >= 1) {
            dequantize_row_avx2((int)as, row, row_bytes, chunks, dst);
            continue;
        }
#endif
        dequantize_row_portable((int)as, row, row_bytes, chunks, dst);
    }
    return 0;
}
