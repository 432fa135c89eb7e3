/* The counter-based random drop of moemerge/merge/draws.py, for native/__init__.py.
 *
 * draws_keep: out[k] = tau[k] * (u(offset + k) < p_k), u the hash draws.py defines (the same
 * 32-bit arithmetic: unsigned multiplication wraps mod 2^32 as its int64 `& MASK32` does),
 * p_k = probs[k], or p for every entry when probs is NULL. Each entry alone, so the loop
 * vectorises; no state, so any block order gives the same bytes.
 */
#include <stdint.h>

static inline uint32_t mix(uint32_t x) {
    x ^= x >> 16;
    x *= 0x21F0AAADu;
    x ^= x >> 15;
    x *= 0x735A2D97u;
    return x ^ (x >> 15);
}

static inline float uniform(int64_t j, uint32_t s1, uint32_t s2) {
    uint64_t u = (uint64_t)j;
    uint32_t h = mix(mix((uint32_t)u ^ s1) ^ (uint32_t)(u >> 32) ^ s2);
    return (float)(h >> 8) * 0x1p-24f; /* exact: a 24-bit integer times a power of two */
}

int draws_keep(const float *tau, const float *probs, float p, int64_t count, int64_t offset,
               uint32_t s1, uint32_t s2, float *out) {
    if (probs)
        for (int64_t k = 0; k < count; k++)
            out[k] = tau[k] * (float)(uniform(offset + k, s1, s2) < probs[k]);
    else
        for (int64_t k = 0; k < count; k++)
            out[k] = tau[k] * (float)(uniform(offset + k, s1, s2) < p);
    return 0;
}
