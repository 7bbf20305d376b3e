/* A decoding step's attention in C: what model.exact_attention computes, for the compiled step
   (attention_kernel.py builds this file and calls it; model.exact_attention is the reference).

   Why C: a step attends its few rows (1 for a plain step, n + 1 for a tree) to every cached key,
   in each of the model's blocks. In PyTorch that is a dozen operators around two float64
   matrix products, ~150 us a block on a 2-core CPU; here it is one loop over the keys, a few us.

   Why the same bits wherever the keys sit (what keeps greedy Medusa lossless): every number a
   row's output depends on is computed by a fixed sequence of float32 operations over that row's
   visible keys, taken in slot order, and masked keys add nothing:
   - a score q . k is LANES-lane partial sums over the head dim then a fixed pairwise sum of the
     lanes: the same operations for every (row, key) pair, whichever slot the key is in;
   - exp is a polynomial of plain multiplies and adds (exp_lanes), the same bits in every lane;
   - the softmax denominator and the weighted sum of values run over the keys one after another
     in slot order, so a tree node, which sees its ancestors in later slots than a plain step
     does, adds the same terms in the same order as the plain step for the same token.
   Built with -ffp-contract=off: the compiler may not fuse a multiply and an add in one place
   and not in another.

   Shapes: H query heads, G key/value heads (H / G query heads read each), T rows (query tokens),
   S attended slots, D head dim (at most MAX_D). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* LANES floats a vector: one register. 16 with AVX-512; 8 elsewhere (AVX2), where a vector of
   16 would take two registers and spill (measured on the 2-core AVX2 EPYC: 75 us a tree row a
   block, slower than the float64 reference). The bits differ between the two widths (the lanes'
   partial sums), never between rows: within a machine a row is computed one way. */
#if defined(__AVX512F__)
#define LANES 16
#define ROWS 4  /* rows a pass over the keys serves */
#else
#define LANES 8
#define ROWS 8  /* 8 rows a pass: 264 against 355 us for 9 tree rows (27 query rows) a block */
#endif
typedef float fv __attribute__((vector_size(4 * LANES)));  /* LANES floats */
typedef int32_t iv __attribute__((vector_size(4 * LANES)));
typedef uint32_t uv __attribute__((vector_size(4 * LANES)));
typedef uint16_t hv __attribute__((vector_size(2 * LANES)));
typedef float f8 __attribute__((vector_size(32)));
typedef float f4 __attribute__((vector_size(16)));

enum { MAX_D = 256 };

/* LANES values from p[i..i + n), bfloat16 (bf16 != 0) or float32, as floats; zeros past n
   (the last chunk of a head dim that is not a multiple of LANES) */
static inline fv load_lanes(const void* p, int64_t i, int64_t n, int bf16) {
  fv f;
  if (bf16) {
    hv h;
    if (n == LANES) {
      memcpy(&h, (const uint16_t*)p + i, sizeof h);
    } else {
      memset(&h, 0, sizeof h);
      memcpy(&h, (const uint16_t*)p + i, n * sizeof(uint16_t));
    }
    uv w = __builtin_convertvector(h, uv) << 16;  /* a bfloat16 is a float's top half */
    memcpy(&f, &w, sizeof f);
  } else if (n == LANES) {
    memcpy(&f, (const float*)p + i, sizeof f);
  } else {
    memset(&f, 0, sizeof f);
    memcpy(&f, (const float*)p + i, n * sizeof(float));
  }
  return f;
}

/* the first n of LANES floats into p[i..], rounded to bfloat16 (to nearest, ties to even, as
   torch rounds) or kept as float32 */
static inline void store_lanes(void* p, int64_t i, int64_t n, fv f, int bf16) {
  if (bf16) {
    uint32_t u[LANES];
    memcpy(u, &f, sizeof u);
    for (int64_t l = 0; l < n; l++)
      ((uint16_t*)p)[i + l] = (uint16_t)((u[l] + 0x7FFF + ((u[l] >> 16) & 1)) >> 16);
  } else {
    memcpy((float*)p + i, &f, n * sizeof(float));
  }
}

/* how many of a row of D values the c-th chunk of LANES holds (the last may hold fewer) */
static inline int64_t chunk(int64_t D, int64_t c) {
  return D - c * LANES < LANES ? D - c * LANES : LANES;
}

/* a row of D values from p[i..], as C chunks of LANES floats */
static inline void load_row(fv* row, const void* p, int64_t i, int64_t D, int64_t C, int bf16) {
  for (int64_t c = 0; c < C; c++) row[c] = load_lanes(p, i + c * LANES, chunk(D, c), bf16);
}

