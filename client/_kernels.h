/* Inner loops shared by the compiled modules of routereplay.client: _ckernel (the codec's
 * optional kernels) and _cbatch (the batch chunk decoder). Static, so each module has its own
 * copy; included, not linked, so the two stay one source. */
#ifndef ROUTEREPLAY_KERNELS_H
#define ROUTEREPLAY_KERNELS_H
#include <stddef.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>

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

/* Set bits in n bytes, eight bytes at a time (a portable popcount: the build targets no
 * particular x86-64 level, where __builtin_popcount is a call per byte). */
static inline unsigned pop64(uint64_t x) {
    x = x - ((x >> 1) & 0x5555555555555555ull);
    x = (x & 0x3333333333333333ull) + ((x >> 2) & 0x3333333333333333ull);
    x = (x + (x >> 4)) & 0x0f0f0f0f0f0f0f0full;
    return (unsigned)((x * 0x0101010101010101ull) >> 56);
}

static size_t count_bits(const uint8_t *p, size_t n) {
    size_t c = 0, i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        c += pop64(w);
    }
    for (; i < n; i++) c += pop64(p[i]);
    return c;
}

/* RANKS[w][i]: set bits among the first i + 1 tokens of mask byte w (token 0 is bit 7). */
#define RR_B(w, i) (((w) >> (7 - (i))) & 1)
#define RR_P(w)                                                                            \
    {RR_B(w, 0), RR_B(w, 0) + RR_B(w, 1), RR_B(w, 0) + RR_B(w, 1) + RR_B(w, 2),            \
     RR_B(w, 0) + RR_B(w, 1) + RR_B(w, 2) + RR_B(w, 3),                                    \
     RR_B(w, 0) + RR_B(w, 1) + RR_B(w, 2) + RR_B(w, 3) + RR_B(w, 4),                       \
     RR_B(w, 0) + RR_B(w, 1) + RR_B(w, 2) + RR_B(w, 3) + RR_B(w, 4) + RR_B(w, 5),          \
     RR_B(w, 0) + RR_B(w, 1) + RR_B(w, 2) + RR_B(w, 3) + RR_B(w, 4) + RR_B(w, 5) +         \
         RR_B(w, 6),                                                                       \
     RR_B(w, 0) + RR_B(w, 1) + RR_B(w, 2) + RR_B(w, 3) + RR_B(w, 4) + RR_B(w, 5) +         \
         RR_B(w, 6) + RR_B(w, 7)}
#define RR_P4(w) RR_P(w), RR_P((w) + 1), RR_P((w) + 2), RR_P((w) + 3)
#define RR_P16(w) RR_P4(w), RR_P4((w) + 4), RR_P4((w) + 8), RR_P4((w) + 12)
#define RR_P64(w) RR_P16(w), RR_P16((w) + 16), RR_P16((w) + 32), RR_P16((w) + 48)
static const uint8_t RANKS[256][8] = {RR_P64(0), RR_P64(64), RR_P64(128), RR_P64(192)};

/* The common shape of a store chunk, top-8 byte ids over whole mask bytes (T % 8 == 0), eight
 * tokens of a layer's eight streams at a time: each stream's eight ids are its values at
 * ``j - 1 + RANKS[w]`` (j: the stream's ids taken so far), and the 8 x 8 block is stored
 * token-major as 64 contiguous bytes. JOIN_BODY instead does one strided byte store per id
 * behind a running count; this is what a skewed workload's decode spent most of its time in.
 * The caller has checked that the set bits count the ``nv`` values and that every stream's
 * first bit is set, so every index below is within 0 .. nv - 1. */
#define RR_K8_LAYER_SETUP(T_)                                                              \
    const size_t tb = (size_t)T / 8;                                                       \
    const uint8_t *mrow = mb + (size_t)m * 8 * tb;                                         \
    size_t jk[8];                                                                          \
    for (int k = 0; k < 8; k++) {                                                          \
        jk[k] = j;                                                                         \
        j += count_bits(mrow + k * tb, tb);                                                \
    }                                                                                      \
    T_ *dst = o + (size_t)m * (size_t)T * 8;

