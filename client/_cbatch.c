/* Batch decode of store chunks with the GIL released (routereplay.client._layout).
 *
 * Why: a training step reads ~1500 chunks. Decoding one in Python holds the GIL for ~23 us
 * here (~60 us on a 16-core trainer host) between the parts that release it (zstd, blake3),
 * so decode threads could not scale: on a 16-core host a step's read was flat at 0.23 s from
 * 2 to 16 threads (docs/trainer.md). This module does a whole batch of chunks (frame, payload,
 * zstd, row transform, token chain, content address, largest id) in one call that holds the GIL
 * only to collect its inputs and to hand back its outputs.
 *
 * Exactness: it takes only the chunks it fully understands (format 4: rows-first blake3
 * address, a chain, known fields of known types) and checks each against its content address
 * before accepting it. Anything else, a corrupted chunk included, comes back as None and is
 * decoded by the Python path (_layout.decode_chunk), which names the problem, so this module
 * never has to name an error itself. It returns only rows that match their chunk's address;
 * the one case the Python path refuses and it takes: damage inside a compressed body that the
 * system's libzstd decodes to the original bytes where python-zstandard's zstd calls it
 * corrupted (docs/storage.md).
 *
 * Optional, like _ckernel: the package builds without it. zstd comes from the system's
 * libzstd, loaded at the first call (no build-time headers needed); where it cannot be loaded
 * the call says so and the store decodes in Python. blake3 and blake2b are the reference C
 * implementations (client/_vendor, public domain / CC0).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_kernels.h"
#include "_vendor/blake2/blake2.h"
#include "_vendor/blake3/blake3.h"

/* ------------------------------------------------------------------------------------------
 * libzstd, loaded at run time: the stable one-shot API (zstd.h, ZSTDLIB_API since 1.0)
 * ---------------------------------------------------------------------------------------- */
typedef struct ZSTD_DCtx_s ZSTD_DCtx;
static ZSTD_DCtx *(*zstd_create)(void);
static size_t (*zstd_free)(ZSTD_DCtx *);
static size_t (*zstd_decompress)(ZSTD_DCtx *, void *, size_t, const void *, size_t);
static unsigned (*zstd_is_error)(size_t);
static unsigned long long (*zstd_content_size)(const void *, size_t);
static size_t (*zstd_frame_size)(const void *, size_t);
static const char *zstd_problem = NULL; /* why it could not be loaded, once tried */
static int zstd_tried = 0;

