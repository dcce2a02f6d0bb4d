/* The fused decoder's whole stack of Llama-block layers for a step of a few rows, in one native call.
 *
 * At batch 1 a SmolLM2 step ran `FusedDecoder._native_layer` 30 times: per layer ~8 calls into this library (two
 * RMSNorms, the q/k/v product, RoPE + KV write + attention, the o product with the residual, the gate/up product,
 * SiLU-gating, the down product with the residual), each with its Python glue (output allocation, `contiguous()`,
 * `data_ptr()`, checks): ~240 ctypes calls and ~1-1.5 ms of an 8-10 ms bf16 or int8 token. `dk_layer_stack` makes
 * the same calls, in the same order, with the same operands, from one C loop: the kernels and their OpenMP regions
 * are the very ones the Python loop runs (each opens its own parallel region on the calling thread's pool), so the
 * result is bit for bit the per-layer path's. Nothing here does arithmetic of its own.
 *
 * Each layer is described once, when the fused decoder is built (`fused/layer_stack.py` fills `dk_stack_layer` from
 * ctypes Structures: weight pointers and kinds, norms and epsilons, heads, scaling, window), and a step brings only
 * its attention plan (the pointers of `DecodeAttentionPlan`), the layers' KV pools and scratch buffers the caller
 * allocated once. */
#define _POSIX_C_SOURCE 199309L  /* clock_gettime under -std=c11 */
#include <stdint.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* The library's entry points called here (kernels.c, quant.c). */
void dk_rms_norm(const float* x, const float* w, float* out, int64_t rows, int64_t dim, float eps);
int dk_attention_split(const int64_t* key_len, int64_t tokens, int64_t kv_heads, int64_t dim, int64_t tiled,
                       int64_t parallel_min_keys, int64_t threads, int64_t* total, int* split);
int64_t dk_range_start(const int64_t* key_len, int64_t tokens, int64_t kv_heads, int64_t total, int64_t part,
                       int64_t parts);
void dk_silu_mul(const float* gate_up, float* out, int64_t rows, int64_t inter);
int dk_rope_cache_attend(float* qkv, int64_t tokens, int64_t heads, int64_t kv_heads, int64_t dim,
                         const float* cos, const float* signed_sin, void* kpool, void* vpool,
                         const int64_t* slots, const int64_t* tables, const int64_t* table_start,
                         const int64_t* key_len, int64_t block_size, float scale, int64_t parallel_min_keys,
                         int64_t window, float softcap, int64_t kv_bf16, int64_t tiled, float* out);
void dk_linear_bf16(const float* x, int64_t rows, int64_t in, const uint16_t* panels, const float* bias,
                    const float* residual, float* out, int64_t out_dim);
void dk_linear_i8(const float* x, int64_t rows, int64_t in, const int8_t* panels, const float* scale,
                  const float* bias, const float* residual, float* out, int64_t out_dim);
int dk_gemv(const float* x, int64_t rows, const float* w, int64_t in, int64_t out, const float* bias,
            const float* residual, float* y);
int dk_quant_linear_parts(int64_t parts, const int64_t* kinds, const uint8_t* const* blocks, const int64_t* starts,
                          const int64_t* part_rows, const float* x, int64_t rows, int64_t in, const float* bias,
                          const float* residual, float* out, int64_t ld, int64_t isa);
int dk_quant_gated(const int64_t* kinds, const uint8_t* const* blocks, int64_t inter, const float* x, int64_t rows,
                   int64_t in, float* gate_up, float* gated, int64_t isa);
/* draws.c: a run's token choice (dk_draw_rule mirrors its definition there) */
typedef struct {
    float temperature;
    int64_t top_k;
    float top_p;
    float min_p;
} dk_draw_rule;
int64_t dk_draw_token(const float* logits, int64_t vocab, const dk_draw_rule* rule, double u, float* weights,
                      float* probs);

