/* Compiled inner loops of the route codec (routereplay.client._codec).
 *
 * Optional: the package builds without it (setuptools marks the extension optional) and the
 * codec then runs its numpy equivalents, which give the same bytes. Why compiled at all: the
 * ``keep`` decode is a running "last changed id" per stream, which numpy can only express as a
 * prefix count plus a gather (~2.5 ns per id, bench store); one pass here is ~0.5 ns per id.
 *
 * Every function checks its buffer sizes and returns an error naming the problem rather than
 * reading or writing out of bounds: the inputs come from stored blobs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "_kernels.h"


/* keep_join(mask, values, out, M, T, K, itemsize, simd=True) -> None
 *
 * mask:   change bits in np.packbits order (most significant bit first), streams [M, K, T]
 *         flattened: bit i is token t of slot k of layer m, i = (m * K + k) * T + t.
 * values: the changed ids, in stream order, itemsize bytes each (1 or 2, native order).
 * out:    writable [M, T, K] ids, itemsize bytes each.
 *
 * Token t of a stream takes the id of the last set bit at or before t. Errors: a stream whose
 * first bit is clear (it would inherit another stream's id), a count of set bits other than
 * the number of values, wrong buffer sizes. ``simd`` False: the portable loops only (for the
 * tests, which compare the two).
 */
static PyObject *keep_join(PyObject *self, PyObject *args) {
    Py_buffer mask, values, out;
    Py_ssize_t M, T, K, itemsize;
    int simd = 1;
    if (!PyArg_ParseTuple(args, "y*y*w*nnnn|p", &mask, &values, &out, &M, &T, &K, &itemsize,
                          &simd))
        return NULL;
    const char *err = NULL;
    Py_ssize_t n = 0, nv = 0;
    if (M < 0 || T < 0 || K < 0 || (itemsize != 1 && itemsize != 2)) {
        err = "keep_join: bad shape or itemsize";
        goto done;
    }
    n = M * T * K;
    if (T && K && n / T / K != M) {
        err = "keep_join: shape overflows";
        goto done;
    }
    nv = values.len / itemsize;
    if (mask.len != (n + 7) / 8 || values.len % itemsize || out.len != n * itemsize) {
        err = "keep_join: buffer sizes do not match the shape";
        goto done;
    }
    {
        const uint8_t *mb = (const uint8_t *)mask.buf;
        Py_BEGIN_ALLOW_THREADS
        /* Checked first, so that the loop below needs no branch per id (on routes where half
         * the slots change, a branch per id mispredicts half the time: ~8x slower): the set
         * bits count exactly the values, and every stream's first bit is set. Then the id at
         * token t is values[rank(t) - 1], rank counting the set bits of the stream's layer
         * stack up to and including t, always within 0 .. nv - 1. */
        Py_ssize_t ones = (Py_ssize_t)count_bits(mb, (size_t)(n / 8));
        if (n % 8) ones += pop64(mb[n / 8] & (0xFF00u >> (n % 8)));
        if (ones != nv) err = "keep_join: the change bits do not count the ids";
        for (Py_ssize_t s = 0; s < M * K && T && !err; s++)
            if (!((mb[(s * T) >> 3] >> (7 - ((s * T) & 7))) & 1))
                err = "keep_join: a stream starts without its first id";
        if (!err && itemsize == 1)
            join_u8(mb, (const uint8_t *)values.buf, (size_t)nv, (uint8_t *)out.buf, M, T, K,
                    simd);
        else if (!err)
            join_u16(mb, (const uint16_t *)values.buf, (size_t)nv, (uint16_t *)out.buf, M, T,
                     K, simd);
        Py_END_ALLOW_THREADS
    }
done:
    PyBuffer_Release(&mask);
    PyBuffer_Release(&values);
    PyBuffer_Release(&out);
    if (err) {
        PyErr_SetString(PyExc_ValueError, err);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* join_high(data, out, limit) -> None
 *
 * Format 5's ids (257 to 512 experts): ``data`` holds len(out) low bytes, then one packed bit
 * per id whose low byte is below ``limit`` (the high bit); ``out`` writable uint16. ValueError
 * when the sizes or the padding bits disagree (the codec checks them first and names them).
 */
static PyObject *join_high_py(PyObject *self, PyObject *args) {
    Py_buffer data, out;
    Py_ssize_t limit;
    if (!PyArg_ParseTuple(args, "y*w*n", &data, &out, &limit)) return NULL;
    int ok = 0;
    if (out.len % 2 == 0 && limit >= 0 && limit <= 256) {
        Py_BEGIN_ALLOW_THREADS
        ok = join_high((const uint8_t *)data.buf, (size_t)out.len / 2, (size_t)data.len,
                       (unsigned)limit, (uint16_t *)out.buf);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&data);
    PyBuffer_Release(&out);
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "join_high: the high bits do not match the low bytes");
        return NULL;
    }
    Py_RETURN_NONE;
}

