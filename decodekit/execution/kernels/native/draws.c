/* A decode run's token choice: the argmax, or a draw from the processed distribution of a row of logits.
 *
 * A draw follows what the built-in sampling processors do to a row, in the order a request's `SamplingParams`
 * applies them (plugins/decodekit_plugins/sampling.py): divide by the temperature, keep the top_k largest logits
 * (ties kept), keep the nucleus of the most likely tokens whose mass reaches top_p (transformers' rule: a token stays
 * while the mass of the tokens ranked above it is below top_p), keep the tokens at least min_p times as likely as
 * the most likely; then the token is the inverse of the kept distribution's CDF at a uniform the caller gives. The
 * decisions are the processors' up to float rounding at their edges (a token whose probability sits within ~1e-6 of
 * an edge may fall the other way): the same distribution, drawn by other arithmetic. */
#include <stdint.h>
#include <stdlib.h>
/* The 8-lane helpers are inlined, never called across an ABI boundary: GCC's note on a CPU without AVX is moot. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

/* How a row's token is drawn (`DrawRule` in fused/layer_stack.py mirrors it; dk_run_model in layers.c embeds it).
 * temperature 0: the argmax; top_k 0, top_p 1 and min_p 0 leave the row whole. */
typedef struct {
    float temperature;
    int64_t top_k;
    float top_p;
    float min_p;
} dk_draw_rule;

/* The first index of the largest logit, as torch.argmax takes it (NaN rows aside: a NaN never wins here). The
 * maximum over 8 lanes first (vector compares, no branch per logit: 49K logits took ~30 us a token one by one),
 * then the first logit equal to it. */
typedef float dk_v8f __attribute__((vector_size(32)));
typedef int32_t dk_v8i __attribute__((vector_size(32)));
int64_t dk_first_argmax(const float* logits, int64_t vocab) {
    float top = logits[0];
    int64_t i = 0;
    if (vocab >= 8) {
        dk_v8f best;
        __builtin_memcpy(&best, logits, sizeof best);
        for (i = 8; i + 8 <= vocab; i += 8) {
            dk_v8f x;
            __builtin_memcpy(&x, logits + i, sizeof x);
            dk_v8i more = x > best;
            best = (dk_v8f)(((dk_v8i)x & more) | ((dk_v8i)best & ~more));
        }
        for (int k = 0; k < 8; ++k) top = best[k] > top ? best[k] : top;
    }
    for (; i < vocab; ++i) top = logits[i] > top ? logits[i] : top;
    for (i = 0; i < vocab; ++i)
        if (logits[i] == top) return i;
    return 0;  /* every logit NaN */
}

/* exp(x) for x <= 0 in 8 lanes (Cephes' expf: x = n ln 2 + r, |r| <= ln 2 / 2, a degree-6 polynomial of r, then
 * 2^n in the exponent bits; ~1 ulp), 0 below -87 (no subnormals). A libm call per logit took ~0.5 ms over SmolLM2's
 * 49K logits; this loop ~40 us. exp(0) is exactly 1. */
static inline __attribute__((always_inline)) dk_v8f exp_nonpositive_v8(dk_v8f x) {
    const dk_v8f log2e = {1.44269504088896341f, 1.44269504088896341f, 1.44269504088896341f, 1.44269504088896341f,
                          1.44269504088896341f, 1.44269504088896341f, 1.44269504088896341f, 1.44269504088896341f};
    dk_v8i under = x < -87.0f;
    x = (dk_v8f)((dk_v8i)x & ~under);  /* those lanes computed at 0, then zeroed */
    dk_v8f fx = x * log2e + 0.5f;
    dk_v8i n = __builtin_convertvector(fx, dk_v8i);           /* truncates toward zero */
    n += (dk_v8i)(__builtin_convertvector(n, dk_v8f) > fx);   /* -1 where that was above: the floor */
    dk_v8f nf = __builtin_convertvector(n, dk_v8f);
    dk_v8f r = x - nf * 0.693359375f - nf * -2.12194440e-4f;
    dk_v8f p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    dk_v8i scale = (n + 127) << 23;
    return (dk_v8f)((dk_v8i)(p * (dk_v8f)scale) & ~under);
}