/* A matrix's kind: which product multiplies it (`layer_stack.py` mirrors these). */
enum { DK_STACK_GEMV = 0, DK_STACK_BF16 = 1, DK_STACK_I8 = 2, DK_STACK_QUANT = 3 };

/* Parts of a stacked GGUF matrix at most (q, k and v: three). */
#define DK_STACK_PARTS 4

/* One weight product of a layer: `Matrix` (float32, dk_gemv: `weight` is the row-major [out, in] weight),
 * `Bf16Matrix` and `Int8Matrix` (panels, the int8 ones with a scale per output row), or `GgufMatrix` (parts stacked
 * by output rows, each its own format, multiplied into columns [part_start, part_start + part_rows) of the output). */
typedef struct {
    int64_t kind;
    int64_t in, out;
    const void* weight;
    const float* scale;
    const float* bias;
    int64_t isa;
    int64_t parts;
    int64_t part_kind[DK_STACK_PARTS];
    const uint8_t* part_blocks[DK_STACK_PARTS];
    int64_t part_start[DK_STACK_PARTS];
    int64_t part_rows[DK_STACK_PARTS];
} dk_stack_matrix;

/* One Llama-block layer: RMSNorm, q/k/v (with its bias), RoPE + KV write + attention, o with the residual, RMSNorm,
 * gate/up, SiLU-gating, down with the residual. */
typedef struct {
    const float* input_norm;
    const float* post_norm;
    float input_eps, post_eps;
    float scaling, softcap;  /* softcap 0: none */
    int64_t q_heads, kv_heads, head_dim, intermediate;
    int64_t window;          /* 0: the whole context */
    dk_stack_matrix qkv, o, gate_up, down;
} dk_stack_layer;

/* What one step's attention reads: `DecodeAttentionPlan.pointers` and its block size, and how the pools are read
 * (`NativeKernels.rope_cache_attend`'s arguments). */
typedef struct {
    const float* cos;
    const float* signed_sin;
    const int64_t* slots;
    const int64_t* tables;
    const int64_t* table_start;
    const int64_t* key_len;
    int64_t block_size;
    int64_t parallel_min_keys;
    int64_t kv_mode;
    int64_t tiled;
} dk_stack_attention;

/* Scratch rows of a step (each at least tokens x its width), allocated once by the caller. */
typedef struct {
    float* normed;     /* [T, hidden] */
    float* qkv;        /* [T, (heads + 2 kv_heads) head_dim] */
    float* attended;   /* [T, heads head_dim] */
    float* gate_up;    /* [T, 2 intermediate] */
    float* gated;      /* [T, intermediate] */
    float* mid;        /* [T, hidden]: the hidden state between the attention and the MLP */
} dk_stack_scratch;

/* x @ W^T (+ bias) (+ residual) into out [rows, m->out]: the product the layer's Python object runs for these rows. */
static int stack_product(const dk_stack_matrix* m, const float* x, int64_t rows, const float* residual, float* out) {
    switch (m->kind) {
        case DK_STACK_GEMV:
            return dk_gemv(x, rows, (const float*)m->weight, m->in, m->out, m->bias, residual, out);
        case DK_STACK_BF16:
            dk_linear_bf16(x, rows, m->in, (const uint16_t*)m->weight, m->bias, residual, out, m->out);
            return 0;
        case DK_STACK_I8:
            dk_linear_i8(x, rows, m->in, (const int8_t*)m->weight, m->scale, m->bias, residual, out, m->out);
            return 0;
        case DK_STACK_QUANT:  /* every part in one parallel region */
            return dk_quant_linear_parts(m->parts, m->part_kind, m->part_blocks, m->part_start, m->part_rows, x, rows,
                                         m->in, m->bias, residual, out, m->out, m->isa) != 0 ? -1 : 0;
        default:
            return -1;
    }
}

