/* Chained block hashes (engine/block_hash.py, spec version 1) in C.
 *
 * h_i = BLAKE2b-128(key, h_{i-1} || block_i): the same digests as hashlib's
 * blake2b(key=..., digest_size=16), one compression per block of 16 tokens.
 * The chain is sequential by definition, so what costs in Python is the four
 * method calls per block around each compression (copy, update, update,
 * digest); here the whole chain is one call. BLAKE2b as RFC 7693 defines it,
 * written for this one use: a key, then one message per digest.
 *
 * Beside it, id_bounds: the one pass over a prompt's ids that checking them
 * needs (engine/input_processor.py), for the same reason: per id, Python's
 * own scans cost more than the work.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static const uint64_t IV[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
    0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL,
};

/* The message word schedule of each of the 12 rounds (rounds 10 and 11 reuse 0 and 1). */
static const uint8_t SIGMA[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
};

static inline uint64_t rotr(uint64_t x, int n) { return (x >> n) | (x << (64 - n)); }

static inline uint64_t load_le64(const uint8_t *p) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    uint64_t x;
    memcpy(&x, p, 8);
    return x;
#else
    uint64_t x = 0;
    for (int i = 7; i >= 0; i--) x = (x << 8) | p[i];
    return x;
#endif
}

#define G(a, b, c, d, x, y)        \
    do {                           \
        v[a] = v[a] + v[b] + (x);  \
        v[d] = rotr(v[d] ^ v[a], 32); \
        v[c] = v[c] + v[d];        \
        v[b] = rotr(v[b] ^ v[c], 24); \
        v[a] = v[a] + v[b] + (y);  \
        v[d] = rotr(v[d] ^ v[a], 16); \
        v[c] = v[c] + v[d];        \
        v[b] = rotr(v[b] ^ v[c], 63); \
    } while (0)

#define ROUND(r)                                          \
    do {                                                  \
        G(0, 4, 8, 12, m[SIGMA[r][0]], m[SIGMA[r][1]]);   \
        G(1, 5, 9, 13, m[SIGMA[r][2]], m[SIGMA[r][3]]);   \
        G(2, 6, 10, 14, m[SIGMA[r][4]], m[SIGMA[r][5]]);  \
        G(3, 7, 11, 15, m[SIGMA[r][6]], m[SIGMA[r][7]]);  \
        G(0, 5, 10, 15, m[SIGMA[r][8]], m[SIGMA[r][9]]);  \
        G(1, 6, 11, 12, m[SIGMA[r][10]], m[SIGMA[r][11]]); \
        G(2, 7, 8, 13, m[SIGMA[r][12]], m[SIGMA[r][13]]); \
        G(3, 4, 9, 14, m[SIGMA[r][14]], m[SIGMA[r][15]]); \
    } while (0)

/* One 128-byte block into the state h; t counts the bytes so far, this block's included. */
static void compress(uint64_t h[8], const uint8_t block[128], uint64_t t, int last) {
    uint64_t m[16], v[16];
    for (int i = 0; i < 16; i++) m[i] = load_le64(block + 8 * i);
    for (int i = 0; i < 8; i++) {
        v[i] = h[i];
        v[i + 8] = IV[i];
    }
    v[12] ^= t; /* the counter's high word stays 0: messages here are short */
    if (last) v[14] = ~v[14];
    /* Spelled out so that every message index is a constant the compiler resolves. */
    ROUND(0);
    ROUND(1);
    ROUND(2);
    ROUND(3);
    ROUND(4);
    ROUND(5);
    ROUND(6);
    ROUND(7);
    ROUND(8);
    ROUND(9);
    ROUND(10);
    ROUND(11);
    for (int i = 0; i < 8; i++) h[i] ^= v[i] ^ v[i + 8];
}

/* An exact int's value as an unsigned long, read inline where it fits in one
 * digit (every token id of today's vocabularies): a call of
 * PyLong_AsUnsignedLong per id was a quarter of hashing 8k ids. (unsigned
 * long)-1 with an exception set where the value is negative or too large. */