/* A candidate of the nucleus: its weight and token. */
typedef struct {
    float weight;
    int32_t index;
} dk_ranked;

/* Most likely first, ties by the lower token (transformers' stable ascending sort puts the lower index of a tie
 * last, i.e. nearest the top: a tie at the nucleus's edge keeps the lower token). */
static int ranked_before(const void* a, const void* b) {
    const dk_ranked* x = (const dk_ranked*)a;
    const dk_ranked* y = (const dk_ranked*)b;
    if (x->weight != y->weight) return x->weight > y->weight ? -1 : 1;
    return (x->index > y->index) - (x->index < y->index);
}

/* The k-th largest logit (0 < k < vocab): a min-heap of the k largest seen, blocks of 8 below its root skipped
 * with one vector compare (after the first few hundred logits nearly every block is). */
static float kth_largest(const float* logits, int64_t vocab, int64_t k, float* heap) {
    int64_t n = 0, i = 0;
    for (; i < vocab; ++i) {
        if (n == k && i + 8 <= vocab && (i & 7) == 0) {
            dk_v8f x, root = {heap[0], heap[0], heap[0], heap[0], heap[0], heap[0], heap[0], heap[0]};
            __builtin_memcpy(&x, logits + i, sizeof x);
            dk_v8i above = x > root;
            int any = 0;
            for (int lane = 0; lane < 8; ++lane) any |= above[lane];
            if (!any) {
                i += 7;
                continue;
            }
        }
        float x = logits[i];
        if (n < k) {  /* sift up */
            int64_t c = n++;
            while (c > 0 && heap[(c - 1) / 2] > x) {
                heap[c] = heap[(c - 1) / 2];
                c = (c - 1) / 2;
            }
            heap[c] = x;
        } else if (x > heap[0]) {  /* replace the root, sift down */
            int64_t c = 0;
            for (;;) {
                int64_t l = 2 * c + 1, r = l + 1;
                if (l >= k) break;
                int64_t s = r < k && heap[r] < heap[l] ? r : l;
                if (!(heap[s] < x)) break;
                heap[c] = heap[s];
                c = s;
            }
            heap[c] = x;
        }
    }
    return heap[0];
}

/* Buckets of the nucleus search: a positive float's exponent and 3 leading mantissa bits (bits >> 20; weights are at
 * most 1, so keys stay below 0x3f9), then, inside the bucket the edge falls in, the next 11 bits. */
#define NUCLEUS_BUCKETS 2048
#define NUCLEUS_SORT_MAX 512

static inline uint32_t weight_bits(float w) {
    uint32_t bits;
    __builtin_memcpy(&bits, &w, sizeof bits);
    return bits;
}

/* The bucket, walking down from the most likely, where the mass reaches `share`; `above` gains the mass of the
 * buckets before it. */
static int64_t edge_bucket(const double* mass, double share, double* above) {
    int64_t b = NUCLEUS_BUCKETS - 1;
    for (; b > 0; --b) {
        if (*above + mass[b] >= share) break;
        *above += mass[b];
    }
    return b;
}

/* Zeroes the weights outside the nucleus: ranked most likely first (ties: the lower token first), a token stays
 * while the weight of those above it is below top_p times the total. The weights are bucketed by their leading bits
 * (masses in double); every token of a bucket above the one where the mass reaches top_p's share stays, every one
 * below goes, and only that bucket's tokens are sorted (bucketed once more by the next bits where there are many: a
 * nearly flat row's nucleus is most of the vocabulary). A sort of every candidate took ~2 ms on a spread 49K row. */