/* Wall seconds the stack's parts took since timing was last switched on: what `benchmarks/batch1_overhead.py`
 * splits a token into. The weight products (and, on GGUF layers, the gating they run), then what lies outside
 * them: RoPE + KV write + attention, the RMSNorms (the run's final one too), a separate SiLU-gating pass, and a
 * decode run's embedding row and argmax; the rest of a token is the step's Python. Off by default; a process-wide
 * tally, for one stack run at a time; two clock reads a part while on. */
enum { DK_TIME_PRODUCTS = 0, DK_TIME_ATTENTION = 1, DK_TIME_NORMS = 2, DK_TIME_GATING = 3, DK_TIME_RUN = 4,
       DK_TIME_PARTS = 5 };
static int stack_timing = 0;
static double stack_seconds[DK_TIME_PARTS];

void dk_stack_timing(int64_t on) {
    stack_timing = on != 0;
    for (int i = 0; i < DK_TIME_PARTS; ++i) stack_seconds[i] = 0.0;
}

double dk_stack_product_seconds(void) { return stack_timing ? stack_seconds[DK_TIME_PRODUCTS] : -1.0; }

/* The seconds of part `part` (DK_TIME_*), or -1 while timing is off or for an unknown part. */
double dk_stack_seconds(int64_t part) {
    return stack_timing && part >= 0 && part < DK_TIME_PARTS ? stack_seconds[part] : -1.0;
}

static double now_seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* A clock read where timing is on (0 where it is off), and the seconds since `start` added to `part`. */
static double time_start(void) { return stack_timing ? now_seconds() : 0.0; }
static void time_add(int part, double start) {
    if (stack_timing) stack_seconds[part] += now_seconds() - start;
}

/* stack_product, timed while timing is on. */
static int timed_product(const dk_stack_matrix* m, const float* x, int64_t rows, const float* residual, float* out) {
    double start = time_start();
    int status = stack_product(m, x, rows, residual, out);
    time_add(DK_TIME_PRODUCTS, start);
    return status;
}

/* ---- a step's keys and values, prefetched while its layers' q/k/v products run ---------------------------------
 * A decode step reads each layer's cached keys and values once, cold: the weights streamed since the previous step
 * (~100 MB for the bundled GGUF) have pushed them out of every cache. Read then, by the attention, they cost about
 * as much again as the attention's arithmetic. The q/k/v product just before it streams weights from memory on every
 * thread too; each of its threads, as it goes, prefetches into L2 the share of those keys and values that the same
 * thread will read in the attention (its kv heads' or its tokens' slices of every key), so the attention finds them
 * in its own core's cache. A hint only: nothing computed depends on it, and a prefetch of any address is harmless
 * (it never faults). One stack at a time plans them (`side_busy`); a stack run meanwhile on another thread of the
 * process prefetches nothing of its own, and the spans live in a static array, so a product that reads them while
 * another step replans reads valid memory. */
#define DK_SIDE_MAX_PARTS 64
/* Bytes of keys (and as many of values) a thread prefetches at most for one layer, the first it will read: its
 * share must stay in its L2 beside the weights streaming through. Long contexts take their first keys from L2 and
 * the rest as before (a lone token at 1,200-1,800 keys: a GGUF token 1.08-1.09x against none past this limit). */
#define DK_SIDE_MAX_BYTES (512 * 1024)
/* Key slices a step's plan holds at most (the threads' together). */
#define DK_SIDE_MAX_SPANS 16384
typedef struct {
    int64_t at, bytes;  /* a key's row slice: its offset in bytes from the pool's start, its length */
} side_span;
static struct {
    int on;
    const char* kpool;
    const char* vpool;
    int64_t first[DK_SIDE_MAX_PARTS + 1];  /* thread p's slices: spans[first[p] .. first[p + 1]) */
    int64_t parts;
    side_span spans[DK_SIDE_MAX_SPANS];    /* every thread's slices, thread by thread */
} side;
static int side_busy;  /* a stack holds `side` */

