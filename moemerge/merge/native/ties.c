/* TIES in three streaming passes over the inputs, for moemerge/merge/native/__init__.py.
 *
 * Each function reads the base and n <= 4 models (bf16 or float32, `count` entries each) and
 * does, per entry, the same float32 operations in the same order as the torch code it stands in
 * for (moemerge/merge/primitives.py, blocks.py), so the bytes out are the same: built with
 * -ffp-contract=off (no fused multiply-add) and no fast-math, and sums over the models run from
 * 0.0 in model order, as torch sums a [n <= 4, ...] stack over its first axis.
 *
 *   ties_histogram:     per model, the counts of the top 16 bits of |tau| (accumulated);
 *   ties_histogram_low: per model, the counts of the low 15 bits of the |tau| in one bucket of
 *                       the first: with both, the k-th largest |tau| is exact, no sort, no
 *                       copy of the entries (a non-negative float32 orders as its bits);
 *   ties_merge:         trim at the thresholds, elect the sign of the (weighted) sum, the
 *                       disjoint (weighted) mean, theta_base + lambda * that, in the output dtype;
 *   ties_consensus:     the same from the elect on, for task vectors another method sparsified
 *                       (DARE-TIES, breadcrumbs-TIES, DELLA): a float32 [n, count] stack.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define BUCKETS 65536 /* the top 16 bits of a non-negative float32 */
#define LOW 32768 /* its low 15 bits */
#define MAX_MODELS 4