static void keep_nucleus(float* weights, int64_t vocab, float top_p, dk_ranked* ranked) {
    double mass[NUCLEUS_BUCKETS] = {0};
    int64_t n = 0;  /* tokens with any weight; the first NUCLEUS_SORT_MAX of them listed as they come */
    for (int64_t i = 0; i < vocab; ++i) {
        float w = weights[i];
        if (w > 0.0f) {
            mass[weight_bits(w) >> 20] += w;
            if (n < NUCLEUS_SORT_MAX) {
                ranked[n].weight = w;
                ranked[n].index = (int32_t)i;
            }
            ++n;
        }
    }
    double total = 0.0;
    for (int64_t b = NUCLEUS_BUCKETS - 1; b >= 0; --b) total += mass[b];
    double share = (double)top_p * total, above = 0.0;
    int few = n <= NUCLEUS_SORT_MAX;  /* after a top_k, or a peaked row: every candidate listed, all sorted */
    if (!few) {
        uint32_t bucket = (uint32_t)edge_bucket(mass, share, &above);
        n = 0;
        for (int64_t i = 0; i < vocab; ++i)
            if (weights[i] > 0.0f && weight_bits(weights[i]) >> 20 == bucket) {
                ranked[n].weight = weights[i];
                ranked[n].index = (int32_t)i;
                ++n;
            }
        if (n > NUCLEUS_SORT_MAX) {
            double sub[NUCLEUS_BUCKETS] = {0};
            for (int64_t j = 0; j < n; ++j) sub[(weight_bits(ranked[j].weight) >> 9) & 0x7ff] += ranked[j].weight;
            uint32_t inner = (uint32_t)edge_bucket(sub, share, &above);
            int64_t kept = 0;
            for (int64_t j = 0; j < n; ++j)
                if (((weight_bits(ranked[j].weight) >> 9) & 0x7ff) == inner) ranked[kept++] = ranked[j];
            n = kept;
        }
    }
    if (n == 0) return;
    qsort(ranked, (size_t)n, sizeof *ranked, ranked_before);
    int64_t last = 0;
    for (int64_t j = 0; j < n && above < share; ++j) {
        last = j;
        above += ranked[j].weight;
    }
    if (few) {  /* every token with weight is listed: drop the ones after the edge */
        for (int64_t j = last + 1; j < n; ++j) weights[ranked[j].index] = 0.0f;
        return;
    }
    float edge = ranked[last].weight;
    int64_t edge_index = ranked[last].index;
    for (int64_t i = 0; i < vocab; ++i)
        if (weights[i] < edge || (weights[i] == edge && i > edge_index)) weights[i] = 0.0f;
}

/* Bytes of scratch a draw by `rule` over `vocab` logits needs (0: none). */
static int64_t draw_scratch_bytes(int64_t vocab, const dk_draw_rule* rule) {
    if (rule->temperature <= 0.0f) return 0;
    int64_t bytes = 0;
    if (rule->top_p < 1.0f) bytes += vocab * (int64_t)sizeof(dk_ranked);
    if (rule->top_k > 0 && rule->top_k < vocab) bytes += rule->top_k * (int64_t)sizeof(float);
    return bytes;
}

/* This thread's scratch for draws, grown to `bytes` (NULL where that fails). Kept between calls: a fresh 400 KB
 * buffer a call (SmolLM2's vocabulary of candidates) is a fresh mapping, its pages faulted in each time. */
static void* draw_scratch(int64_t bytes) {
    static _Thread_local void* buffer = NULL;
    static _Thread_local int64_t capacity = 0;
    if (bytes > capacity) {
        void* grown = realloc(buffer, (size_t)bytes);
        if (grown == NULL) return NULL;
        buffer = grown;
        capacity = bytes;
    }
    return buffer;
}

/* The token `rule` draws from a row of logits at u (in [0, 1)): the argmax at temperature 0; else the first token
 * whose running sum of the kept weights exp((logit - max) / temperature) passes u times their total (sums in double,
 * 64 logits a block, so the search reads the blocks' sums first). With `probs`, the distribution it was drawn from,
 * each kept weight over the total, 0 elsewhere. `weights` is scratch of `vocab` floats (it may be `logits` or
 * `probs`). A NaN row draws token 0; -2 where the truncation's scratch could not be allocated. */