/* join_high_grouped(data, out, limit, mask, seg_len, nseg) -> None
 *
 * Format 6 (_kernels.h join_high_grouped): join_high with the bits grouped by low byte within
 * each of ``nseg`` segments of ``seg_len`` ids, or, with ``mask`` (the keep transform's change
 * bits; None otherwise), of as many ids as that segment's part of the mask has bits set.
 */
static PyObject *join_high_grouped_py(PyObject *self, PyObject *args) {
    Py_buffer data, out, mask;
    Py_ssize_t limit, seg_len, nseg;
    if (!PyArg_ParseTuple(args, "y*w*nz*nn", &data, &out, &limit, &mask, &seg_len, &nseg))
        return NULL;
    int ok = 0;
    /* The segments must cover the ids (or lie within the mask): sizes checked before the
     * kernel walks them, without overflow. */
    const Py_ssize_t n = out.len / 2;
    int sizes = seg_len >= 0 && nseg >= 0;
    if (sizes && nseg && mask.buf) sizes = seg_len <= mask.len * 8 / nseg;
    else if (sizes && nseg) sizes = seg_len <= n / nseg && seg_len * nseg == n;
    else if (sizes) sizes = mask.buf || n == 0;
    if (out.len % 2 == 0 && limit >= 0 && limit <= 256 && sizes) {
        Py_BEGIN_ALLOW_THREADS
        ok = join_high_grouped((const uint8_t *)data.buf, (size_t)out.len / 2, (size_t)data.len,
                               (unsigned)limit, (const uint8_t *)mask.buf, (size_t)seg_len,
                               (size_t)nseg, (uint16_t *)out.buf);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&data);
    PyBuffer_Release(&out);
    PyBuffer_Release(&mask);
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "join_high: the high bits do not match the low bytes");
        return NULL;
    }
    Py_RETURN_NONE;
}

/* join_trits(data, out) -> None
 *
 * Format 6's ``hp`` = 3 (_kernels.h join_trits): low 7-bit bytes, then base-3 digits five to
 * a byte -> uint16 ids. ValueError when the sizes, a low byte or a digit byte is out of range.
 */
static PyObject *join_trits_py(PyObject *self, PyObject *args) {
    Py_buffer data, out;
    if (!PyArg_ParseTuple(args, "y*w*", &data, &out)) return NULL;
    int ok = 0;
    if (out.len % 2 == 0) {
        Py_BEGIN_ALLOW_THREADS
        ok = join_trits((const uint8_t *)data.buf, (size_t)out.len / 2, (size_t)data.len,
                        (uint16_t *)out.buf);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&data);
    PyBuffer_Release(&out);
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "join_trits: the digits do not match the low bytes");
        return NULL;
    }
    Py_RETURN_NONE;
}

/* hist_u8(data, counts) -> None
 *
 * counts: writable 256 int64, set to the number of each byte value in data. The encoder's
 * entropy estimates (one per candidate row transform and block) histogram every byte they
 * weigh, and numpy's bincount first widens each byte to an int64 (8x the bytes): it was half
 * of a store chunk's encode. Four interleaved tables, so equal neighbouring bytes do not wait
 * on each other's increments.
 */
static PyObject *hist_u8(PyObject *self, PyObject *args) {
    Py_buffer data, counts;
    if (!PyArg_ParseTuple(args, "y*w*", &data, &counts)) return NULL;
    if (counts.len != 256 * (Py_ssize_t)sizeof(int64_t)) {
        PyBuffer_Release(&data);
        PyBuffer_Release(&counts);
        PyErr_SetString(PyExc_ValueError, "hist_u8: counts must be 256 int64");
        return NULL;
    }
    {
        const uint8_t *b = (const uint8_t *)data.buf;
        const Py_ssize_t n = data.len;
        int64_t *out = (int64_t *)counts.buf;
        Py_BEGIN_ALLOW_THREADS
        int64_t h[4][256];
        memset(h, 0, sizeof h);
        Py_ssize_t i = 0;
        for (; i + 4 <= n; i += 4) {
            h[0][b[i]]++;
            h[1][b[i + 1]]++;
            h[2][b[i + 2]]++;
            h[3][b[i + 3]]++;
        }
        for (; i < n; i++) h[0][b[i]]++;
        for (int v = 0; v < 256; v++) out[v] = h[0][v] + h[1][v] + h[2][v] + h[3][v];
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&data);
    PyBuffer_Release(&counts);
    Py_RETURN_NONE;
}

