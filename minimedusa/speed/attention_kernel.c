/* A decoding step's attention in C: what model.exact_attention computes, for the compiled step
   (attention_kernel.py builds this file and calls it; model.exact_attention is the reference).

   Why C: a step attends its few rows (1 for a plain step, n + 1 for a tree) to every cached key,
   in each of the model's blocks. In PyTorch that is a dozen operators around two float64
   matrix products, ~150 us a block on a 2-core CPU; here it is a few passes over the keys.

   Keys side by side: a vector holds LANES keys' values, one key a lane, so a row's scores come
   LANES at a time, every lane busy whatever the number of rows. For that each key/value head's
   keys are turned over first, once a call (turn_keys: LANES keys' d-th values one vector), and
   the step's rows that read the head (grouped-query attention: H / G query heads, times T
   tokens) go BUNDLE at a time, sharing each read of the turned keys and of the values. The
   previous version put the rows side by side instead, one row a lane: a plain step's 3 rows of
   a group filled 3 of 16 lanes. Measured on the 2-core Zen 5 (AVX-512), 9 query heads, 3
   key/value heads, head dim 64, a block, both versions in one process: after 256 cached tokens
   1 / 2 / 4 / 8 rows took 7.1 / 8.8 / 12.8 / 19.9 us against 15.8 / 16.2 / 16.8 / 25.2; after
   1,536, 1 and 8 rows 40.9 and 103 us against 93.4 and 146. Built for AVX2 (-march=haswell, the
   same CPU): 12.4 / 15.0 / 21.9 / 33.6 against 14.7 / 15.2 / 23.0 / 37.4. The same bits.

   Why the same bits wherever the keys sit (what keeps greedy Medusa lossless): every number a
   row's output depends on is computed by a fixed sequence of float32 operations over that row's
   visible keys, taken in slot order, and masked keys add nothing:
   - a score q . k is a sum over the head dim in the order d = 0, 1, ..., D - 1, one madd
     (multiply-add) a term, the same for every (row, key) pair, whatever lane the key sits in;
   - exp is a polynomial of plain multiplies and adds (exp_lanes), the same bits in every lane;
   - the softmax denominator and the weighted sum of values run over the keys one after another
     in slot order, so a tree node, which sees its ancestors in later slots than a plain step
     does, adds the same terms in the same order as the plain step for the same token.
   Nothing of one row mixes with another's, so a row's bits depend neither on the rows beside
   it, nor on where its keys sit. Built with -ffp-contract=off: the compiler may not fuse a
   multiply and an add in one place and not in another; madd fuses them everywhere or nowhere.

   Shapes: B sequences (a batch's, each its own keys), H query heads, G key/value heads (H / G
   query heads read each), T rows (query tokens) a sequence, S attended slots (S16: rounded up to LANES), D head dim (at most MAX_D; Dp: rounded up). */
#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The cache's keys and values are read once a call, in order, mostly from memory after ~1,000
   tokens (the model's 30 layers' hold ~35 MB at 1,536): asked for AHEAD bytes before they are
   read, as group_kernel.c's weights (kernels_common.h) */
#include "kernels_common.h"

/* LANES floats a vector, one register: 16 with AVX-512, 8 elsewhere (AVX2) */
#if defined(__AVX512F__)
#define LANES 16
#else
#define LANES 8
#endif
typedef float fv __attribute__((vector_size(4 * LANES)));  /* LANES keys' (or dims') floats */
typedef int32_t iv __attribute__((vector_size(4 * LANES)));
typedef uint32_t uv __attribute__((vector_size(4 * LANES)));
typedef uint16_t hv __attribute__((vector_size(2 * LANES)));

/* a * b + c, one rounding where the CPU fuses them (FMA), else two: either way the same for
   every lane and every call, which is all the bits of a row need */
static inline fv madd(fv a, fv b, fv c) {
#if defined(__AVX512F__)
  return (fv)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
  return (fv)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}

/* LANES copies of x */
static inline fv lanes_of(float x) { return x - (fv){0}; }