#define SAMPLE_BLOCK 64
int64_t dk_draw_token(const float* logits, int64_t vocab, const dk_draw_rule* rule, double u, float* weights,
                      float* probs) {
    if (rule->temperature <= 0.0f) return dk_first_argmax(logits, vocab);
    int64_t bytes = draw_scratch_bytes(vocab, rule);
    void* scratch = bytes > 0 ? draw_scratch(bytes) : NULL;
    if (bytes > 0 && scratch == NULL) return -2;
    float top = logits[dk_first_argmax(logits, vocab)];
    if (top != top) return 0;
    float inverse = 1.0f / rule->temperature;
    dk_ranked* ranked = (dk_ranked*)scratch;
    /* top_k first, from the logits (`weights` may be `logits`' memory): the temperature keeps their order, so the
     * k-th largest logit is the k-th largest of logits / temperature, and every logit below it gets no weight */
    float kth = -__builtin_inff();
    if (rule->top_k > 0 && rule->top_k < vocab)
        kth = kth_largest(logits, vocab, rule->top_k,
                          (float*)((char*)scratch + (rule->top_p < 1.0f ? vocab * (int64_t)sizeof(dk_ranked) : 0)));
    const dk_v8f kth8 = {kth, kth, kth, kth, kth, kth, kth, kth};
    int64_t i = 0, token = -1;
    for (; i + 8 <= vocab; i += 8) {
        dk_v8f x;
        __builtin_memcpy(&x, logits + i, sizeof x);
        dk_v8f e = (dk_v8f)((dk_v8i)exp_nonpositive_v8((x - top) * inverse) & (dk_v8i)(x >= kth8));
        __builtin_memcpy(weights + i, &e, sizeof e);
    }
    for (; i < vocab; ++i) {  /* the tail through the same lanes */
        dk_v8f x = {0};
        float logit = logits[i];
        x[0] = (logit - top) * inverse;
        weights[i] = logit >= kth ? exp_nonpositive_v8(x)[0] : 0.0f;
    }
    if (rule->top_p < 1.0f) keep_nucleus(weights, vocab, rule->top_p, ranked);
    if (rule->min_p > 0.0f)  /* the top's weight is exactly 1: a weight is the ratio to the most likely's */
        for (i = 0; i < vocab; ++i)
            if (weights[i] < rule->min_p) weights[i] = 0.0f;
    double total = 0.0;
    for (i = 0; i < vocab; i += SAMPLE_BLOCK) {
        int64_t end = i + SAMPLE_BLOCK < vocab ? i + SAMPLE_BLOCK : vocab;
        float block = 0.0f;
        for (int64_t j = i; j < end; ++j) block += weights[j];
        total += block;
    }
    double target = u * total, seen = 0.0;
    for (i = 0; i < vocab; i += SAMPLE_BLOCK) {
        int64_t end = i + SAMPLE_BLOCK < vocab ? i + SAMPLE_BLOCK : vocab;
        float block = 0.0f;
        for (int64_t j = i; j < end; ++j) block += weights[j];
        if (seen + block <= target) {
            seen += block;
            continue;
        }
        for (int64_t j = i; j < end; ++j) {
            seen += weights[j];
            if (seen > target && weights[j] > 0.0f) {
                token = j;
                break;
            }
        }
        if (token >= 0) break;
    }
    if (token < 0)  /* u * total at the very end (rounding): the last token with any weight (the top has 1) */
        for (token = vocab - 1; token > 0 && weights[token] == 0.0f; --token) {}
    if (probs != NULL) {
        float scale = (float)(1.0 / total);
        for (i = 0; i < vocab; ++i) probs[i] = weights[i] * scale;
    }
    return token;
}

/* One row's draw alone (what a decode run does at each step): the token, and its distribution in `probs` (vocab
 * floats; untouched at temperature 0). Returns -2 where the scratch could not be allocated. */
int64_t dk_draw_row(const float* logits, int64_t vocab, const dk_draw_rule* rule, double u, float* probs) {
    return dk_draw_token(logits, vocab, rule, u, probs, probs);
}
