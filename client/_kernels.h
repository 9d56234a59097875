/* Inner loops shared by the compiled modules of routereplay.client: _ckernel (the codec's
 * optional kernels) and _cbatch (the batch chunk decoder). Static, so each module has its own
 * copy; included, not linked, so the two stay one source. */
#ifndef ROUTEREPLAY_KERNELS_H
#define ROUTEREPLAY_KERNELS_H
#include <stddef.h>
#include <stdint.h>

/* One (layer, slot) stream after another; eight tokens per mask byte window. ``v`` points one
 * before the first value: rank(t) >= 1 once a stream's first bit is set. */
#define JOIN_BODY(T_)                                                                      \
    const T_ *v = v0 - 1;                                                                  \
    ptrdiff_t j = 0;                                                                       \
    for (ptrdiff_t s = 0; s < M * K; s++) {                                                \
        T_ *restrict dst = o + (s / K) * T * K + s % K;                                    \
        ptrdiff_t t = 0, i = s * T;                                                        \
        /* Eight bits at a time from a two-byte window (streams start at any bit), while   \
         * the window's second byte is inside the mask. */                                 \
        for (; t + 8 <= T && (i >> 3) + 1 < nbytes; t += 8, i += 8) {                      \
            const unsigned w = ((unsigned)mb[i >> 3] << 8 | mb[(i >> 3) + 1]) >> (8 - (i & 7));\
            j += (w >> 7) & 1; dst[(t + 0) * K] = v[j];                                    \
            j += (w >> 6) & 1; dst[(t + 1) * K] = v[j];                                    \
            j += (w >> 5) & 1; dst[(t + 2) * K] = v[j];                                    \
            j += (w >> 4) & 1; dst[(t + 3) * K] = v[j];                                    \
            j += (w >> 3) & 1; dst[(t + 4) * K] = v[j];                                    \
            j += (w >> 2) & 1; dst[(t + 5) * K] = v[j];                                    \
            j += (w >> 1) & 1; dst[(t + 6) * K] = v[j];                                    \
            j += w & 1; dst[(t + 7) * K] = v[j];                                           \
        }                                                                                  \
        for (; t < T; t++, i++) {                                                          \
            j += (mb[i >> 3] >> (7 - (i & 7))) & 1;                                        \
            dst[t * K] = v[j];                                                             \
        }                                                                                  \
    }

static void join_u8(const uint8_t *restrict mb, const uint8_t *restrict v0, uint8_t *restrict o,
                    ptrdiff_t M, ptrdiff_t T, ptrdiff_t K) {
    const ptrdiff_t nbytes = (M * T * K + 7) / 8;
    JOIN_BODY(uint8_t)
}

static void join_u16(const uint8_t *restrict mb, const uint16_t *restrict v0,
                     uint16_t *restrict o, ptrdiff_t M, ptrdiff_t T, ptrdiff_t K) {
    const ptrdiff_t nbytes = (M * T * K + 7) / 8;
    JOIN_BODY(uint16_t)
}

#endif