#define RR_K8_SCALAR(T_)                                                                   \
    static void join_k8_scalar_##T_(const uint8_t *restrict mb, const T_ *restrict v0,     \
                                    T_ *restrict o, ptrdiff_t M, ptrdiff_t T) {            \
        size_t j = 0;                                                                      \
        for (ptrdiff_t m = 0; m < M; m++) {                                                \
            RR_K8_LAYER_SETUP(T_)                                                          \
            for (size_t b = 0; b < tb; b++, dst += 64)                                     \
                for (int k = 0; k < 8; k++) {                                              \
                    const uint8_t *r = RANKS[mrow[k * tb + b]];                            \
                    const T_ *v = v0 + jk[k] - 1;                                          \
                    for (int i = 0; i < 8; i++) dst[i * 8 + k] = v[r[i]];                  \
                    jk[k] += r[7];                                                         \
                }                                                                          \
        }                                                                                  \
    }
RR_K8_SCALAR(uint8_t)
RR_K8_SCALAR(uint16_t)

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define RR_HAVE_SSSE3_JOIN 1
/* The same with a byte shuffle per stream (SSSE3: every x86-64 server CPU since 2006, checked
 * at run time) and an SSE2 transpose. A stream reads its 16 bytes from ``v0 + j - 1`` only
 * where they lie inside the values; the first and last few ids take the scalar lane. */
__attribute__((target("ssse3"))) static void join_u8_k8_ssse3(
    const uint8_t *restrict mb, const uint8_t *restrict v0, size_t nv, uint8_t *restrict o,
    ptrdiff_t M, ptrdiff_t T) {
    size_t j = 0;
    for (ptrdiff_t m = 0; m < M; m++) {
        RR_K8_LAYER_SETUP(uint8_t)
        for (size_t b = 0; b < tb; b++, dst += 64) {
            __m128i L[8];
            for (int k = 0; k < 8; k++) {
                const uint8_t *r = RANKS[mrow[k * tb + b]];
                const size_t jj = jk[k];
                if (jj >= 1 && jj + 15 <= nv) {
                    L[k] = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(v0 + jj - 1)),
                                            _mm_loadl_epi64((const __m128i *)r));
                } else {
                    uint8_t lane[16] = {0};
                    for (int i = 0; i < 8; i++) lane[i] = v0[jj - 1 + r[i]];
                    L[k] = _mm_loadu_si128((const __m128i *)lane);
                }
                jk[k] = jj + r[7];
            }
            const __m128i a = _mm_unpacklo_epi8(L[0], L[1]), c = _mm_unpacklo_epi8(L[2], L[3]);
            const __m128i e = _mm_unpacklo_epi8(L[4], L[5]), g = _mm_unpacklo_epi8(L[6], L[7]);
            const __m128i ac0 = _mm_unpacklo_epi16(a, c), ac1 = _mm_unpackhi_epi16(a, c);
            const __m128i eg0 = _mm_unpacklo_epi16(e, g), eg1 = _mm_unpackhi_epi16(e, g);
            _mm_storeu_si128((__m128i *)dst, _mm_unpacklo_epi32(ac0, eg0));
            _mm_storeu_si128((__m128i *)(dst + 16), _mm_unpackhi_epi32(ac0, eg0));
            _mm_storeu_si128((__m128i *)(dst + 32), _mm_unpacklo_epi32(ac1, eg1));
            _mm_storeu_si128((__m128i *)(dst + 48), _mm_unpackhi_epi32(ac1, eg1));
        }
    }
}

/* RR_SH16[w]: the pshufb mask that gathers a stream's eight uint16 ids for mask byte w from the
 * values v[j - 1 .. j + 6]: id i is value j - 1 + RANKS[w][i], bytes 2r and 2r + 1 of the load.
 * RANKS reaches 8 only for w = 0xFF (every id new), which the join loads directly instead. */
#define RR_R(w, i)                                                                         \
    (RR_B(w, 0) + ((i) >= 1 ? RR_B(w, 1) : 0) + ((i) >= 2 ? RR_B(w, 2) : 0) +              \
     ((i) >= 3 ? RR_B(w, 3) : 0) + ((i) >= 4 ? RR_B(w, 4) : 0) + ((i) >= 5 ? RR_B(w, 5) : 0) + \
     ((i) >= 6 ? RR_B(w, 6) : 0) + ((i) >= 7 ? RR_B(w, 7) : 0))