static inline unsigned long small_int(PyObject *op) {
#if PY_VERSION_HEX >= 0x030C0000
    if (PyUnstable_Long_IsCompact((PyLongObject *)op)) {
        Py_ssize_t x = PyUnstable_Long_CompactValue((PyLongObject *)op);
        if (x >= 0) return (unsigned long)x;
    }
#else
    Py_ssize_t size = Py_SIZE(op);
    if (size == 0) return 0;
    if (size == 1) return ((PyLongObject *)op)->ob_digit[0];
#endif
    return PyLong_AsUnsignedLong(op);
}

/* Token id i of `seq` (a list or tuple from PySequence_Fast) as a uint32, as
 * array('I') would take it (an int, or anything with __index__); 0 with an
 * exception set otherwise: ValueError with pack_tokens' message for an id that is
 * not an integer or out of range. */
static int token_at(PyObject *seq, Py_ssize_t i, uint32_t *out) {
    /* __index__ below runs Python code, which could shrink a list under us. */
    if (i >= PySequence_Fast_GET_SIZE(seq)) {
        PyErr_SetString(PyExc_RuntimeError, "the token ids changed while they were hashed");
        return 0;
    }
    PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
    unsigned long v;
    if (PyLong_CheckExact(item)) { /* the usual case: no Python code runs */
        v = small_int(item);
        if (v <= 0xFFFFFFFFUL) {
            *out = (uint32_t)v;
            return 1;
        }
        PyErr_Clear(); /* out of range: the path below says so */
    }
    Py_INCREF(item);
    if (PyLong_Check(item)) {
        v = PyLong_AsUnsignedLong(item);
    } else {
        PyObject *index = PyNumber_Index(item);
        v = index != NULL ? PyLong_AsUnsignedLong(index) : (unsigned long)-1;
        Py_XDECREF(index);
    }
    int ok = !(v == (unsigned long)-1 && PyErr_Occurred()) && v <= 0xFFFFFFFFUL;
    if (!ok && (!PyErr_Occurred() || PyErr_ExceptionMatches(PyExc_OverflowError) ||
                PyErr_ExceptionMatches(PyExc_TypeError))) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "token ids must be integers in [0, 2**32); got %R", item);
    }
    Py_DECREF(item);
    *out = (uint32_t)v;
    return ok;
}

/* chain_ids(key, parent, token_ids, block_size, start_block) -> list of digests (each
 * len(parent) bytes), one per full block of token_ids from start_block on: keyed
 * BLAKE2b of the previous digest followed by the block's ids as little-endian
 * uint32. The ids are read straight from the list (or tuple; any other sequence
 * is copied into a list first): packing 8k of them into bytes in Python first,
 * with array('I'), cost 0.6 times what hashing them costs. */