/* copy_runs(out, jobs, N, K, itemsize) -> list of skipped job indices
 *
 * out:  writable C-contiguous ids [M_out, N, K], ``itemsize`` bytes each.
 * jobs: (src, c0, n, x, y, o, s) tuples: copy src[c0 : c0 + n, x : y, :] to
 *       out[o : o + n, s : s + y - x, :]. ``src`` is one array, or a tuple of arrays that hold a
 *       record's rows one after another from row 0 (its chunks: RouteRecord.layer_major_parts),
 *       x : y then being rows of the record, cut here at the parts' bounds. A job whose source
 *       (or any part of it that the rows touch) has a layer's rows not contiguous
 *       (strides[2] != itemsize or strides[1] != K * itemsize: a record's token-major rows) or
 *       holds other ids is skipped: its index is returned for the caller to copy.
 *
 * The gather of a training step's targets (trainer_adapter._targets): ~2000 runs of ~1 KB per
 * layer from a read's chunks. numpy copies each run with the GIL released but takes it back
 * between runs, so threads splitting a step's gather did not get past ~2x on a 16-core host;
 * here every run of a thread's share is copied in one stretch without it. Parts: a job per
 * span of a record instead of one per chunk it crosses (~90 jobs a step instead of ~2000),
 * cut here rather than in Python: a step's gather took 0.6 to 1.4 ms less, here and on an H200
 * host. Every job is checked (shapes, strides, bounds) before any byte is copied; a bad one
 * raises ValueError naming it.
 */
struct run {
    const char *src;
    char *dst;
    Py_ssize_t n, src_step, bytes;
};

typedef struct {
    Py_buffer *views;
    struct run *runs;
    Py_ssize_t nv, cv, nr, cr;
} copy_plan;

static struct run *plan_run(copy_plan *p) {
    if (p->nr == p->cr) {
        const Py_ssize_t c = p->cr ? 2 * p->cr : 64;
        struct run *r = PyMem_Realloc(p->runs, c * sizeof *r);
        if (!r) return NULL;
        p->runs = r, p->cr = c;
    }
    return &p->runs[p->nr++];
}

