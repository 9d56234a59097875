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
#include <string.h>

#include "_kernels.h"


/* keep_join(mask, values, out, M, T, K, itemsize) -> None
 *
 * mask:   change bits in np.packbits order (most significant bit first), streams [M, K, T]
 *         flattened: bit i is token t of slot k of layer m, i = (m * K + k) * T + t.
 * values: the changed ids, in stream order, itemsize bytes each (1 or 2, native order).
 * out:    writable [M, T, K] ids, itemsize bytes each.
 *
 * Token t of a stream takes the id of the last set bit at or before t. Errors: a stream whose
 * first bit is clear (it would inherit another stream's id), a count of set bits other than
 * the number of values, wrong buffer sizes.
 */
static PyObject *keep_join(PyObject *self, PyObject *args) {
    Py_buffer mask, values, out;
    Py_ssize_t M, T, K, itemsize;
    if (!PyArg_ParseTuple(args, "y*y*w*nnnn", &mask, &values, &out, &M, &T, &K, &itemsize))
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
        Py_ssize_t ones = 0;
        for (Py_ssize_t b = 0; b < n / 8; b++) ones += __builtin_popcount(mb[b]);
        if (n % 8) ones += __builtin_popcount(mb[n / 8] & (0xFF00u >> (n % 8)));
        if (ones != nv) err = "keep_join: the change bits do not count the ids";
        for (Py_ssize_t s = 0; s < M * K && T && !err; s++)
            if (!((mb[(s * T) >> 3] >> (7 - ((s * T) & 7))) & 1))
                err = "keep_join: a stream starts without its first id";
        if (!err && itemsize == 1)
            join_u8(mb, (const uint8_t *)values.buf, (uint8_t *)out.buf, M, T, K);
        else if (!err)
            join_u16(mb, (const uint16_t *)values.buf, (uint16_t *)out.buf, M, T, K);
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

static PyMethodDef methods[] = {
    {"keep_join", keep_join, METH_VARARGS, "Inverse of the codec's keep transform (see _codec)."},
    {"hist_u8", hist_u8, METH_VARARGS, "Byte histogram: counts[v] = number of bytes equal to v."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_ckernel", "Compiled inner loops of the route codec.", -1, methods,
};

PyMODINIT_FUNC PyInit__ckernel(void) { return PyModule_Create(&module); }