/* Called by a product's thread `part` of `parts` before the `i`-th of the `count` units of work it has: prefetches
 * the share of its slices of the keys and values that falls to that unit. */
void dk_side_prefetch_share(int64_t part, int64_t parts, int64_t i, int64_t count) {
    if (!__atomic_load_n(&side.on, __ATOMIC_RELAXED) || parts != side.parts || part < 0 || part >= parts || i < 0
        || i >= count)
        return;
    int64_t begin = side.first[part], n = side.first[part + 1] - begin;
    for (int64_t j = begin + i * n / count, end = begin + (i + 1) * n / count; j < end; ++j) {
        const char* k = side.kpool + side.spans[j].at;
        const char* v = side.vpool + side.spans[j].at;
        for (int64_t b = 0; b < side.spans[j].bytes; b += 64) {
            __builtin_prefetch(k + b, 0, 2);  /* into L2 (prefetcht1 on x86) */
            __builtin_prefetch(v + b, 0, 2);
        }
    }
}

/* dk_side_prefetch_share for the unit `unit` of `units` split over the threads by an OpenMP static schedule (libgomp's:
 * the first units % parts threads take one more). */
void dk_side_prefetch(int64_t part, int64_t parts, int64_t unit, int64_t units) {
    if (!__atomic_load_n(&side.on, __ATOMIC_RELAXED) || parts <= 0) return;
    int64_t q = units / parts, r = units % parts;
    int64_t begin = part < r ? part * (q + 1) : part * q + r;
    dk_side_prefetch_share(part, parts, unit - begin, q + (part < r));
}

/* Plans `side` for a step: each thread's slices of the keys its attention will read, split as dk_rope_cache_attend
 * splits its items (whole tokens on the tiled path when there are at least as many tokens as threads, else (token,
 * kv head) items; all on thread 0 below `parallel_min_keys`), each key once per thread, the first DK_SIDE_MAX_BYTES
 * of each thread's. Returns whether there is something to prefetch within DK_SIDE_MAX_SPANS slices in all. */
static int side_plan(const dk_stack_attention* at, int64_t tokens, int64_t kv_heads, int64_t dim) {
    int64_t threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    if (threads > DK_SIDE_MAX_PARTS || at->block_size <= 0) return 0;
    int64_t elem = at->kv_mode ? 2 : 4, width = kv_heads * dim * elem, total;
    int parallel;
    int per_head = dk_attention_split(at->key_len, tokens, kv_heads, dim, at->tiled, at->parallel_min_keys, threads,
                                      &total, &parallel);
    int64_t per_unit = per_head ? kv_heads : 1, units = tokens * per_unit;
    if (total == 0) return 0;
    side_span* spans = side.spans;
    int64_t count = 0;
    for (int64_t p = 0; p < threads; ++p) {
        int64_t u0 = parallel ? dk_range_start(at->key_len, tokens, per_unit, total, p, threads) : (p == 0 ? 0 : units);
        int64_t u1 = parallel ? dk_range_start(at->key_len, tokens, per_unit, total, p + 1, threads) : units;
        side.first[p] = count;
        int64_t bytes = 0, last_g = -1, last_table = -1, last_len = 0;
        for (int64_t u = u0; u < u1; ++u) {
            int64_t t = u / per_unit, g0 = per_head ? u % kv_heads : 0, heads = per_head ? 1 : kv_heads;
            /* a sequence's later tokens (speculative verification, a prompt's last rows) see its earlier tokens'
             * keys and a few more: only those more */
            int64_t from = at->table_start[t] == last_table && g0 == last_g ? last_len : 0;
            const int64_t* table = at->tables + at->table_start[t];
            if (count + at->key_len[t] - from > DK_SIDE_MAX_SPANS) return 0;
            /* the first DK_SIDE_MAX_BYTES of its keys in the order it reads them: its L2 holds no more beside the
             * weights streaming through, and the attention's own tile prefetch takes the rest */
            for (int64_t j = from; j < at->key_len[t] && bytes + heads * dim * elem <= DK_SIDE_MAX_BYTES; ++j) {
                int64_t slot = table[j / at->block_size] * at->block_size + j % at->block_size;
                spans[count].at = slot * width + g0 * dim * elem;
                spans[count].bytes = heads * dim * elem;
                bytes += spans[count].bytes;
                ++count;
            }
            last_table = at->table_start[t];
            last_g = g0;
            last_len = at->key_len[t] > last_len || from == 0 ? at->key_len[t] : last_len;
        }
    }
    side.first[threads] = count;
    side.parts = threads;
    return 1;
}