#define RR_L(w, i) (uint8_t)(2 * RR_R(w, i)), (uint8_t)(2 * RR_R(w, i) + 1)
#define RR_S(w)                                                                            \
    {RR_L(w, 0), RR_L(w, 1), RR_L(w, 2), RR_L(w, 3), RR_L(w, 4), RR_L(w, 5), RR_L(w, 6),    \
     RR_L(w, 7)}
#define RR_S4(w) RR_S(w), RR_S((w) + 1), RR_S((w) + 2), RR_S((w) + 3)
#define RR_S16(w) RR_S4(w), RR_S4((w) + 4), RR_S4((w) + 8), RR_S4((w) + 12)
#define RR_S64(w) RR_S16(w), RR_S16((w) + 16), RR_S16((w) + 32), RR_S16((w) + 48)
static const uint8_t RR_SH16[256][16] = {RR_S64(0), RR_S64(64), RR_S64(128), RR_S64(192)};

/* join_u8_k8_ssse3 for uint16 ids: one load and shuffle per stream, an 8 x 8 transpose of
 * 16-bit lanes, eight 16-byte rows stored. Reads v0[j - 1 .. j + 7] only where they lie inside
 * the ``nv`` values; the first and last few ids take the scalar lane. */
__attribute__((target("ssse3"))) static void join_u16_k8_ssse3(
    const uint8_t *restrict mb, const uint16_t *restrict v0, size_t nv, uint16_t *restrict o,
    ptrdiff_t M, ptrdiff_t T) {
    size_t j = 0;
    for (ptrdiff_t m = 0; m < M; m++) {
        RR_K8_LAYER_SETUP(uint16_t)
        for (size_t b = 0; b < tb; b++, dst += 64) {
            __m128i L[8];
            for (int k = 0; k < 8; k++) {
                const uint8_t w = mrow[k * tb + b];
                const size_t jj = jk[k];
                if (jj >= 1 && jj + 8 <= nv) {
                    L[k] = w == 0xFF /* every id new: values j .. j + 7 as they are */
                               ? _mm_loadu_si128((const __m128i *)(v0 + jj))
                               : _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(v0 + jj - 1)),
                                                  _mm_loadu_si128((const __m128i *)RR_SH16[w]));
                } else {
                    uint16_t lane[8];
                    const uint8_t *r = RANKS[w];
                    for (int i = 0; i < 8; i++) lane[i] = v0[jj - 1 + r[i]];
                    L[k] = _mm_loadu_si128((const __m128i *)lane);
                }
                jk[k] = jj + RANKS[w][7];
            }
            const __m128i a = _mm_unpacklo_epi16(L[0], L[1]), b2 = _mm_unpackhi_epi16(L[0], L[1]);
            const __m128i c = _mm_unpacklo_epi16(L[2], L[3]), d = _mm_unpackhi_epi16(L[2], L[3]);
            const __m128i e = _mm_unpacklo_epi16(L[4], L[5]), f = _mm_unpackhi_epi16(L[4], L[5]);
            const __m128i g = _mm_unpacklo_epi16(L[6], L[7]), h = _mm_unpackhi_epi16(L[6], L[7]);
            const __m128i ac0 = _mm_unpacklo_epi32(a, c), ac1 = _mm_unpackhi_epi32(a, c);
            const __m128i bd0 = _mm_unpacklo_epi32(b2, d), bd1 = _mm_unpackhi_epi32(b2, d);
            const __m128i eg0 = _mm_unpacklo_epi32(e, g), eg1 = _mm_unpackhi_epi32(e, g);
            const __m128i fh0 = _mm_unpacklo_epi32(f, h), fh1 = _mm_unpackhi_epi32(f, h);
            __m128i *out = (__m128i *)dst; /* token t + i's eight slots: row i */
            _mm_storeu_si128(out + 0, _mm_unpacklo_epi64(ac0, eg0));
            _mm_storeu_si128(out + 1, _mm_unpackhi_epi64(ac0, eg0));
            _mm_storeu_si128(out + 2, _mm_unpacklo_epi64(ac1, eg1));
            _mm_storeu_si128(out + 3, _mm_unpackhi_epi64(ac1, eg1));
            _mm_storeu_si128(out + 4, _mm_unpacklo_epi64(bd0, fh0));
            _mm_storeu_si128(out + 5, _mm_unpackhi_epi64(bd0, fh0));
            _mm_storeu_si128(out + 6, _mm_unpacklo_epi64(bd1, fh1));
            _mm_storeu_si128(out + 7, _mm_unpackhi_epi64(bd1, fh1));
        }
    }
}
#endif