enum {
  MAX_D = 256,
  BUNDLE = 4,  /* query rows a pass over the keys takes at once: they share each key's read */
  KEYS = LANES / 4,  /* chunks of LANES keys a score pass takes at once, and */
  DIMS = LANES / 4,  /* vectors of LANES head dims a values pass takes, for each row: BUNDLE x
                        KEYS (or DIMS) sums in flight hide the madds' latency, in half the
                        vector registers */
};
_Static_assert(BUNDLE == 4, "unit_numerators and weigh_values instantiate 1 to 4 rows");

typedef struct {
  const void *q, *k, *v;
  const uint8_t* mask;  /* (T, S), 1 = may attend */
  void* out;
  int64_t H, G, T, S, D;
  int64_t q_head, q_row;  /* q's strides (elements) between heads and between rows */
  int64_t kv_head;  /* k's and v's stride between heads; keys are rows of D */
  int64_t out_head, out_row;
  int bf16;
  float scale;  /* 1 / sqrt(D) */
  /* B sequences (a batch's rows), each T rows against its own keys and values: q's, k's and
     v's, the mask's and out's strides (elements) between one sequence's and the next's */
  int64_t B, q_seq, kv_seq, mask_seq, out_seq;
} Step;

/* p[i], bfloat16 (bf16 != 0) or float32, as a float */
static inline float value_at(const void* p, int64_t i, int bf16) {
  if (!bf16) return ((const float*)p)[i];
  uint32_t w = (uint32_t)((const uint16_t*)p)[i] << 16;  /* a bfloat16 is a float's top half */
  float f;
  memcpy(&f, &w, sizeof f);
  return f;
}