/* dk_rms_norm, timed while timing is on. */
static void timed_norm(const float* x, const float* w, float* out, int64_t rows, int64_t dim, float eps) {
    double start = time_start();
    dk_rms_norm(x, w, out, rows, dim, eps);
    time_add(DK_TIME_NORMS, start);
}

/* Whether the layer's gate/up product gates its own rows (`dk_quant_gated`): GGUF parts, the gate's
 * `intermediate` rows over the up's, no bias. (The int8 and bf16 panels' products, gating the same way, measured
 * no faster: 0.99-1.00x a token, where GGUF weights measured 1.04-1.05x.) */
static int gates_in_product(const dk_stack_layer* l) {
    const dk_stack_matrix* m = &l->gate_up;
    int64_t inter = l->intermediate;
    return m->kind == DK_STACK_QUANT && m->bias == 0 && m->out == 2 * inter && m->parts == 2
           && m->part_start[0] == 0 && m->part_rows[0] == inter && m->part_start[1] == inter
           && m->part_rows[1] == inter;
}

/* dk_quant_gated for the layer (the gating counted with the product by the timers: it runs inside the product's
 * parallel region). */
static int timed_gated(const dk_stack_layer* l, const float* x, int64_t rows, float* gate_up, float* gated) {
    const dk_stack_matrix* m = &l->gate_up;
    double start = time_start();
    int status = dk_quant_gated(m->part_kind, m->part_blocks, l->intermediate, x, rows, m->in, gate_up, gated,
                                m->isa) != 0 ? -1 : 0;
    time_add(DK_TIME_PRODUCTS, start);
    return status;
}

/* dk_layer_stack's layers (`planned`: `side` holds the step's keys to prefetch). */
static int run_layers(const dk_stack_layer* layers, int64_t count, int64_t tokens, int64_t hidden_dim,
                      const float* hidden, float* out, void* const* key_pools, void* const* value_pools,
                      const dk_stack_attention* at, const dk_stack_scratch* scratch, int planned) {
    const float* h = hidden;
    for (int64_t i = 0; i < count; ++i) {
        const dk_stack_layer* l = &layers[i];
        timed_norm(h, l->input_norm, scratch->normed, tokens, hidden_dim, l->input_eps);
        int side_on = planned && l->window == 0 && l->kv_heads == layers[0].kv_heads && l->head_dim == layers[0].head_dim;
        if (side_on) {
            side.kpool = (const char*)key_pools[i];
            side.vpool = (const char*)value_pools[i];
            __atomic_store_n(&side.on, 1, __ATOMIC_RELEASE);
        }
        int product = timed_product(&l->qkv, scratch->normed, tokens, 0, scratch->qkv);
        if (side_on) __atomic_store_n(&side.on, 0, __ATOMIC_RELEASE);
        if (product != 0) return -1;
        double start = time_start();
        if (dk_rope_cache_attend(scratch->qkv, tokens, l->q_heads, l->kv_heads, l->head_dim, at->cos, at->signed_sin,
                                 key_pools[i], value_pools[i], at->slots, at->tables, at->table_start, at->key_len,
                                 at->block_size, l->scaling, at->parallel_min_keys, l->window, l->softcap,
                                 at->kv_mode, at->tiled, scratch->attended) != 0)
            return -2;
        time_add(DK_TIME_ATTENTION, start);
        if (timed_product(&l->o, scratch->attended, tokens, h, scratch->mid) != 0) return -1;
        timed_norm(scratch->mid, l->post_norm, scratch->normed, tokens, hidden_dim, l->post_eps);
        if (gates_in_product(l)) {
            if (timed_gated(l, scratch->normed, tokens, scratch->gate_up, scratch->gated) != 0) return -1;
        } else {
            if (timed_product(&l->gate_up, scratch->normed, tokens, 0, scratch->gate_up) != 0) return -1;
            start = time_start();
            dk_silu_mul(scratch->gate_up, scratch->gated, tokens, l->intermediate);
            time_add(DK_TIME_GATING, start);
        }
        if (timed_product(&l->down, scratch->gated, tokens, scratch->mid, out) != 0) return -1;
        h = out;
    }
    return 0;
}