static PyObject *chain_ids(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer key, parent;
    PyObject *ids, *seq = NULL, *out = NULL;
    Py_ssize_t block_size, start;
    if (!PyArg_ParseTuple(args, "y*y*Onn", &key, &parent, &ids, &block_size, &start)) return NULL;
    uint8_t *msg = NULL;
    Py_ssize_t outlen = parent.len;
    if (key.len < 1 || key.len > 64 || outlen < 1 || outlen > 64) {
        PyErr_SetString(PyExc_ValueError, "key and digest must be 1 to 64 bytes");
        goto done;
    }
    if (block_size < 1 || start < 0 || block_size > PY_SSIZE_T_MAX / 4 - 64) {
        PyErr_SetString(PyExc_ValueError, "block_size must be >= 1 and start_block >= 0");
        goto done;
    }
    seq = PySequence_Fast(ids, "token ids must be a sequence");
    if (seq == NULL) goto done;
    Py_ssize_t total = PySequence_Fast_GET_SIZE(seq) / block_size;
    Py_ssize_t n = total > start ? total - start : 0;

    /* The keyed state: the parameter block, then the key padded to a block. */
    uint64_t keyed[8];
    uint8_t block[128] = {0};
    memcpy(keyed, IV, sizeof keyed);
    keyed[0] ^= 0x01010000ULL ^ ((uint64_t)key.len << 8) ^ (uint64_t)outlen;
    memcpy(block, key.buf, key.len);
    compress(keyed, block, 128, 0);

    Py_ssize_t step = block_size * 4, mlen = outlen + step;
    msg = PyMem_Malloc(mlen);
    out = PyList_New(n);
    if (msg == NULL || out == NULL) {
        Py_CLEAR(out);
        PyErr_NoMemory();
        goto done;
    }
    memcpy(msg, parent.buf, outlen);
    for (Py_ssize_t i = 0; i < n; i++) {
        uint8_t *dst = msg + outlen;
        for (Py_ssize_t j = (start + i) * block_size, end = j + block_size; j < end; j++) {
            uint32_t t;
            if (!token_at(seq, j, &t)) {
                Py_CLEAR(out);
                goto done;
            }
            dst[0] = (uint8_t)t;
            dst[1] = (uint8_t)(t >> 8);
            dst[2] = (uint8_t)(t >> 16);
            dst[3] = (uint8_t)(t >> 24);
            dst += 4;
        }
        uint64_t h[8];
        memcpy(h, keyed, sizeof h);
        uint64_t t = 128;
        const uint8_t *p = msg;
        Py_ssize_t left = mlen;
        while (left > 128) {
            t += 128;
            compress(h, p, t, 0);
            p += 128;
            left -= 128;
        }
        memset(block, 0, sizeof block);
        memcpy(block, p, left);
        compress(h, block, t + left, 1);
        uint8_t digest[64];
        for (int w = 0; w < 8; w++)
            for (int b = 0; b < 8; b++) digest[8 * w + b] = (uint8_t)(h[w] >> (8 * b));
        PyObject *d = PyBytes_FromStringAndSize((const char *)digest, outlen);
        if (d == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, d);
        memcpy(msg, digest, outlen); /* the next block's parent */
    }
done:
    PyMem_Free(msg);
    Py_XDECREF(seq);
    PyBuffer_Release(&key);
    PyBuffer_Release(&parent);
    return out;
}

/* id_bounds(ids) -> (min, max) of a non-empty list or tuple of exact ints that
 * each fit a C long long, in one pass with no Python code run; None for anything
 * else (empty, another type, an int subclass such as bool, a larger int): the
 * caller's Python path then checks the ids and names what is wrong. A prompt's
 * ids were checked by the set of their types and then min() and max(): 115 us
 * for 2048 ids, twice on a disaggregated request's path (its decode node and
 * its prefill node each take the request in). */
static PyObject *id_bounds(PyObject *self, PyObject *ids) {
    (void)self;
    if (!PyList_CheckExact(ids) && !PyTuple_CheckExact(ids)) Py_RETURN_NONE;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(ids);
    if (n == 0) Py_RETURN_NONE;
    PyObject **items = PySequence_Fast_ITEMS(ids);
    long long lo = 0, hi = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = items[i];
        if (!PyLong_CheckExact(item)) Py_RETURN_NONE;
        long long v;
#if PY_VERSION_HEX >= 0x030C0000
        if (PyUnstable_Long_IsCompact((PyLongObject *)item)) {
            v = (long long)PyUnstable_Long_CompactValue((PyLongObject *)item);
        } else
#else
        Py_ssize_t size = Py_SIZE(item);
        if (size >= -1 && size <= 1) {
            v = size == 0 ? 0 : (long long)((PyLongObject *)item)->ob_digit[0] * size;
        } else
#endif
        {
            int overflow;
            v = PyLong_AsLongLongAndOverflow(item, &overflow);
            if (overflow) Py_RETURN_NONE;
            if (v == -1 && PyErr_Occurred()) return NULL;
        }
        if (i == 0 || v < lo) lo = v;
        if (i == 0 || v > hi) hi = v;
    }
    return Py_BuildValue("(LL)", lo, hi);
}

static PyMethodDef methods[] = {
    {"chain_ids", chain_ids, METH_VARARGS,
     "Chained keyed BLAKE2b digests of token-id blocks (engine/block_hash.py)."},
    {"id_bounds", id_bounds, METH_O,
     "(min, max) of a list or tuple of exact ints in one pass; None otherwise."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_block_hash", NULL, -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__block_hash(void) { return PyModule_Create(&module); }