static PyObject *copy_runs(PyObject *self, PyObject *args) {
    Py_buffer out;
    PyObject *jobs_in;
    Py_ssize_t N, K, isz;
    if (!PyArg_ParseTuple(args, "w*Onnn", &out, &jobs_in, &N, &K, &isz)) return NULL;
    PyObject *jobs = PySequence_Tuple(jobs_in);
    if (!jobs) {
        PyBuffer_Release(&out);
        return NULL;
    }
    const Py_ssize_t nj = PyTuple_GET_SIZE(jobs);
    copy_plan plan = {NULL, NULL, 0, 0, 0, 0};
    PyObject *skipped = NULL;
    const char *err = NULL;
    char msg[160];
    if (N < 0 || K < 1 || (isz != 1 && isz != 2) || out.len % (N * K * isz ? N * K * isz : 1)) {
        err = "copy_runs: out is not [M, N, K] ids of this size";
        goto done;
    }
    const Py_ssize_t row = K * isz, layer = N * row, m_out = layer ? out.len / layer : 0;
    if (!(skipped = PyList_New(0))) goto done;
    /* Room for a view of every source and part up front: a Py_buffer is not moved once the
     * exporter has filled it in (a malformed job is named by the parse below). */
    for (Py_ssize_t j = 0; j < nj; j++) {
        PyObject *job = PyTuple_GET_ITEM(jobs, j), *src0;
        const int parts0 = PyTuple_Check(job) && PyTuple_GET_SIZE(job) > 0 &&
                           PyTuple_Check(src0 = PyTuple_GET_ITEM(job, 0));
        plan.cv += parts0 ? PyTuple_GET_SIZE(src0) : 1;
    }
    if (!(plan.views = PyMem_Calloc(plan.cv ? plan.cv : 1, sizeof(Py_buffer)))) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t j = 0; j < nj; j++) {
        PyObject *src;
        Py_ssize_t c0, n, x, y, o, s;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(jobs, j), "Onnnnnn", &src, &c0, &n, &x, &y, &o, &s))
            goto done;
        /* Written so that no sum can overflow, whatever the caller passes. */
        if (c0 < 0 || n < 0 || x < 0 || y < x || o < 0 || o > m_out || n > m_out - o || s < 0 ||
            s > N || y - x > N - s)
            goto misfit;
        const int parts = PyTuple_Check(src);
        const Py_ssize_t np_ = parts ? PyTuple_GET_SIZE(src) : 1;
        const Py_ssize_t v0 = plan.nv, r0 = plan.nr;
        Py_ssize_t first = 0, d = s; /* the part's first row of the record; where it goes */
        int skip = 0;
        for (Py_ssize_t q = 0; q < np_ && (parts ? first < y : q == 0); q++) {
            Py_buffer *v = &plan.views[plan.nv]; /* nv < cv: counted above */
            if (PyObject_GetBuffer(parts ? PyTuple_GET_ITEM(src, q) : src, v,
                                   PyBUF_STRIDES | PyBUF_FORMAT) < 0)
                goto done;
            plan.nv++;
            if (v->ndim != 3 || v->itemsize != isz || v->shape[2] != K || v->strides[2] != isz ||
                v->strides[1] != row) {
                skip = 1;
                break;
            }
            const Py_ssize_t rows = v->shape[1];
            if (c0 > v->shape[0] || n > v->shape[0] - c0) goto misfit;
            /* this part's rows first .. first + rows (one array: first = 0), of which x .. y */
            const Py_ssize_t a = x > first ? x - first : 0;
            const Py_ssize_t b = y - first < rows ? y - first : rows;
            if (a < b) {
                struct run *r = plan_run(&plan);
                if (!r) {
                    PyErr_NoMemory();
                    goto done;
                }
                r->src = (const char *)v->buf + c0 * v->strides[0] + a * row;
                r->src_step = v->strides[0];
                r->dst = (char *)out.buf + o * layer + d * row;
                r->n = n;
                r->bytes = (b - a) * row;
                d += b - a;
            }
            first += rows;
        }
        if (!skip && first < y) { /* rows past the source, or past its last part */
            if (!parts) goto misfit;
            snprintf(msg, sizeof msg, "copy_runs: job %zd: its parts hold fewer rows than %zd",
                     j, y);
            err = msg;
            goto done;
        }
        if (skip) { /* nothing of this job is copied here */
            for (Py_ssize_t i = v0; i < plan.nv; i++) PyBuffer_Release(&plan.views[i]);
            plan.nv = v0, plan.nr = r0;
            PyObject *idx = PyLong_FromSsize_t(j);
            if (!idx || PyList_Append(skipped, idx) < 0) {
                Py_XDECREF(idx);
                goto done;
            }
            Py_DECREF(idx);
        }
        continue;
    misfit:
        snprintf(msg, sizeof msg, "copy_runs: job %zd does not fit its source or out", j);
        err = msg;
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t j = 0; j < plan.nr; j++) {
        const struct run *r = &plan.runs[j];
        for (Py_ssize_t l = 0; l < r->n; l++)
            memcpy(r->dst + l * layer, r->src + l * r->src_step, r->bytes);
    }
    Py_END_ALLOW_THREADS
done:
    for (Py_ssize_t i = 0; i < plan.nv; i++) PyBuffer_Release(&plan.views[i]);
    PyMem_Free(plan.views);
    PyMem_Free(plan.runs);
    Py_DECREF(jobs);
    PyBuffer_Release(&out);
    if (err) PyErr_SetString(PyExc_ValueError, err);
    if (PyErr_Occurred()) {
        Py_XDECREF(skipped);
        return NULL;
    }
    return skipped;
}

static PyMethodDef methods[] = {
    {"keep_join", keep_join, METH_VARARGS, "Inverse of the codec's keep transform (see _codec)."},
    {"join_high", join_high_py, METH_VARARGS, "Format 5's packed high bits -> uint16 ids."},
    {"join_high_grouped", join_high_grouped_py, METH_VARARGS,
     "Format 6's grouped high bits -> uint16 ids."},
    {"join_trits", join_trits_py, METH_VARARGS, "Format 6's base-3 high digits -> uint16 ids."},
    {"hist_u8", hist_u8, METH_VARARGS, "Byte histogram: counts[v] = number of bytes equal to v."},
    {"copy_runs", copy_runs, METH_VARARGS, "The gather's row copies without the GIL."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_ckernel", "Compiled inner loops of the route codec.", -1, methods,
};

PyMODINIT_FUNC PyInit__ckernel(void) { return PyModule_Create(&module); }