/* join_u8 / join_u16: ``nv`` values at ``v0``: how far the block join may read. ``simd`` 0
 * keeps to the portable loops (what a CPU without SSSE3 runs; the tests compare both). */
#ifdef RR_HAVE_SSSE3_JOIN
#define RR_K8_SIMD(fn)                                                                     \
    if (simd && __builtin_cpu_supports("ssse3")) {                                         \
        fn(mb, v0, nv, o, M, T);                                                           \
        return;                                                                            \
    }
#else
#define RR_K8_SIMD(fn)
#endif
#define RR_JOIN(name, T_, simd_fn)                                                         \
    static void name(const uint8_t *restrict mb, const T_ *restrict v0, size_t nv,         \
                     T_ *restrict o, ptrdiff_t M, ptrdiff_t T, ptrdiff_t K, int simd) {    \
        if (K == 8 && T > 0 && T % 8 == 0) {                                               \
            RR_K8_SIMD(simd_fn)                                                            \
            (void)nv, (void)simd;                                                          \
            join_k8_scalar_##T_(mb, v0, o, M, T);                                          \
            return;                                                                        \
        }                                                                                  \
        const ptrdiff_t nbytes = (M * T * K + 7) / 8;                                      \
        JOIN_BODY(T_)                                                                      \
    }
RR_JOIN(join_u8, uint8_t, join_u8_k8_ssse3)
RR_JOIN(join_u16, uint16_t, join_u16_k8_ssse3)

/* Format 5 (the codec's ``hp``, 257 to 512 experts): ``n`` low bytes, then one bit per id whose
 * low byte is below ``lim``, packed in np.packbits order (an id with a larger low byte is below
 * 256) -> native uint16. ``avail``: the bytes from ``src`` on, which must be exactly those, the
 * padding bits clear; returns 0 (nothing guaranteed written) if not. No branch per id: a
 * uniform 384-expert id has its bit stored with p = 2/3, a branch would mispredict often. */
/* The checks formats 5 and 6 share: ``avail`` bytes from ``src`` are exactly ``n`` low bytes and
 * one packed bit per id whose low byte is below ``lim``, the padding bits clear. Sets ``*hi`` to
 * that count; returns 0 if not. */
static inline int high_bits_fit(const uint8_t *src, size_t n, size_t avail, unsigned lim,
                                size_t *hi) {
    if (avail < n) return 0;
    size_t h = 0;
    for (size_t i = 0; i < n; i++) h += src[i] < lim;
    *hi = h;
    if (avail != n + (h + 7) / 8) return 0;
    return !(h % 8 && src[n + h / 8] & ((1u << (8 - h % 8)) - 1));
}

static inline int join_high(const uint8_t *src, size_t n, size_t avail, unsigned lim,
                            uint16_t *dst) {
    size_t hi;
    if (!high_bits_fit(src, n, avail, lim, &hi)) return 0;
    const uint8_t *bits = src + n;
    if (!hi) {
        for (size_t i = 0; i < n; i++) dst[i] = src[i];
        return 1;
    }
    size_t j = 0;
    for (size_t i = 0; i < n; i++) {
        const unsigned v = src[i], e = v < lim;
        const size_t jj = j < hi ? j : hi - 1; /* in bounds; its bit counts only where e */
        dst[i] = (uint16_t)(v | (e & (unsigned)(bits[jj >> 3] >> (7 - (jj & 7)))) << 8);
        j += e;
    }
    return 1;
}