/* the sum of the lanes, always in this order: halves (of 16), then quarters, then pairs */
static inline float lane_sum(fv a) {
#if LANES == 16
  f8 b = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  f8 b = a;
#endif
  f4 c = __builtin_shufflevector(b, b, 0, 1, 2, 3) + __builtin_shufflevector(b, b, 4, 5, 6, 7);
  return (c[0] + c[2]) + (c[1] + c[3]);
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

/* `n` (<= ROWS) query rows that read key/value head g: rows[i] = (query head, token). C: the
   head dim's chunks of LANES floats, a constant in each copy attend_rows makes (registers, unrolling). */
static inline __attribute__((always_inline)) void attend_rows_of(
    const Step* a, int64_t g, const int64_t (*rows)[2], int n, float* s, const int64_t C) {
  const int64_t D = a->D, S = a->S;
  fv q[ROWS][C];
  for (int i = 0; i < n; i++)
    load_row(q[i], a->q, rows[i][0] * a->q_head + rows[i][1] * a->q_row, D, C, a->bf16);
  /* scores, masked keys at -inf: each key's D values read once for the n rows */
  const int64_t SL = (S + LANES - 1) / LANES * LANES;
  for (int64_t j = 0; j < S; j++) {
    fv k[C];
    load_row(k, a->k, g * a->kv_head + j * D, D, C, a->bf16);
    for (int i = 0; i < n; i++) {
      fv dot = q[i][0] * k[0];
      for (int64_t c = 1; c < C; c++) dot = dot + q[i][c] * k[c];
      s[i * SL + j] = a->mask[rows[i][1] * S + j] ? lane_sum(dot) * a->scale : -INFINITY;
    }
  }
  /* softmax numerators exp(score - max), in place; the denominator summed in slot order */
  float z[ROWS];
  for (int i = 0; i < n; i++) {
    float* si = s + i * SL;
    float max = -INFINITY;
    for (int64_t j = 0; j < S; j++) max = si[j] > max ? si[j] : max;
    for (int64_t j = S; j < SL; j++) si[j] = -INFINITY;
    for (int64_t j = 0; j < SL; j += LANES) {
      fv x;
      memcpy(&x, si + j, sizeof x);
      x = exp_lanes(x - max);
      memcpy(si + j, &x, sizeof x);
    }
    z[i] = 0.0f;
    for (int64_t j = 0; j < S; j++) z[i] += si[j];
  }
  /* the values weighted by the numerators, summed in slot order; then divided by z */
  fv acc[ROWS][C];
  for (int i = 0; i < n; i++)
    for (int64_t c = 0; c < C; c++) acc[i][c] = (fv){0};
  for (int64_t j = 0; j < S; j++) {
    fv v[C];
    load_row(v, a->v, g * a->kv_head + j * D, D, C, a->bf16);
    for (int i = 0; i < n; i++) {
      float p = s[i * SL + j];
      for (int64_t c = 0; c < C; c++) acc[i][c] = acc[i][c] + p * v[c];
    }
  }
  for (int i = 0; i < n; i++)
    for (int64_t c = 0; c < C; c++)
      store_lanes(a->out, rows[i][0] * a->out_head + rows[i][1] * a->out_row + c * LANES,
              chunk(D, c), acc[i][c] / z[i], a->bf16);
}

static void attend_rows(const Step* a, int64_t g, const int64_t (*rows)[2], int n, float* s) {
  switch ((a->D + LANES - 1) / LANES) {
#define CHUNKS(C) case C: attend_rows_of(a, g, rows, n, s, C); break;
    CHUNKS(1) CHUNKS(2) CHUNKS(3) CHUNKS(4) CHUNKS(5) CHUNKS(6) CHUNKS(7) CHUNKS(8)
    CHUNKS(9) CHUNKS(10) CHUNKS(11) CHUNKS(12) CHUNKS(13) CHUNKS(14) CHUNKS(15) CHUNKS(16)
#if LANES == 8
    CHUNKS(17) CHUNKS(18) CHUNKS(19) CHUNKS(20) CHUNKS(21) CHUNKS(22) CHUNKS(23) CHUNKS(24)
    CHUNKS(25) CHUNKS(26) CHUNKS(27) CHUNKS(28) CHUNKS(29) CHUNKS(30) CHUNKS(31) CHUNKS(32)
#endif
#undef CHUNKS
  }
}

/* Every query row, in blocks of ROWS rows that share a key/value head (grouped-query attention:
   each key is read once per block); blocks run on OpenMP's threads when there are enough. */
int attend(const Step* a) {
  if (a->D > MAX_D || a->H % a->G != 0) return 1;
  const int64_t R = a->H / a->G, per_group = R * a->T, blocks = (per_group + ROWS - 1) / ROWS;
  const int64_t SL = (a->S + LANES - 1) / LANES * LANES;
  int failed = 0;
#pragma omp parallel for schedule(static) if (a->G * blocks > 1)
  for (int64_t b = 0; b < a->G * blocks; b++) {
    const int64_t g = b / blocks, first = b % blocks * ROWS;
    const int n = per_group - first < ROWS ? (int)(per_group - first) : ROWS;
    int64_t rows[ROWS][2];
    for (int i = 0; i < n; i++) {
      rows[i][0] = g * R + (first + i) / a->T;  /* query head */
      rows[i][1] = (first + i) % a->T;  /* token */
    }
    float* s = malloc(sizeof(float) * ROWS * SL);  /* the block's scores */
    if (s == NULL) {
#pragma omp atomic write
      failed = 1;
      continue;
    }
    attend_rows(a, g, (const int64_t (*)[2])rows, n, s);
    free(s);
  }
  return failed ? 2 : 0;
}