/* f into p[i], rounded to bfloat16 (to nearest, ties to even, as torch rounds) or as float32 */
static inline void store_value(void* p, int64_t i, float f, int bf16) {
  if (!bf16) {
    ((float*)p)[i] = f;
    return;
  }
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  ((uint16_t*)p)[i] = (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

/* exp(x) for x <= 0 (a softmax's x - max), LANES at a time: x = k ln2 + r with |r| <= ln2 / 2,
   exp(r) by its Taylor polynomial (within 2 float32 ulps), times 2^k built from k's bits;
   x = -inf gives 0 exactly (a masked key). */
static inline fv exp_lanes(fv x) {
  iv masked = x < -87.0f;  /* exp(-87) is near float32's smallest normal number */
  fv xc = x;
  for (int l = 0; l < LANES; l++) xc[l] = masked[l] ? -87.0f : x[l];
  fv k = (xc * 1.44269504f + 12582912.0f) - 12582912.0f;  /* round(x / ln2): 1.5 * 2^23 */
  fv r = (xc - k * 0.693359375f) - k * -2.12194440e-4f;  /* ln2 in two parts: k * hi exact */
  fv p = 1.0f + r * (1.0f + r * (0.5f + r * (1.66666672e-1f + r * (4.16666716e-2f +
          r * (8.33333377e-3f + r * 1.38888892e-3f)))));
  iv bits = (__builtin_convertvector(k, iv) + 127) << 23;  /* 2^k as a float's bits */
  fv two_k;
  memcpy(&two_k, &bits, sizeof two_k);
  iv e;
  fv result = p * two_k;
  memcpy(&e, &result, sizeof e);
  e &= ~masked;  /* underflow and masked keys: exactly 0 */
  memcpy(&result, &e, sizeof result);
  return result;
}

/* LANES values of p from p[i] on, bfloat16 (bf16 != 0) or float32, as floats */
static inline fv load_lanes(const void* p, int64_t i, int bf16) {
  fv x;
  if (!bf16) {
    memcpy(&x, (const float*)p + i, sizeof x);
    return x;
  }
  hv h;
  memcpy(&h, (const uint16_t*)p + i, sizeof h);
  const uv w = __builtin_convertvector(h, uv) << 16;  /* a bfloat16 is a float's top half */
  memcpy(&x, &w, sizeof x);
  return x;
}

/* A tile of LANES vectors turned over in registers: the stage for bit h of the vector and lane
   indices swaps elements (i, l + h) and (i + h, l) wherever bit h of i and of l is clear; after
   a stage for every bit, element (i, l) sits at (l, i). LO and HI: the new vectors' lanes, as
   indices into the pair (r[i], r[i + h]) side by side. */
#define LO(l, h) (((l) & (h)) ? LANES + (l) - (h) : (l))
#define HI(l, h) (((l) & (h)) ? LANES + (l) : (l) + (h))
#if LANES == 16
#define LANE_LIST(F, h) F(0, h), F(1, h), F(2, h), F(3, h), F(4, h), F(5, h), F(6, h), F(7, h), \
    F(8, h), F(9, h), F(10, h), F(11, h), F(12, h), F(13, h), F(14, h), F(15, h)
#else
#define LANE_LIST(F, h) F(0, h), F(1, h), F(2, h), F(3, h), F(4, h), F(5, h), F(6, h), F(7, h)
#endif
#define TURN_STAGE(r, h)                                                           \
  for (int i = 0; i < LANES; i++)                                                  \
    if (!(i & (h))) {                                                              \
      const fv lo = __builtin_shufflevector(r[i], r[i + (h)], LANE_LIST(LO, h));   \
      r[i + (h)] = __builtin_shufflevector(r[i], r[i + (h)], LANE_LIST(HI, h));    \
      r[i] = lo;                                                                   \
    }

static inline void turn_over(fv r[LANES]) {
#if LANES == 16
  TURN_STAGE(r, 8)
#endif
  TURN_STAGE(r, 4)
  TURN_STAGE(r, 2)
  TURN_STAGE(r, 1)
}

/* Key/value head g's keys turned over into kt, chunk by chunk of LANES keys: chunk c's D
   vectors, the d-th holding value d of keys c * LANES .. + LANES (0 for the padding keys past
   S), kt[(c * D + d) * LANES + l] = k[c * LANES + l][d]: a chunk's vectors together (as D rows
   of S16 keys, a tile's stores fell 6 KB apart at 1,536 keys, and a key took 3x as long).
   Whole tiles in registers, the edges (D or S not a multiple of LANES) a value at a time. bf16
   is a constant where this is inlined. */
static inline __attribute__((always_inline)) void turn_keys_of(const Step* a, int64_t g,
                                                               int64_t S16, float* kt,
                                                               const int bf16) {
  const int64_t D = a->D, size = bf16 ? 2 : 4;
  const char* k = (const char*)a->k + g * a->kv_head * size;  /* the head's keys */
  for (int64_t j = 0; j < S16; j += LANES) {
    fetch_ahead(k + j * D * size, LANES * D * size);  /* this chunk's keys, AHEAD on */
    for (int64_t d = 0; d < D; d += LANES) {
      if (j + LANES <= a->S && d + LANES <= D) {
        fv r[LANES];  /* r[i]: key j + i's values d .. d + LANES */
        const char* from = k + (j * D + d) * size;  /* key j's values d .., then key j + 1's */
        for (int i = 0; i < LANES; i++, from += D * size) r[i] = load_lanes(from, 0, bf16);
        turn_over(r);  /* r[i]: value d + i of keys j .. j + LANES */
        for (int i = 0; i < LANES; i++) memcpy(kt + j * D + (d + i) * LANES, &r[i], sizeof r[i]);
        continue;
      }
      for (int64_t e = d; e < D && e < d + LANES; e++)
        for (int64_t i = j; i < j + LANES; i++)
          kt[j * D + e * LANES + i - j] = i < a->S ? value_at(k, i * D + e, bf16) : 0.0f;
    }
  }
}

/* Key/value head g's values as rows of Dp floats (D rounded up to LANES, the padding 0): the
   cache's own where they are float32 and D == Dp, else copied into scratch: once a head
   (converted as each bundle read them, 8 rows took 1.2-1.5x as long) */
static const float* value_rows(const Step* a, int64_t g, int64_t Dp, float* scratch) {
  const int64_t D = a->D, first = g * a->kv_head;
  if (!a->bf16 && D == Dp) return (const float*)a->v + first;
  const int64_t size = a->bf16 ? 2 : 4;
  for (int64_t j = 0; j < a->S; j++) {
    fetch_ahead((const char*)a->v + (first + j * D) * size, D * size);  /* key j's values */
    for (int64_t d = 0; d < Dp; d += d + LANES <= D ? LANES : 1) {
      if (d + LANES <= D) {
        const fv x = load_lanes(a->v, first + j * D + d, a->bf16);
        memcpy(scratch + j * Dp + d, &x, sizeof x);
      } else {
        scratch[j * Dp + d] = d < D ? value_at(a->v, first + j * D + d, a->bf16) : 0.0f;
      }
    }
  }
  return scratch;
}

/* the larger of a and b, lane by lane */
static inline fv max_lanes(fv a, fv b) {
  iv a_larger = a > b;  /* all bits set where a is larger */
  return (fv)(((iv)a & a_larger) | ((iv)b & ~a_larger));
}

/* A query row being scored: its query values (D floats), its row of the mask and the slots
   before its first masked one (the cache before a tree: no lane's key masked there), its
   scores (one vector a chunk of LANES keys), and their running max */
typedef struct {
  const float* q;
  const uint8_t* mask;
  int64_t open;
  fv* s;
  fv max;
} Row;

/* The scaled scores of n (<= BUNDLE) rows of one head group against the `chunks` chunks of
   LANES keys from chunk c (kt: their head's turned keys), masked keys and padding at -inf. A
   score is q . k summed over d = 0, 1, ..., D - 1, one madd a term, whatever lane its key sits
   in; the rows share each read of the keys. n and chunks are constants where this is inlined
   (BUNDLE or 1 rows; KEYS chunks, or 1 for the last): the same arithmetic every way. */
static inline __attribute__((always_inline)) void score_chunks(
    const Step* a, Row* r, const float* kt, int64_t c, const int n, const int chunks) {
  const int64_t D = a->D;
  fv dot[BUNDLE][KEYS];
  for (int u = 0; u < chunks; u++) {
    const fv k = load_lanes(kt, (c + u) * D * LANES, 0);
    for (int b = 0; b < n; b++) dot[b][u] = lanes_of(r[b].q[0]) * k;
  }
  for (int64_t d = 1; d < D; d++)
    for (int u = 0; u < chunks; u++) {
      const fv k = load_lanes(kt, ((c + u) * D + d) * LANES, 0);
      for (int b = 0; b < n; b++) dot[b][u] = madd(lanes_of(r[b].q[d]), k, dot[b][u]);
    }
  for (int b = 0; b < n; b++)
    for (int u = 0; u < chunks; u++) {
      fv x = dot[b][u] * a->scale;
      const int64_t j = (c + u) * LANES;
      if (j + LANES > r[b].open)  /* the mask, and the padding past S */
        for (int l = 0; l < LANES; l++)
          if (j + l >= a->S || !r[b].mask[j + l]) x[l] = -INFINITY;
      r[b].max = max_lanes(x, r[b].max);
      r[b].s[c + u] = x;
    }
}

/* The softmax numerators exp(score - the row's max) of n (<= BUNDLE) rows, in their s */
static void unit_numerators(const Step* a, Row* r, int n, const float* kt, int64_t S16) {
  const int64_t chunks = S16 / LANES;
  int64_t c = 0;
  for (; c < chunks; c += chunks - c >= KEYS ? KEYS : 1)
    switch ((n - 1) * 2 + (chunks - c >= KEYS)) {
#define SCORE(n, u) case (n - 1) * 2 + (u == KEYS): score_chunks(a, r, kt, c, n, u); break;
      SCORE(1, 1) SCORE(1, KEYS) SCORE(2, 1) SCORE(2, KEYS) SCORE(3, 1) SCORE(3, KEYS)
      SCORE(4, 1) SCORE(4, KEYS)
#undef SCORE
    }
  for (int b = 0; b < n; b++) {
    float m = r[b].max[0];
    for (int l = 1; l < LANES; l++) m = r[b].max[l] > m ? r[b].max[l] : m;
    for (c = 0; c < chunks; c++) r[b].s[c] = exp_lanes(r[b].s[c] - m);
  }
}

/* Output dims d .. d + e_n * LANES of n (<= BUNDLE) query rows of one head group, from their
   softmax numerators p[b] (S floats each): the values v (rows of Dp floats) weighted by them,
   summed over the keys in slot order, then divided by z[b], their sum in slot order (summed
   here where `first`). Each output dim is its own sum, so LANES dims of a row go side by side
   in a vector; the rows share each value's read, and their independent sums keep the vector
   units busy. n and e_n are constants where this is inlined: the sums then live in registers. */
static inline __attribute__((always_inline)) void weigh_slice(
    const Step* a, const float* const* p, const float* v, int64_t Dp, int64_t d,
    const int64_t (*rows)[2], float* z, int first, const int n, const int e_n) {
  fv acc[BUNDLE][DIMS];
  for (int b = 0; b < n; b++)
    for (int e = 0; e < e_n; e++) acc[b][e] = (fv){0};
  for (int64_t j = 0; j < a->S; j++) {
    fv value[DIMS];
    for (int e = 0; e < e_n; e++) value[e] = load_lanes(v, j * Dp + d + e * LANES, 0);
    for (int b = 0; b < n; b++) {
      if (first) z[b] = z[b] + p[b][j];
      for (int e = 0; e < e_n; e++) acc[b][e] = madd(lanes_of(p[b][j]), value[e], acc[b][e]);
    }
  }
  for (int b = 0; b < n; b++)
    for (int e = 0; e < e_n; e++)
      for (int l = 0; l < LANES && d + e * LANES + l < a->D; l++)
        store_value(a->out, rows[b][0] * a->out_head + rows[b][1] * a->out_row + d +
                    e * LANES + l, acc[b][e][l] / z[b], a->bf16);
}

/* Every output dim of n query rows: DIMS vectors of dims a pass over the values, then one */
static void weigh_values(const Step* a, const float* const* p, const float* v, int64_t Dp,
                         const int64_t (*rows)[2], int n) {
  float z[BUNDLE] = {0};
  for (int64_t d = 0; d < Dp;) {
    const int e_n = Dp - d >= DIMS * LANES ? DIMS : 1;
    switch ((n - 1) * 2 + (e_n == DIMS)) {
#define SLICE(n, e_n) \
  case (n - 1) * 2 + (e_n == DIMS): weigh_slice(a, p, v, Dp, d, rows, z, d == 0, n, e_n); break;
      SLICE(1, 1) SLICE(1, DIMS) SLICE(2, 1) SLICE(2, DIMS) SLICE(3, 1) SLICE(3, DIMS)
      SLICE(4, 1) SLICE(4, DIMS)
#undef SLICE
    }
    d += e_n * LANES;
  }
}

/* The query rows of unit u (BUNDLE rows or fewer of one head group, in (query head, token)
   order) from their group's turned keys and value rows; s: BUNDLE x S16 floats of scratch */
static void attend_unit(const Step* a, int64_t u, int64_t units, const float* kt, const float* v,
                        int64_t S16, int64_t Dp, float* s) {
  const int64_t per_group = a->H / a->G * a->T, g = u / units, first = u % units * BUNDLE;
  const int n = per_group - first < BUNDLE ? (int)(per_group - first) : BUNDLE;
  int64_t rows[BUNDLE][2];
  float q[BUNDLE][MAX_D];
  Row r[BUNDLE];
  const float* p[BUNDLE];
  for (int b = 0; b < n; b++) {
    rows[b][0] = g * (a->H / a->G) + (first + b) / a->T;  /* query head */
    rows[b][1] = (first + b) % a->T;  /* token */
    for (int64_t d = 0; d < a->D; d++)
      q[b][d] = value_at(a->q, rows[b][0] * a->q_head + rows[b][1] * a->q_row + d, a->bf16);
    const uint8_t* mask = a->mask + rows[b][1] * a->S;
    const uint8_t* shut = memchr(mask, 0, a->S);
    r[b] = (Row){q[b], mask, shut != NULL ? shut - mask : a->S, (fv*)(s + b * S16),
                 lanes_of(-INFINITY)};
    p[b] = s + b * S16;
  }
  unit_numerators(a, r, n, kt, S16);
  weigh_values(a, p, v, Dp, (const int64_t (*)[2])rows, n);
}

/* p advanced by n elements of bfloat16 (bf16 != 0) or float32 */
static const void* ahead(const void* p, int64_t n, int bf16) {
  return (const char*)p + n * (bf16 ? 2 : 4);
}

/* Sequence b's step: a's pointers moved to its rows, keys and values, mask and output */
static Step sequence_of(const Step* a, int64_t b) {
  Step one = *a;
  one.q = ahead(a->q, b * a->q_seq, a->bf16);
  one.k = ahead(a->k, b * a->kv_seq, a->bf16);
  one.v = ahead(a->v, b * a->kv_seq, a->bf16);
  one.mask = a->mask + b * a->mask_seq;
  one.out = (void*)ahead(a->out, b * a->out_seq, a->bf16);
  return one;
}

/* Every query row of every sequence, BUNDLE at a time, on OpenMP's threads, in one parallel
   region (a batch's sequences each in a region of its own: ~0.4 ms more a step for each of 8
   rows, on the 2-core Zen 5): each thread takes a run of units (rows of the same sequence and
   key/value head come together) and turns over the keys of each head it meets, in its own
   scratch. Turned once by one thread and read by the other, the keys crossed between the
   cores' caches at every call: 2 threads took 2.7x as long as one (256 cached tokens, 1 row).
   Returns 0, 1 (a head dim over MAX_D or heads that do not group), or 2 (out of memory). */
int attend(const Step* a) {
  if (a->D > MAX_D || a->H % a->G != 0 || a->B < 1) return 1;
  const int64_t S16 = (a->S + LANES - 1) / LANES * LANES, Dp = (a->D + LANES - 1) / LANES * LANES;
  const int64_t units = (a->H / a->G * a->T + BUNDLE - 1) / BUNDLE;  /* a group's */
  int failed = 0;
#pragma omp parallel if (a->B * a->G * units > 1)
  {
    const size_t copy = a->bf16 || a->D != Dp ? (size_t)a->S * Dp : 0;  /* value_rows' */
    float* head = aligned_alloc(64, (sizeof(float) * ((size_t)a->D * S16 + copy) + 63) / 64 * 64);
    float* s = aligned_alloc(64, sizeof(float) * BUNDLE * S16);  /* the unit's rows' scores */
    if (head == NULL || s == NULL) {
#pragma omp atomic write
      failed = 1;
    }
    int64_t held = -1;  /* the sequence's key/value head whose keys `head` holds turned over */
    const float* v = NULL;  /* its value rows */
    Step one = sequence_of(a, 0);  /* the sequence of the unit at hand */
#pragma omp for schedule(static)
    for (int64_t u = 0; u < a->B * a->G * units; u++) {
      if (head == NULL || s == NULL) continue;
      const int64_t within = u % (a->G * units), g = within / units;  /* in its sequence */
      if (u / units != held) {
        held = u / units;
        one = sequence_of(a, u / (a->G * units));
        a->bf16 ? turn_keys_of(&one, g, S16, head, 1) : turn_keys_of(&one, g, S16, head, 0);
        v = value_rows(&one, g, Dp, head + a->D * S16);
      }
      attend_unit(&one, within, units, head, v, S16, Dp, s);
    }
    free(head);
    free(s);
  }
  return failed ? 2 : 0;
}
