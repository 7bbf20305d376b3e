/* A decoding step's attention in C: what model.exact_attention computes, for the compiled step
   (attention_kernel.py builds this file and calls it; model.exact_attention is the reference).

   Why C: a step attends its few rows (1 for a plain step, n + 1 for a tree) to every cached key,
   in each of the model's blocks. In PyTorch that is a dozen operators around two float64
   matrix products, ~150 us a block on a 2-core CPU; here it is a few passes over the keys.

   One pass for many rows: a step's query rows that read the same key/value head (grouped-query
   attention: H / G query heads, times T tokens) are taken LANES at a time, side by side in the
   lanes of a vector, one lane a row. Each key is then read once for all of them, and every
   operation below is one vector operation for LANES rows: a tree's rows cost little more than
   a plain step's, whose 3 query heads of a group already fill 3 lanes.

   Why the same bits wherever the keys sit (what keeps greedy Medusa lossless): every number a
   row's output depends on is computed by a fixed sequence of float32 operations over that row's
   visible keys, taken in slot order, and masked keys add nothing:
   - a score q . k is a sum over the head dim in the order d = 0, 1, ..., D - 1, one madd
     (multiply-add) a term, the same for every (row, key) pair;
   - exp is a polynomial of plain multiplies and adds (exp_lanes), the same bits in every lane;
   - the softmax denominator and the weighted sum of values run over the keys one after another
     in slot order, so a tree node, which sees its ancestors in later slots than a plain step
     does, adds the same terms in the same order as the plain step for the same token.
   A lane's arithmetic never mixes with another lane's, so a row's bits depend neither on the
   rows beside it, nor on its lane. Built with -ffp-contract=off: the compiler may not fuse a
   multiply and an add in one place and not in another; madd fuses them everywhere or nowhere.

   Shapes: H query heads, G key/value heads (H / G query heads read each), T rows (query tokens),
   S attended slots, D head dim (at most MAX_D). */
#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* LANES floats a vector, one register: 16 with AVX-512, 8 elsewhere (AVX2) */
#if defined(__AVX512F__)
#define LANES 16
#else
#define LANES 8
#endif
typedef float fv __attribute__((vector_size(4 * LANES)));  /* LANES rows' floats */
typedef int32_t iv __attribute__((vector_size(4 * LANES)));

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
  KEYS = 8,  /* keys a score pass takes at once: eight sums in flight hide the madds' latency */
  DIMS = 8,  /* head dims a values pass takes at once: eight sums in flight */
};

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

/* the dot products of the block's queries q[d] (one vector a head dim) with keys j .. j + n of
   k (rows of D floats): dot[t] (one vector of LANES rows' scores) for key j + t. n is a constant
   where this is inlined (KEYS, or 1 for the last keys): the same arithmetic either way. */
static inline __attribute__((always_inline)) void dot_keys(
    const fv* q, const float* k, int64_t j, int n, int64_t D, fv* dot) {
  for (int t = 0; t < n; t++) dot[t] = q[0] * k[(j + t) * D];
  for (int64_t d = 1; d < D; d++)
    for (int t = 0; t < n; t++) dot[t] = madd(q[d], lanes_of(k[(j + t) * D + d]), dot[t]);
}

/* the larger of a and b, lane by lane */
static inline fv max_lanes(fv a, fv b) {
  iv a_larger = a > b;  /* all bits set where a is larger */
  return (fv)(((iv)a & a_larger) | ((iv)b & ~a_larger));
}

/* the block's scores of key j (one vector of LANES rows) into s[j], scaled, and their running
   max; -inf where a row's token may not attend the key (mask[i]: lane i's row of the mask),
   checked only past `open`, the slots every lane's row may attend (the cache before a tree) */
static inline void keep_score(fv* s, int64_t j, fv dot, const Step* a,
                              const uint8_t* const* mask, int64_t open, fv* max) {
  fv x = dot * a->scale;
  if (j >= open)
    for (int i = 0; i < LANES; i++)
      if (!mask[i][j]) x[i] = -INFINITY;
  *max = max_lanes(x, *max);
  s[j] = x;
}

/* out[i][d .. d + n) for the block's rows: the values v (rows of D floats) weighted by the
   softmax numerators p[j] (one vector of LANES rows), summed over the keys in slot order, then
   divided by z. n is a constant where this is inlined (DIMS, or 1 for the last dims). */
static inline __attribute__((always_inline)) void weigh_values(
    const Step* a, const fv* p, fv z, const float* v, int64_t d, int n,
    const int64_t (*rows)[2], int m) {
  fv acc[DIMS];
  for (int e = 0; e < n; e++) acc[e] = (fv){0};
  for (int64_t j = 0; j < a->S; j++)
    for (int e = 0; e < n; e++) acc[e] = madd(p[j], lanes_of(v[j * a->D + d + e]), acc[e]);
  for (int e = 0; e < n; e++) {
    fv o = acc[e] / z;
    for (int i = 0; i < m; i++)
      store_value(a->out, rows[i][0] * a->out_head + rows[i][1] * a->out_row + d + e, o[i],
                  a->bf16);
  }
}