static inline float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t to_bf16(float f) { /* round to nearest even, as torch; NaN: 0x7FC0 */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint16_t rounded = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    return (u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0 : rounded;
}

static inline uint32_t bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float sign_of(float x) { return (float)((x > 0.0f) - (x < 0.0f)); } /* torch.sign */

/* dtype codes: 0 float32, 1 bfloat16 */
static inline float load(const void *p, int64_t j, int dtype) {
    return dtype ? from_bf16(((const uint16_t *)p)[j]) : ((const float *)p)[j];
}

#define INLINE static inline __attribute__((always_inline))

INLINE void histogram(const void *base, const void *const *models, int n, int64_t count,
                      int dt, int64_t *counts) {
    for (int64_t j = 0; j < count; j++) {
        float b = load(base, j, dt);
        for (int i = 0; i < n; i++) {
            uint32_t key = (bits(load(models[i], j, dt) - b) & 0x7FFFFFFFu) >> 15; /* |tau| */
            counts[(int64_t)i * BUCKETS + key]++;
        }
    }
}

INLINE void histogram_low(const void *base, const void *const *models, int n, int64_t count,
                          int dt, const int32_t *buckets, int64_t *counts) {
    for (int64_t j = 0; j < count; j++) {
        float b = load(base, j, dt);
        for (int i = 0; i < n; i++) {
            uint32_t a = bits(load(models[i], j, dt) - b) & 0x7FFFFFFFu; /* |tau| */
            if ((int32_t)(a >> 15) == buckets[i]) counts[(int64_t)i * LOW + (a & (LOW - 1))]++;
        }
    }
}

#define CHUNK 512 /* entries per chunk: its float32 rows (one per model) stay in L1 */

/* One simple loop per step over a chunk, each of which the compiler vectorises; per entry the
 * steps are those of the torch code, in its order (comparisons become 0.0 / 1.0 and multiply).
 * elect + disjoint mean + base + lambda * that (methods.consensus_merge) of a chunk whose base
 * values are b[] and whose sparsified task vectors are tau[i][]: */
INLINE void consensus(int n, int len, const float *b, float tau[][CHUNK], const float *weights,
                      float lam, int normalize, int zero_vote_positive, void *out,
                      int64_t start, int out_dt) {
    const float tiny = 1.17549435e-38f; /* torch.finfo(torch.float32).tiny */
    float vote[CHUNK], total[CHUNK], merged[CHUNK];
    for (int k = 0; k < len; k++) vote[k] = 0.0f;
    for (int i = 0; i < n; i++) { /* the (weighted) sum of the task vectors */
        const float *t = tau[i];
        if (weights)
            for (int k = 0; k < len; k++) vote[k] = vote[k] + t[k] * weights[i];
        else
            for (int k = 0; k < len; k++) vote[k] = vote[k] + t[k];
    }
    for (int k = 0; k < len; k++) { /* the elected sign, kept in vote */
        float sign = sign_of(vote[k]);
        vote[k] = zero_vote_positive && vote[k] == 0.0f ? 1.0f : sign;
    }
    for (int k = 0; k < len; k++) total[k] = merged[k] = 0.0f;
    for (int i = 0; i < n; i++) { /* the agreeing models: the elected sign, nonzero */
        float w = weights ? weights[i] : 1.0f;
        const float *t = tau[i];
        for (int k = 0; k < len; k++) {
            float agree = (float)((sign_of(t[k]) == vote[k]) & (t[k] != 0.0f));
            float wk = weights ? w * agree : agree;
            total[k] = total[k] + wk;
            merged[k] = merged[k] + t[k] * wk;
        }
    }
    if (normalize) /* / max(total, tiny), then * (total > 0) */
        for (int k = 0; k < len; k++)
            merged[k] = merged[k] / fmaxf(total[k], tiny) * (float)(total[k] > 0.0f);
    if (out_dt)
        for (int k = 0; k < len; k++)
            ((uint16_t *)out)[start + k] = to_bf16(b[k] + lam * merged[k]);
    else
        for (int k = 0; k < len; k++) ((float *)out)[start + k] = b[k] + lam * merged[k];
}

/* TIES: trim (tau * (|tau| >= threshold); |NaN| >= x is false), then the consensus */
INLINE void merge(const void *base, const void *const *models, int n, int64_t count, int dt,
                  const float *thresholds, const float *weights, float lam, int normalize,
                  int zero_vote_positive, void *out, int out_dt) {
    float b[CHUNK], tau[MAX_MODELS][CHUNK];
    for (int64_t start = 0; start < count; start += CHUNK) {
        int len = count - start < CHUNK ? (int)(count - start) : CHUNK;
        for (int k = 0; k < len; k++) b[k] = load(base, start + k, dt);
        for (int i = 0; i < n; i++) {
            const void *m = models[i];
            float thr = thresholds[i], *t = tau[i];
            for (int k = 0; k < len; k++) t[k] = load(m, start + k, dt) - b[k];
            for (int k = 0; k < len; k++) t[k] = t[k] * (float)(fabsf(t[k]) >= thr);
        }
        consensus(n, len, b, tau, weights, lam, normalize, zero_vote_positive, out, start,
                  out_dt);
    }
}

/* the consensus of sparsified task vectors another method made: taus [n, count] float32 */
INLINE void stack_consensus(const void *base, const float *taus, int n, int64_t count, int dt,
                            const float *weights, float lam, int normalize,
                            int zero_vote_positive, void *out, int out_dt) {
    float b[CHUNK], tau[MAX_MODELS][CHUNK];
    for (int64_t start = 0; start < count; start += CHUNK) {
        int len = count - start < CHUNK ? (int)(count - start) : CHUNK;
        for (int k = 0; k < len; k++) b[k] = load(base, start + k, dt);
        for (int i = 0; i < n; i++)
            memcpy(tau[i], taus + (int64_t)i * count + start, (size_t)len * sizeof(float));
        consensus(n, len, b, tau, weights, lam, normalize, zero_vote_positive, out, start,
                  out_dt);
    }
}

/* Each entry point calls its body with the dtype and model count as constants, so the compiler
 * makes one loop per case. */
#define SPECIALISE(CALL)                                                                         \
    switch (n * 2 + dtype) {                                                                     \
    case 2: CALL(1, 0); break;                                                                   \
    case 3: CALL(1, 1); break;                                                                   \
    case 4: CALL(2, 0); break;                                                                   \
    case 5: CALL(2, 1); break;                                                                   \
    case 6: CALL(3, 0); break;                                                                   \
    case 7: CALL(3, 1); break;                                                                   \
    case 8: CALL(4, 0); break;                                                                   \
    case 9: CALL(4, 1); break;                                                                   \
    default: return -1;                                                                          \
    }                                                                                            \
    return 0;

int ties_histogram(const void *base, const void *const *models, int n, int64_t count, int dtype,
                   int64_t *counts /* [n, BUCKETS] */) {
#define HISTOGRAM(N, DT) histogram(base, models, N, count, DT, counts)
    SPECIALISE(HISTOGRAM)
}

int ties_histogram_low(const void *base, const void *const *models, int n, int64_t count,
                       int dtype, const int32_t *buckets /* [n] */, int64_t *counts /* [n, LOW] */) {
#define HISTOGRAM_LOW(N, DT) histogram_low(base, models, N, count, DT, buckets, counts)
    SPECIALISE(HISTOGRAM_LOW)
}

/* weights: NULL for unit weights (torch does not multiply by them); out_dtype: a dtype code */
int ties_merge(const void *base, const void *const *models, int n, int64_t count, int dtype,
               const float *thresholds, const float *weights, float lam, int normalize,
               int zero_vote_positive, void *out, int out_dtype) {
#define MERGE(N, DT)                                                                             \
    (out_dtype ? merge(base, models, N, count, DT, thresholds, weights, lam, normalize,          \
                       zero_vote_positive, out, 1)                                               \
               : merge(base, models, N, count, DT, thresholds, weights, lam, normalize,          \
                       zero_vote_positive, out, 0))
    SPECIALISE(MERGE)
}

int ties_consensus(const void *base, const float *taus, int n, int64_t count, int dtype,
                   const float *weights, float lam, int normalize, int zero_vote_positive,
                   void *out, int out_dtype) {
#define CONSENSUS(N, DT)                                                                         \
    (out_dtype ? stack_consensus(base, taus, N, count, DT, weights, lam, normalize,              \
                                 zero_vote_positive, out, 1)                                     \
               : stack_consensus(base, taus, N, count, DT, weights, lam, normalize,              \
                                 zero_vote_positive, out, 0))
    SPECIALISE(CONSENSUS)
}