/* Set bits [a, b) of a mask in np.packbits order (bit i is bit 7 - i % 8 of byte i / 8). */
static inline size_t count_bits_range(const uint8_t *m, size_t a, size_t b) {
    size_t c = 0;
    for (; a < b && (a & 7); a++) c += (m[a >> 3] >> (7 - (a & 7))) & 1;
    if (b - a >= 8) {
        const size_t nb = (b - a) >> 3;
        c += count_bits(m + (a >> 3), nb);
        a += nb << 3;
    }
    for (; a < b; a++) c += (m[a >> 3] >> (7 - (a & 7))) & 1;
    return c;
}

/* Format 6 (``hp`` = 2): join_high's bits, stored grouped. The ids fall into ``nseg`` segments
 * (a layer's ids, for layer-major rows); within a segment, the bits of the ids whose low byte is
 * 0 come first, then those of low byte 1, and so on, each group in id order. A segment holds
 * ``seg_len`` ids, or, with ``mask`` (the keep transform's change bits, ``nseg`` x ``seg_len``),
 * as many as its part of the mask has bits set; the segments must hold exactly ``n``. Why
 * grouped: a router's popularity differs per expert and layer, so the high bit of a given low
 * byte in a given layer is often nearly always 0 or always 1, and zstd codes such runs in a
 * fraction of a bit each (skewed 384-expert routes: 0.32 -> ~0.2 bits per id); in id order
 * they look random.
 *
 * Per segment, a histogram of its low bytes gives each group's first bit; then each id reads
 * its group's next bit. The bits are copied first, with a zero byte after them: an id whose
 * low byte has no stored bit reads that byte's first bit and does not advance. So the loop has
 * no compare per id (a compare's flag spilled to the stack cost ~4x in the batch decoder's
 * inlined loop). Not inlined, for the same reason: its registers are its own. */
static int join_high_grouped(const uint8_t *restrict src, size_t n, size_t avail, unsigned lim,
                             const uint8_t *mask, size_t seg_len, size_t nseg,
                             uint16_t *restrict dst) {
    size_t hi;
    if (lim > 256 || !high_bits_fit(src, n, avail, lim, &hi)) return 0;
    const size_t hb = (hi + 7) / 8;
    if (hb >= ((size_t)1 << 28)) return 0; /* bit offsets are uint32 (a body holds < 2^31 ids) */
    uint8_t *bits = (uint8_t *)malloc(hb + 1);
    if (!bits) return 0;
    memcpy(bits, src + n, hb);
    bits[hb] = 0;
    uint8_t step[256];
    for (unsigned v = 0; v < 256; v++) step[v] = v < lim;
    size_t pos = 0, base = 0;
    int ok = 1;
    for (size_t s = 0; s < nseg; s++) {
        const size_t len = mask ? count_bits_range(mask, s * seg_len, (s + 1) * seg_len) : seg_len;
        if (len > n - pos) {
            ok = 0;
            break;
        }
        const uint8_t *in = src + pos;
        uint16_t *out = dst + pos;
        /* Long segments: four interleaved quarters, each with its own offsets. An id whose
         * low byte repeats soon after (a popular expert) waits on the last one's offset
         * through memory; four such chains run side by side. The remainder goes with the
         * last quarter, after it. Short ones (a 128-token store chunk's layer: ~500 ids): one
         * chain, whose setup is a quarter of the four's. */
        const size_t q = len >= 4096 ? len / 4 : 0;
        uint32_t off[4][256];
        memset(off, 0, q ? sizeof off : sizeof off[0]);
        for (size_t i = 0; i < q; i++) {
            off[0][in[i]]++;
            off[1][in[q + i]]++;
            off[2][in[2 * q + i]]++;
            off[3][in[3 * q + i]]++;
        }
        uint32_t *last = off[q ? 3 : 0];
        for (size_t i = 4 * q; i < len; i++) last[in[i]]++;
        const uint32_t zero = (uint32_t)(8 * hb); /* no stored bit: the zero byte's first bit */
        if (q) {
            for (unsigned v = 0; v < 256; v++) {
                const uint32_t c0 = off[0][v], c1 = off[1][v], c2 = off[2][v], c3 = off[3][v];
                const int e = v < lim;
                off[0][v] = e ? (uint32_t)base : zero;
                off[1][v] = e ? (uint32_t)base + c0 : zero;
                off[2][v] = e ? (uint32_t)base + c0 + c1 : zero;
                off[3][v] = e ? (uint32_t)base + c0 + c1 + c2 : zero;
                base += e ? c0 + c1 + c2 + c3 : 0;
            }
        } else {
            for (unsigned v = 0; v < lim; v++) {
                const uint32_t c = off[0][v];
                off[0][v] = (uint32_t)base;
                base += c;
            }
            for (unsigned v = lim; v < 256; v++) off[0][v] = zero;
        }
#define RR_GROUPED_ONE(t, i)                                                               \
    do {                                                                                   \
        const unsigned v = in[i];                                                          \
        const uint32_t j = off[t][v];                                                      \
        out[i] = (uint16_t)(v | ((bits[j >> 3] >> (7 - (j & 7))) & 1u) << 8);              \
        off[t][v] = j + step[v];                                                           \
    } while (0)
        for (size_t i = 0; i < q; i++) {
            RR_GROUPED_ONE(0, i);
            RR_GROUPED_ONE(1, q + i);
            RR_GROUPED_ONE(2, 2 * q + i);
            RR_GROUPED_ONE(3, 3 * q + i);
        }
        const int t_last = q ? 3 : 0;
        for (size_t i = 4 * q; i < len; i++) RR_GROUPED_ONE(t_last, i);
#undef RR_GROUPED_ONE
        pos += len;
    }
    free(bits);
    return ok && pos == n;
}