/* Runs `count` layers over `tokens` rows: `hidden` [T, hidden_dim] is the first layer's input (not written), `out`
 * [T, hidden_dim] receives the last layer's output (and serves as each layer's output along the way); the layers'
 * KV pools are key_pools[i] / value_pools[i]. Returns 0; -1 if a product refused its operands (nothing the fused
 * decoder builds) or -2 if the attention could not allocate its scratch memory. */
int dk_layer_stack(const dk_stack_layer* layers, int64_t count, int64_t tokens, int64_t hidden_dim,
                   const float* hidden, float* out, void* const* key_pools, void* const* value_pools,
                   const dk_stack_attention* at, const dk_stack_scratch* scratch) {
    int mine = count > 0 && !__atomic_exchange_n(&side_busy, 1, __ATOMIC_ACQUIRE);
    int planned = mine && side_plan(at, tokens, layers[0].kv_heads, layers[0].head_dim);
    int status = run_layers(layers, count, tokens, hidden_dim, hidden, out, key_pools, value_pools, at, scratch,
                            planned);
    if (mine) __atomic_store_n(&side_busy, 0, __ATOMIC_RELEASE);
    return status;
}

/* What a decode run needs beyond the layers: the embeddings, the final norm, the LM head, the RoPE tables by
 * position, the sequence's block table and the tokens that end it. Filled by `fused/layer_stack.py`
 * (`DecodeRunModel`). */
typedef struct {
    const void* embed;          /* [vocab, hidden_dim]: float32, or bfloat16 with embed_bf16 */
    int64_t embed_bf16;
    int64_t vocab;
    const float* final_norm;
    float final_eps;
    dk_stack_matrix head;       /* the LM head, [vocab, hidden_dim] */
    const float* cos;           /* [rope_positions, head_dim]: the RoPE tables' row of each position */
    const float* signed_sin;
    int64_t rope_positions;
    int64_t head_dim;
    const int64_t* block_table; /* the sequence's blocks, `blocks` of them */
    int64_t blocks;
    const int64_t* stop_ids;    /* a run ends after producing one of these */
    int64_t stop_count;
    dk_draw_rule draw;          /* temperature 0: each token the argmax; else drawn as the rule says (draws.c) */
    const double* uniforms;     /* with a temperature: step i's draw, in [0, 1) */
    float* probs;               /* with a temperature: [steps, vocab], step i's distribution (may be NULL) */
    const volatile int32_t* interrupt; /* non-zero: end after the token being made (another thread sets it: a
                                        * request arrived or was aborted); may be NULL */
} dk_run_model;

/* Scratch of a run beyond the stack's: two hidden rows and the logits row. */
typedef struct {
    float* input;   /* [hidden_dim] */
    float* output;  /* [hidden_dim] */
    float* normed;  /* [hidden_dim] */
    float* logits;  /* [vocab] */
} dk_run_scratch;