/* Called with the GIL held: the GIL serialises the first load. */
static int load_zstd(void) {
    if (zstd_tried) return zstd_problem == NULL;
    zstd_tried = 1;
    void *h = dlopen("libzstd.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) h = dlopen("libzstd.so", RTLD_NOW | RTLD_LOCAL);
    if (!h) h = dlopen("libzstd.dylib", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        zstd_problem = "libzstd (libzstd.so.1) could not be loaded";
        return 0;
    }
#define SYM(var, name)                                                                     \
    *(void **)(&var) = dlsym(h, name);                                                     \
    if (!var) {                                                                            \
        zstd_problem = "libzstd lacks " name;                                              \
        return 0;                                                                          \
    }
    SYM(zstd_create, "ZSTD_createDCtx")
    SYM(zstd_free, "ZSTD_freeDCtx")
    SYM(zstd_decompress, "ZSTD_decompressDCtx")
    SYM(zstd_is_error, "ZSTD_isError")
    SYM(zstd_content_size, "ZSTD_getFrameContentSize")
    SYM(zstd_frame_size, "ZSTD_findFrameCompressedSize")
#undef SYM
    return 1;
}

/* ------------------------------------------------------------------------------------------
 * one chunk
 * ---------------------------------------------------------------------------------------- */
enum { XF_PLAIN = 0, XF_DELTA = 1, XF_GAPS = 2, XF_KEEP = 3, XF_TOKENS = 4 };
enum { KIND_CHUNK = 2, MAX_VERSION = 6, HASH_BLAKE3_ROWS = 3, DIGEST = 16, HEADER = 16 };
/* Larger shapes are left to the Python path, so that no size below can overflow. */
#define MAX_DIM ((uint64_t)1 << 31)
#define MAX_ROWS ((uint64_t)1 << 40)

typedef struct {
    const uint8_t *blob, *digest;
    size_t len, dlen;
    /* payload fields */
    uint64_t T, M, K, E, xf, raw, ha, hp; /* hp: high bits (1: format 5; 2, 3: format 6) */
    int canon;
    const uint8_t *body, *pc;
    size_t body_len, pc_len;
    /* decode */
    int ok;
    int inplace;      /* plain uint8 rows: decompressed straight into their bytes object */
    size_t isz, n;    /* id width in bytes; ids M * T * K */
    size_t tok_off;   /* into the call's token and validity outputs */
    uint8_t *out;     /* the rows' bytes object's buffer */
    size_t row_off;   /* where the rows start in it */
    int64_t max_id;
    uint8_t chain[DIGEST];
} chunk_t;

typedef struct {
    const uint8_t *p, *end;
} rd_t;

static int rd_uint(rd_t *r, uint64_t *v) {
    if (r->p >= r->end) return -1;
    const uint8_t c = *r->p++;
    if (c <= 0x7f) {
        *v = c;
        return 0;
    }
    const int n = c == 0xcc ? 1 : c == 0xcd ? 2 : c == 0xce ? 4 : c == 0xcf ? 8 : 0;
    if (!n || r->end - r->p < n) return -1;
    uint64_t x = 0;
    for (int i = 0; i < n; i++) x = x << 8 | r->p[i];
    r->p += n;
    *v = x;
    return 0;
}

static int rd_bin(rd_t *r, const uint8_t **b, size_t *len) {
    if (r->p >= r->end) return -1;
    const uint8_t c = *r->p++;
    const int n = c == 0xc4 ? 1 : c == 0xc5 ? 2 : c == 0xc6 ? 4 : 0;
    if (!n || r->end - r->p < n) return -1;
    size_t x = 0;
    for (int i = 0; i < n; i++) x = x << 8 | r->p[i];
    r->p += n;
    if ((size_t)(r->end - r->p) < x) return -1;
    *b = r->p;
    *len = x;
    r->p += x;
    return 0;
}

static int key_is(const uint8_t *k, size_t n, const char *name) {
    return strlen(name) == n && memcmp(k, name, n) == 0;
}

/* Frame and payload fields; 0 if the chunk is for the Python path. */
static int parse(chunk_t *c) {
    const uint8_t *b = c->blob;
    if (c->len < HEADER || memcmp(b, "RRTE", 4) != 0 || b[4] < 1 || b[4] > MAX_VERSION ||
        b[5] != KIND_CHUNK || c->dlen != DIGEST)
        return 0;
    const uint64_t plen = (uint64_t)b[8] | (uint64_t)b[9] << 8 | (uint64_t)b[10] << 16 |
                          (uint64_t)b[11] << 24;
    if (HEADER + plen != c->len) return 0;
    rd_t r = {b + HEADER, b + c->len};
    uint64_t entries;
    if (r.p >= r.end) return 0;
    const uint8_t m = *r.p;
    if (m >= 0x80 && m <= 0x8f) {
        entries = m & 0x0f;
        r.p++;
    } else if (m == 0xde && r.end - r.p >= 3) {
        entries = (uint64_t)r.p[1] << 8 | r.p[2];
        r.p += 3;
    } else {
        return 0;
    }
    unsigned seen = 0; /* T M K E xf raw body pc ha */
    c->canon = 0;
    c->hp = 0;
    for (uint64_t e = 0; e < entries; e++) {
        if (r.p >= r.end || (*r.p & 0xe0) != 0xa0) return 0; /* fixstr keys only */
        const size_t kl = *r.p & 0x1f;
        const uint8_t *k = r.p + 1;
        if ((size_t)(r.end - k) < kl) return 0;
        r.p = k + kl;
        uint64_t *dst = NULL;
        unsigned bit = 0;
        if (key_is(k, kl, "T")) dst = &c->T, bit = 1;
        else if (key_is(k, kl, "M")) dst = &c->M, bit = 2;
        else if (key_is(k, kl, "K")) dst = &c->K, bit = 4;
        else if (key_is(k, kl, "E")) dst = &c->E, bit = 8;
        else if (key_is(k, kl, "xf")) dst = &c->xf, bit = 16;
        else if (key_is(k, kl, "raw")) dst = &c->raw, bit = 32;
        else if (key_is(k, kl, "ha")) dst = &c->ha, bit = 256;
        else if (key_is(k, kl, "hp")) dst = &c->hp, bit = 0; /* optional */
        if (dst) {
            if (rd_uint(&r, dst)) return 0;
            seen |= bit;
        } else if (key_is(k, kl, "body")) {
            if (rd_bin(&r, &c->body, &c->body_len)) return 0;
            seen |= 64;
        } else if (key_is(k, kl, "pc")) {
            if (rd_bin(&r, &c->pc, &c->pc_len)) return 0;
            seen |= 128;
        } else if (key_is(k, kl, "canon")) {
            if (r.p >= r.end || (*r.p != 0xc2 && *r.p != 0xc3)) return 0;
            c->canon = *r.p++ == 0xc3;
        } else {
            return 0; /* a field this decoder does not know */
        }
    }
    if (r.p != r.end || seen != 511 || c->ha != HASH_BLAKE3_ROWS || c->xf > XF_TOKENS)
        return 0;
    if (c->T >= MAX_DIM || c->M >= MAX_DIM || c->K >= MAX_DIM || c->E < 1 || c->E > 65536)
        return 0;
    if (c->M * c->K != 0 && c->T > MAX_ROWS / (c->M * c->K)) return 0;
    c->isz = c->E <= 256 ? 1 : 2;
    c->n = (size_t)(c->T * c->M * c->K);
    /* Packed high bits: only for 257 to 512 experts and transforms whose values are the ids
     * (_codec._high_bit_limit); their exact size is known once the low bytes are (decode). */
    if (c->hp > 3 || (c->hp && (c->E <= 256 || c->E > 512 || c->xf == XF_DELTA ||
                                c->xf == XF_GAPS)) || (c->hp == 3 && c->E > 384))
        return 0;
    const uint64_t head = 4 * c->T + (c->T + 7) / 8;
    /* the high bits' most bytes (hp 3: base-3 digits, five to a byte) */
    const uint64_t hi_max = c->hp == 3 ? (c->n + 4) / 5 : c->hp ? (c->n + 7) / 8 : 0;
    if (c->xf == XF_KEEP) {
        const uint64_t most = c->hp ? c->n + hi_max : c->n * c->isz;
        if (c->raw < head + (c->n + 7) / 8 || c->raw > head + (c->n + 7) / 8 + most) return 0;
    } else if (c->hp) {
        if (c->raw < head + c->n || c->raw > head + c->n + hi_max) return 0;
    } else if (c->raw != head + c->n * c->isz) {
        return 0;
    }
    /* One zstd frame that is the whole body and says it holds exactly ``raw`` bytes: checked
     * before anything is allocated for the chunk (the frame header and block headers only).
     * No frame decompresses to more than 32768x its size (_codec._MAX_ZSTD_RATIO). */
    if (c->raw > 32768 * (uint64_t)c->body_len) return 0;
    if (zstd_content_size(c->body, c->body_len) != c->raw) return 0;
    const size_t fs = zstd_frame_size(c->body, c->body_len);
    return !zstd_is_error(fs) && fs == c->body_len;
}

/* Low bytes then high bytes (the codec's planes) -> native uint16. */
static void join_planes(const uint8_t *src, size_t n, uint16_t *dst) {
    for (size_t i = 0; i < n; i++) dst[i] = (uint16_t)(src[i] | src[n + i] << 8);
}

#define ROWS_LOOPS(T_)                                                                     \
    static void delta_##T_(T_ *o, size_t M, size_t T, size_t K) {                          \
        for (size_t m = 0; m < M; m++)                                                     \
            for (size_t t = 1; t < T; t++) {                                               \
                T_ *row = o + (m * T + t) * K;                                             \
                for (size_t k = 0; k < K; k++) row[k] = (T_)(row[k] + row[k - K]);         \
            }                                                                              \
    }                                                                                      \
    static void ungaps_##T_(T_ *o, size_t rows, size_t K) {                                \
        for (size_t r = 0; r < rows; r++)                                                  \
            for (size_t k = 1; k < K; k++) o[r * K + k] = (T_)(o[r * K + k] + o[r * K + k - 1] + 1); \
    }                                                                                      \
    static void tokens_##T_(const T_ *in, T_ *o, size_t M, size_t T, size_t K) {           \
        for (size_t t = 0; t < T; t++)                                                     \
            for (size_t m = 0; m < M; m++)                                                 \
                memcpy(o + (m * T + t) * K, in + (t * M + m) * K, K * sizeof(T_));         \
    }                                                                                      \
    static int64_t max_##T_(const T_ *o, size_t n) {                                       \
        T_ hi = 0;                                                                         \
        for (size_t i = 0; i < n; i++) hi = o[i] > hi ? o[i] : hi;                         \
        return n ? (int64_t)hi : -1;                                                       \
    }