/* The five base-3 digits of b (< 243), most significant first, shifted to bits 7 and 8
 * (divisions by constants: multiplies). */
static inline void trits5(unsigned b, uint16_t t[5]) {
    const unsigned d0 = b / 81, r0 = b - 81 * d0, d1 = r0 / 27, r1 = r0 - 27 * d1;
    const unsigned d2 = r1 / 9, r2 = r1 - 9 * d2, d3 = r2 / 3, d4 = r2 - 3 * d3;
    t[0] = (uint16_t)(d0 << 7), t[1] = (uint16_t)(d1 << 7), t[2] = (uint16_t)(d2 << 7);
    t[3] = (uint16_t)(d3 << 7), t[4] = (uint16_t)(d4 << 7);
}

/* Format 6 (``hp`` = 3, 257 to 384 experts): ``n`` bytes of each id's low 7 bits, then its
 * bits 7 and 8 as a base-3 digit (0 to 2), five to a byte, most significant first
 * (81 d0 + 27 d1 + 9 d2 + 3 d3 + d4), the last byte's unused digits 0 -> native uint16.
 * Why: uniform 384-expert ids are 8.58 bits of information; a byte plane plus a bit (formats 5
 * and 6's hp 1) stores 8.67, which no Huffman code of the low bytes improves, while 7 bits plus
 * 1.6 is 8.6. ``avail`` must be exactly those bytes, every low byte below 128 and every digit
 * byte below 243; returns 0 (nothing guaranteed written) if not. */
static int join_trits(const uint8_t *restrict src, size_t n, size_t avail,
                      uint16_t *restrict dst) {
    const size_t nb = (n + 4) / 5;
    if (avail != n + nb) return 0;
    unsigned bad = 0;
    for (size_t i = 0; i < n; i++) bad |= src[i];
    if (bad & 0x80) return 0;
    const uint8_t *d = src + n;
    for (size_t j = 0; j < nb; j++)
        if (d[j] >= 243) return 0;
    size_t i = 0, j = 0;
    uint16_t t[5];
    for (; i + 5 <= n; i += 5, j++) {
        trits5(d[j], t);
        for (int k = 0; k < 5; k++) dst[i + k] = (uint16_t)(src[i + k] | t[k]);
    }
    if (i < n) {
        trits5(d[j], t);
        for (size_t k = n - i; k < 5; k++)
            if (t[k]) return 0; /* a digit past the last id */
        for (size_t k = 0; i + k < n; k++) dst[i + k] = (uint16_t)(src[i + k] | t[k]);
    }
    return 1;
}

#endif