/* A decode run of one sequence: up to `steps` times, the pending `token` at `position` goes through the
 * embeddings, every layer (dk_layer_stack with one row: its keys and values written at the position's slot), the
 * final norm and the LM head, and the argmax becomes the next pending token, written to out_tokens (with a
 * temperature in m->draw, a draw by that rule at m->uniforms[i] instead, its distribution written to m->probs:
 * dk_draw_token). The engine's one-row steps make the same calls with the same operands (the runner's plan for one
 * decode token: slot from the block table, keys 0..position, the position's RoPE row), so the logits are the ones
 * it would compute step by step, and a greedy run's tokens the ones it would pick. Stops early after a stop id.
 * Ends early too once m->interrupt reads non-zero (checked after each token, so a run makes at least one).
 * Returns the tokens produced; -1/-2 as dk_layer_stack (-2 also where a draw's scratch could not be allocated); -3
 * when a position lies past the block table or the RoPE tables (the caller sizes both). */
int64_t dk_decode_run(const dk_stack_layer* layers, int64_t count, int64_t hidden_dim, void* const* key_pools,
                      void* const* value_pools, const dk_stack_attention* settings, const dk_stack_scratch* scratch,
                      const dk_run_model* m, const dk_run_scratch* rows, int64_t token, int64_t position,
                      int64_t steps, int64_t* out_tokens) {
    dk_stack_attention at = *settings;
    /* one token: its kv heads are split over the threads whatever its context (a lone query's attention otherwise
     * runs on one thread below parallel_min_keys while the other waits: 1.02x a token at 100 keys) */
    at.parallel_min_keys = 0;
    int64_t slot = 0, start = 0, keys = 0;
    at.slots = &slot;
    at.tables = m->block_table;
    at.table_start = &start;
    at.key_len = &keys;
    if (at.block_size <= 0) return -3;
    for (int64_t i = 0; i < steps; ++i, ++position) {
        if (position >= m->rope_positions || position / at.block_size >= m->blocks || token < 0 || token >= m->vocab)
            return -3;
        double start = time_start();
        if (m->embed_bf16) {
            const uint16_t* row = (const uint16_t*)m->embed + token * hidden_dim;
            for (int64_t d = 0; d < hidden_dim; ++d) {
                uint32_t bits = (uint32_t)row[d] << 16;
                float value;
                __builtin_memcpy(&value, &bits, sizeof value);
                rows->input[d] = value;
            }
        } else {
            __builtin_memcpy(rows->input, (const float*)m->embed + token * hidden_dim, (size_t)hidden_dim * sizeof(float));
        }
        time_add(DK_TIME_RUN, start);
        slot = m->block_table[position / at.block_size] * at.block_size + position % at.block_size;
        keys = position + 1;
        at.cos = m->cos + position * m->head_dim;
        at.signed_sin = m->signed_sin + position * m->head_dim;
        int status = dk_layer_stack(layers, count, 1, hidden_dim, rows->input, rows->output, key_pools, value_pools,
                                    &at, scratch);
        if (status != 0) return status;
        timed_norm(rows->output, m->final_norm, rows->normed, 1, hidden_dim, m->final_eps);
        if (timed_product(&m->head, rows->normed, 1, 0, rows->logits) != 0) return -1;
        start = time_start();
        float* probs = m->draw.temperature > 0.0f && m->probs != NULL ? m->probs + i * m->vocab : NULL;
        token = dk_draw_token(rows->logits, m->vocab, &m->draw, m->draw.temperature > 0.0f ? m->uniforms[i] : 0.0,
                              probs != NULL ? probs : rows->logits, probs);
        time_add(DK_TIME_RUN, start);
        if (token < 0) return token;
        out_tokens[i] = token;
        for (int64_t s = 0; s < m->stop_count; ++s)
            if (m->stop_ids[s] == token) return i + 1;
        if (m->interrupt != NULL && *m->interrupt != 0) return i + 1;
    }
    return steps;
}