ROWS_LOOPS(uint8_t)
ROWS_LOOPS(uint16_t)

/* The chunk's rows into c->out + c->row_off (layer-major [M, T, K]), its tokens and validity
 * into the call's outputs, then its content address checked; 0 if anything disagrees. ``raw``
 * is the decompressed body (c->raw bytes), ``scratch`` room for c->n ids. */
static int decode(chunk_t *c, const uint8_t *raw, uint16_t *scratch, int64_t *tok, uint8_t *valid) {
    const size_t T = c->T, M = c->M, K = c->K, n = c->n, vb = (T + 7) / 8;
    const uint8_t *rows = raw + 4 * T + vb;
    uint8_t *out = c->out + c->row_off;
    const size_t rows_len = c->raw - (4 * T + vb);
    const unsigned lim = c->hp ? (unsigned)(c->E - 256) : 0;
    if (c->xf == XF_KEEP) {
        const size_t mb = (n + 7) / 8;
        const size_t ones = count_bits(rows, mb);
        if (n % 8 && rows[mb - 1] & ((1u << (8 - n % 8)) - 1)) return 0; /* bits past the end */
        if (!c->hp && c->raw != 4 * T + vb + mb + ones * c->isz) return 0;
        for (size_t s = 0; s < M * K && T; s++)
            if (!((rows[(s * T) >> 3] >> (7 - ((s * T) & 7))) & 1)) return 0;
        if (!n) {
        } else if (c->isz == 1) {
            join_u8(rows, rows + mb, ones, out, M, T, K, 1);
        } else {
            if (!c->hp) join_planes(rows + mb, ones, scratch);
            else if (c->hp == 1 && !join_high(rows + mb, ones, rows_len - mb, lim, scratch))
                return 0;
            else if (c->hp == 2 &&
                     !join_high_grouped(rows + mb, ones, rows_len - mb, lim, rows, T * K, M, scratch))
                return 0;
            else if (c->hp == 3 && !join_trits(rows + mb, ones, rows_len - mb, scratch)) return 0;
            join_u16(rows, scratch, ones, (uint16_t *)out, M, T, K, 1);
        }
    } else if (c->xf == XF_TOKENS) {
        if (c->isz == 1) {
            tokens_uint8_t(rows, out, M, T, K);
        } else {
            if (!c->hp) join_planes(rows, n, scratch);
            else if (c->hp == 1 && !join_high(rows, n, rows_len, lim, scratch)) return 0;
            else if (c->hp == 2 && !join_high_grouped(rows, n, rows_len, lim, NULL, n, 1, scratch))
                return 0; /* the tokens order interleaves the layers: one group */
            else if (c->hp == 3 && !join_trits(rows, n, rows_len, scratch)) return 0;
            tokens_uint16_t(scratch, (uint16_t *)out, M, T, K);
        }
    } else if (c->isz == 2) {
        uint16_t *o16 = (uint16_t *)out;
        if (!c->hp) join_planes(rows, n, o16);
        else if (c->hp == 1 && !join_high(rows, n, rows_len, lim, o16)) return 0;
        else if (c->hp == 2 && !join_high_grouped(rows, n, rows_len, lim, NULL, T * K, M, o16))
            return 0;
        else if (c->hp == 3 && !join_trits(rows, n, rows_len, o16)) return 0;
    } else if (out != rows) {
        memcpy(out, rows, n);
    }
    if (c->xf == XF_DELTA) {
        if (c->isz == 1) delta_uint8_t(out, M, T, K);
        else delta_uint16_t((uint16_t *)out, M, T, K);
    } else if (c->xf == XF_GAPS) {
        if (c->isz == 1) ungaps_uint8_t(out, M * T, K);
        else ungaps_uint16_t((uint16_t *)out, M * T, K);
    }
    /* Tokens: uint32 LE -> int64; validity: packbits order -> one 0/1 byte per token. */
    for (size_t t = 0; t < T; t++)
        tok[t] = (int64_t)((uint32_t)raw[4 * t] | (uint32_t)raw[4 * t + 1] << 8 |
                           (uint32_t)raw[4 * t + 2] << 16 | (uint32_t)raw[4 * t + 3] << 24);
    const uint8_t *vbits = raw + 4 * T;
    uint8_t packed[64]; /* the validity re-packed with its padding cleared, as np.packbits */
    blake3_hasher h;
    blake3_hasher_init(&h);
    blake3_hasher_update(&h, out, n * c->isz);
    /* chain = blake2b-128(previous chain | token ids as uint32 LE), _layout._next_chain */
    blake2b_state b2;
    if (blake2b_init(&b2, DIGEST) || blake2b_update(&b2, c->pc, c->pc_len) ||
        blake2b_update(&b2, raw, 4 * T) || blake2b_final(&b2, c->chain, DIGEST))
        return 0;
    blake3_hasher_update(&h, c->chain, DIGEST);
    for (size_t t = 0; t < T; t++) valid[t] = (vbits[t >> 3] >> (7 - (t & 7))) & 1;
    for (size_t b = 0; b < vb; b += sizeof packed) {
        const size_t w = vb - b < sizeof packed ? vb - b : sizeof packed;
        memcpy(packed, vbits + b, w);
        if (b + w == vb && T % 8) packed[w - 1] &= (uint8_t)(0xFF00u >> (T % 8));
        blake3_hasher_update(&h, packed, w);
    }
    uint8_t digest[DIGEST];
    blake3_hasher_finalize(&h, digest, DIGEST);
    if (memcmp(digest, c->digest, DIGEST) != 0) return 0;
    c->max_id = c->isz == 1 ? max_uint8_t(out, n) : max_uint16_t((const uint16_t *)out, n);
    return 1;
}