/* The m (<= LANES) query rows rows[i] = (query head, token), which read key/value head g, whose
   keys k and values v are S rows of D floats; s: S vectors of scratch for their scores. */
static void attend_block(const Step* a, const float* k, const float* v,
                         const int64_t (*rows)[2], int m, fv* s) {
  const int64_t D = a->D, S = a->S;
  fv q[MAX_D];  /* q[d]: lane i holds row i's d-th query value, 0 in lanes past m */
  const uint8_t* mask[LANES];  /* lane i's row of the mask; lanes past m repeat row 0's */
  int64_t open = S;  /* slots before the first one some lane's row may not attend */
  for (int i = 0; i < LANES; i++) {
    const int64_t* row = rows[i < m ? i : 0];
    mask[i] = a->mask + row[1] * S;
    const uint8_t* shut = memchr(mask[i], 0, S);
    open = shut != NULL && shut - mask[i] < open ? shut - mask[i] : open;
    for (int64_t d = 0; d < D; d++)
      q[d][i] = i < m ? value_at(a->q, row[0] * a->q_head + row[1] * a->q_row + d, a->bf16) : 0;
  }
  /* scores, masked keys at -inf, and each row's max */
  fv max = lanes_of(-INFINITY), dot[KEYS];
  int64_t j = 0;
  for (; j + KEYS <= S; j += KEYS) {
    dot_keys(q, k, j, KEYS, D, dot);
    for (int t = 0; t < KEYS; t++) keep_score(s, j + t, dot[t], a, mask, open, &max);
  }
  for (; j < S; j++) {
    dot_keys(q, k, j, 1, D, dot);
    keep_score(s, j, dot[0], a, mask, open, &max);
  }
  /* softmax numerators exp(score - max), in place; the denominator summed in slot order */
  fv z = {0};
  for (j = 0; j < S; j++) {
    s[j] = exp_lanes(s[j] - max);
    z = z + s[j];
  }
  int64_t d = 0;
  for (; d + DIMS <= D; d += DIMS) weigh_values(a, s, z, v, d, DIMS, rows, m);
  for (; d < D; d++) weigh_values(a, s, z, v, d, 1, rows, m);
}

/* key/value head g's S rows of D values from p as floats: p itself (float32), else converted
   into scratch (bfloat16) */
static const float* head_floats(const Step* a, const void* p, int64_t g, float* scratch) {
  const int64_t n = a->S * a->D, first = g * a->kv_head;
  if (!a->bf16) return (const float*)p + first;
  for (int64_t i = 0; i < n; i++) scratch[i] = value_at(p, first + i, 1);
  return scratch;
}

/* Every query row, in blocks of LANES rows that share a key/value head; blocks run on
   OpenMP's threads when there are several. Returns 0, 1 (a head dim over MAX_D or heads that do
   not group), or 2 (out of memory). */
int attend(const Step* a) {
  if (a->D > MAX_D || a->H % a->G != 0) return 1;
  const int64_t R = a->H / a->G, per_group = R * a->T, blocks = (per_group + LANES - 1) / LANES;
  const size_t scores = ((size_t)a->S * sizeof(fv) + 63) / 64 * 64;
  const size_t floats = a->bf16 ? 2 * (size_t)a->S * a->D * sizeof(float) : 0;
  int failed = 0;
#pragma omp parallel for schedule(static) if (a->G * blocks > 1)
  for (int64_t b = 0; b < a->G * blocks; b++) {
    const int64_t g = b / blocks, first = b % blocks * LANES;
    const int m = per_group - first < LANES ? (int)(per_group - first) : LANES;
    int64_t rows[LANES][2];
    for (int i = 0; i < m; i++) {
      rows[i][0] = g * R + (first + i) / a->T;  /* query head */
      rows[i][1] = (first + i) % a->T;  /* token */
    }
    fv* s = aligned_alloc(64, scores);  /* the block's scores, one vector a key */
    float* kv = floats ? malloc(floats) : NULL;  /* bfloat16 keys and values as floats */
    if (s == NULL || (floats && kv == NULL)) {
#pragma omp atomic write
      failed = 1;
    } else {
      const float* k = head_floats(a, a->k, g, kv);
      const float* v = head_floats(a, a->v, g, kv ? kv + a->S * a->D : NULL);
      attend_block(a, k, v, (const int64_t (*)[2])rows, m, s);
    }
    free(s);
    free(kv);
  }
  return failed ? 2 : 0;
}