/* ------------------------------------------------------------------------------------------
 * decode_chunks(digests, blobs) -> (tokens, valid, results)
 * ---------------------------------------------------------------------------------------- */
static PyObject *decode_chunks(PyObject *self, PyObject *args) {
    PyObject *digests_in, *blobs_in;
    if (!PyArg_ParseTuple(args, "OO", &digests_in, &blobs_in)) return NULL;
    if (!load_zstd()) {
        PyErr_SetString(PyExc_OSError, zstd_problem);
        return NULL;
    }
    /* Tuples: they hold the bytes objects whose buffers are read without the GIL, and no other
     * thread can take one out of them meanwhile (as it could from a list). */
    PyObject *ds = PySequence_Tuple(digests_in);
    if (!ds) return NULL;
    PyObject *bs = PySequence_Tuple(blobs_in);
    if (!bs) {
        Py_DECREF(ds);
        return NULL;
    }
    PyObject *result = NULL, *tokens = NULL, *valid = NULL, *results = NULL;
    PyObject **row_objs = NULL;
    const Py_ssize_t n = PyTuple_GET_SIZE(bs);
    chunk_t *cs = NULL;
    if (PyTuple_GET_SIZE(ds) != n) {
        PyErr_SetString(PyExc_ValueError, "decode_chunks: as many digests as blobs");
        goto done;
    }
    cs = PyMem_Calloc(n ? n : 1, sizeof *cs);
    row_objs = PyMem_Calloc(n ? n : 1, sizeof *row_objs);
    if (!cs || !row_objs) {
        PyErr_NoMemory();
        goto done;
    }
    /* 1. inputs (GIL): bytes objects only; the sequences keep them alive */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *d = PyTuple_GET_ITEM(ds, i), *b = PyTuple_GET_ITEM(bs, i);
        if (PyBytes_Check(d) && PyBytes_Check(b)) {
            cs[i].digest = (const uint8_t *)PyBytes_AS_STRING(d);
            cs[i].dlen = PyBytes_GET_SIZE(d);
            cs[i].blob = (const uint8_t *)PyBytes_AS_STRING(b);
            cs[i].len = PyBytes_GET_SIZE(b);
            cs[i].ok = 1;
        }
    }
    /* 2. fields (no GIL) */
    size_t ntok = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        chunk_t *c = &cs[i];
        if (!c->ok || !(c->ok = parse(c))) continue;
        c->tok_off = ntok;
        ntok += c->T;
    }
    Py_END_ALLOW_THREADS
    /* 3. outputs (GIL). Each chunk's rows get a bytes object of their own: a step's ~1500
     * chunks of ~50 KB each are recycled by malloc from one step to the next, where one
     * buffer of a whole batch would be fresh pages to fault in every time (a whole read in
     * one buffer was slower with python-zstandard's batch API: docs/trainer.md).
     * A plain uint8 chunk is decompressed straight into its object (rows after the tokens). */
    /* Sizes come from the chunks: one that claims more than can be allocated goes to the
     * Python path (which names it) rather than failing the batch. */
    tokens = PyBytes_FromStringAndSize(NULL, ntok * sizeof(int64_t));
    valid = PyBytes_FromStringAndSize(NULL, ntok);
    if (!tokens || !valid) {
        PyErr_Clear();
        Py_CLEAR(tokens);
        Py_CLEAR(valid);
        for (Py_ssize_t i = 0; i < n; i++) cs[i].ok = 0;
        if (!(tokens = PyBytes_FromStringAndSize(NULL, 0)) ||
            !(valid = PyBytes_FromStringAndSize(NULL, 0)))
            goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        chunk_t *c = &cs[i];
        if (!c->ok) continue;
        c->inplace = c->xf != XF_KEEP && c->xf != XF_TOKENS && c->isz == 1;
        const size_t size = c->inplace ? c->raw : c->n * c->isz;
        if (!(row_objs[i] = PyBytes_FromStringAndSize(NULL, size))) {
            PyErr_Clear();
            c->ok = 0;
            continue;
        }
        c->out = (uint8_t *)PyBytes_AS_STRING(row_objs[i]);
        c->row_off = c->inplace ? c->raw - c->n : 0;
    }
    /* 4. decode and check (no GIL) */
    {
        int64_t *tok = (int64_t *)PyBytes_AS_STRING(tokens);
        uint8_t *val = (uint8_t *)PyBytes_AS_STRING(valid);
        Py_BEGIN_ALLOW_THREADS
        /* Scratch for the decompressed body (all but in-place chunks) and for uint16 ids
         * before they are reordered, grown to the largest chunk that needs it. */
        uint8_t *raw = NULL;
        uint16_t *scratch = NULL;
        size_t raw_cap = 0, scratch_cap = 0;
        ZSTD_DCtx *z = zstd_create();
        for (Py_ssize_t i = 0; i < n; i++) {
            chunk_t *c = &cs[i];
            if (!c->ok) continue;
            c->ok = 0;
            if (!z) continue;
            if (!c->inplace && c->raw > raw_cap) {
                uint8_t *r = realloc(raw, c->raw);
                if (!r) continue;
                raw = r, raw_cap = c->raw;
            }
            if (c->isz == 2 && c->n > scratch_cap) {
                uint16_t *q = realloc(scratch, c->n * sizeof(uint16_t));
                if (!q) continue;
                scratch = q, scratch_cap = c->n;
            }
            uint8_t *dst = c->inplace ? c->out : raw;
            const size_t got = zstd_decompress(z, dst, c->raw, c->body, c->body_len);
            if (zstd_is_error(got) || got != c->raw) continue;
            c->ok = decode(c, dst, scratch, tok + c->tok_off, val + c->tok_off);
        }
        if (z) zstd_free(z);
        free(raw);
        free(scratch);
        Py_END_ALLOW_THREADS
    }
    /* 5. results (GIL): per chunk None (the Python path's) or
     * (rows bytes, row offset, T, M, K, itemsize, canon, max id, prev chain, chain, token offset) */
    if (!(results = PyList_New(n))) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        chunk_t *c = &cs[i];
        PyObject *item;
        if (!c->ok) {
            item = Py_NewRef(Py_None);
        } else {
            item = Py_BuildValue("(OnnnnnOny#y#n)", row_objs[i], (Py_ssize_t)c->row_off,
                                 (Py_ssize_t)c->T, (Py_ssize_t)c->M, (Py_ssize_t)c->K,
                                 (Py_ssize_t)c->isz, c->canon ? Py_True : Py_False,
                                 (Py_ssize_t)c->max_id, c->pc, (Py_ssize_t)c->pc_len, c->chain,
                                 (Py_ssize_t)DIGEST, (Py_ssize_t)c->tok_off);
            if (!item) goto done;
        }
        PyList_SET_ITEM(results, i, item);
    }
    result = PyTuple_Pack(3, tokens, valid, results);
done:
    if (row_objs)
        for (Py_ssize_t i = 0; i < n; i++) Py_XDECREF(row_objs[i]);
    PyMem_Free(row_objs);
    PyMem_Free(cs);
    Py_XDECREF(tokens);
    Py_XDECREF(valid);
    Py_XDECREF(results);
    Py_DECREF(ds);
    Py_DECREF(bs);
    return result;
}

/* available() -> str | None: None when decode_chunks can run, else why not. */
static PyObject *available(PyObject *self, PyObject *noargs) {
    if (load_zstd()) Py_RETURN_NONE;
    return PyUnicode_FromString(zstd_problem);
}

static PyMethodDef methods[] = {
    {"decode_chunks", decode_chunks, METH_VARARGS,
     "decode_chunks(digests, blobs) -> (tokens, valid, results): see client/_cbatch.c."},
    {"available", available, METH_NOARGS, "None if decode_chunks can run, else why not."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_cbatch", "Batch decode of store chunks without the GIL.", -1, methods,
};

PyMODINIT_FUNC PyInit__cbatch(void) { return PyModule_Create(&module); }
