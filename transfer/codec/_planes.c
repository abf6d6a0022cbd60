/* Byte planes fused with XOR against a base, in one pass and without the GIL.

   split(src, base, dst, width): dst = planes(src XOR base)    (the encoder's transform)
   join(src, base, dst, width):  dst = unplanes(src) XOR base  (the decoder's inverse)
   join_planes(src, other, dst, width): dst = unplanes(src XOR other), both in plane order
       (a delta's planes and its keyframe base's planes, straight from zstd: the base is
       never unplaned on its own; XOR commutes with the byte shuffle)

   Same meaning as transforms.py's xor_with_base / to_planes / from_planes composed: XOR
   runs over the common prefix of the data and the base (base may be None or shorter), the
   planes cover whole ``width``-byte elements and a shorter tail stays last, as it is.
   Why C: numpy needs a copy per step and a strided pass per plane (~1 GB/s for both steps
   fused, 2 cores, 4 MiB chunks); this loop is one read of src and base and one write of
   dst, vectorised by the compiler (AVX2 when the CPU has it), at memory speed. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the 4-byte plane loops assume a little-endian CPU"
#endif

#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
#define HOT __attribute__((target_clones("avx2", "default")))
#else
#define HOT
#endif

/* ---- the fused loops over whole elements [0, n) with a full base ------------------------ */

HOT static void join4(const uint8_t *restrict s, const uint8_t *restrict b, uint8_t *restrict d,
                      Py_ssize_t m, Py_ssize_t n) {
    const uint8_t *p0 = s, *p1 = s + m, *p2 = s + 2 * m, *p3 = s + 3 * m;
    for (Py_ssize_t i = 0; i < n; i++) { /* as one little-endian word: vectorises well */
        uint32_t x, y = (uint32_t)p0[i] | (uint32_t)p1[i] << 8 | (uint32_t)p2[i] << 16 |
                        (uint32_t)p3[i] << 24;
        memcpy(&x, b + 4 * i, 4);
        x ^= y;
        memcpy(d + 4 * i, &x, 4);
    }
}

HOT static void join2(const uint8_t *restrict s, const uint8_t *restrict b, uint8_t *restrict d,
                      Py_ssize_t m, Py_ssize_t n) {
    const uint8_t *p0 = s, *p1 = s + m;
    for (Py_ssize_t i = 0; i < n; i++) {
        d[2 * i + 0] = p0[i] ^ b[2 * i + 0];
        d[2 * i + 1] = p1[i] ^ b[2 * i + 1];
    }
}

HOT static void split4(const uint8_t *restrict s, const uint8_t *restrict b, uint8_t *restrict d,
                       Py_ssize_t m, Py_ssize_t n) {
    uint8_t *p0 = d, *p1 = d + m, *p2 = d + 2 * m, *p3 = d + 3 * m;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t x, y;
        memcpy(&x, s + 4 * i, 4);
        memcpy(&y, b + 4 * i, 4);
        x ^= y;
        p0[i] = (uint8_t)x;
        p1[i] = (uint8_t)(x >> 8);
        p2[i] = (uint8_t)(x >> 16);
        p3[i] = (uint8_t)(x >> 24);
    }
}

HOT static void split2(const uint8_t *restrict s, const uint8_t *restrict b, uint8_t *restrict d,
                       Py_ssize_t m, Py_ssize_t n) {
    uint8_t *p0 = d, *p1 = d + m;
    for (Py_ssize_t i = 0; i < n; i++) {
        p0[i] = s[2 * i + 0] ^ b[2 * i + 0];
        p1[i] = s[2 * i + 1] ^ b[2 * i + 1];
    }
}

/* Planes only (no base): a keyframe's bp4/bp2 chunks. */
HOT static void join_plain(const uint8_t *restrict s, uint8_t *restrict d, Py_ssize_t m, int w) {
    if (w == 4) {
        const uint8_t *p0 = s, *p1 = s + m, *p2 = s + 2 * m, *p3 = s + 3 * m;
        for (Py_ssize_t i = 0; i < m; i++) {
            uint32_t y = (uint32_t)p0[i] | (uint32_t)p1[i] << 8 | (uint32_t)p2[i] << 16 |
                         (uint32_t)p3[i] << 24;
            memcpy(d + 4 * i, &y, 4);
        }
    } else {
        const uint8_t *p0 = s, *p1 = s + m;
        for (Py_ssize_t i = 0; i < m; i++) {
            d[2 * i + 0] = p0[i];
            d[2 * i + 1] = p1[i];
        }
    }
}

HOT static void split_plain(const uint8_t *restrict s, uint8_t *restrict d, Py_ssize_t m, int w) {
    if (w == 4) {
        uint8_t *p0 = d, *p1 = d + m, *p2 = d + 2 * m, *p3 = d + 3 * m;
        for (Py_ssize_t i = 0; i < m; i++) {
            uint32_t x;
            memcpy(&x, s + 4 * i, 4);
            p0[i] = (uint8_t)x;
            p1[i] = (uint8_t)(x >> 8);
            p2[i] = (uint8_t)(x >> 16);
            p3[i] = (uint8_t)(x >> 24);
        }
    } else {
        uint8_t *p0 = d, *p1 = d + m;
        for (Py_ssize_t i = 0; i < m; i++) {
            p0[i] = s[2 * i + 0];
            p1[i] = s[2 * i + 1];
        }
    }
}

HOT static void xor_into(const uint8_t *restrict s, const uint8_t *restrict b, uint8_t *restrict d,
                         Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) d[i] = s[i] ^ b[i];
}

/* ---- two sources in plane order, XORed as they are unplaned ---------------------------- */

HOT static void join4p(const uint8_t *restrict s, const uint8_t *restrict o, uint8_t *restrict d,
                       Py_ssize_t m) {
    const uint8_t *p0 = s, *p1 = s + m, *p2 = s + 2 * m, *p3 = s + 3 * m;
    const uint8_t *q0 = o, *q1 = o + m, *q2 = o + 2 * m, *q3 = o + 3 * m;
    for (Py_ssize_t i = 0; i < m; i++) {
        uint32_t y = (uint32_t)(p0[i] ^ q0[i]) | (uint32_t)(p1[i] ^ q1[i]) << 8 |
                     (uint32_t)(p2[i] ^ q2[i]) << 16 | (uint32_t)(p3[i] ^ q3[i]) << 24;
        memcpy(d + 4 * i, &y, 4);
    }
}

HOT static void join2p(const uint8_t *restrict s, const uint8_t *restrict o, uint8_t *restrict d,
                       Py_ssize_t m) {
    const uint8_t *p0 = s, *p1 = s + m, *q0 = o, *q1 = o + m;
    for (Py_ssize_t i = 0; i < m; i++) {
        d[2 * i + 0] = p0[i] ^ q0[i];
        d[2 * i + 1] = p1[i] ^ q1[i];
    }
}

static void join_two(const uint8_t *s, const uint8_t *o, uint8_t *d, Py_ssize_t len, int w) {
    Py_ssize_t m = len / w, whole = m * w;
    if (w == 4) join4p(s, o, d, m);
    else if (w == 2) join2p(s, o, d, m);
    else whole = 0; /* width 1: XOR only, below */
    for (Py_ssize_t j = whole; j < len; j++) d[j] = s[j] ^ o[j]; /* the tail stays last */
}

/* ---- the general case: any width, base of any length ------------------------------------ */

static uint8_t base_at(const uint8_t *b, Py_ssize_t nb, Py_ssize_t j) {
    return j < nb ? b[j] : 0;
}

static void transform(int join, const uint8_t *s, const uint8_t *b, Py_ssize_t nb, uint8_t *d,
                      Py_ssize_t len, int w) {
    Py_ssize_t m = len / w, whole = m * w;
    if (nb > len) nb = len;
    Py_ssize_t full = nb / w; /* elements with every byte inside the base (nb 0: none) */
    if (w == 1) { /* XOR only (nb is 0 without a base) */
        if (nb) xor_into(s, b, d, nb);
        memcpy(d + nb, s + nb, len - nb);
        return;
    }
    if (nb == 0) { /* no base: planes only, vectorised over every whole element */
        (join ? join_plain : split_plain)(s, d, m, w);
        memcpy(d + whole, s + whole, len - whole);
        return;
    }
    if (full) {
        if (join) (w == 4 ? join4 : join2)(s, b, d, m, full);
        else (w == 4 ? split4 : split2)(s, b, d, m, full);
    }
    for (Py_ssize_t i = full; i < m; i++) { /* past the base: planes only (and a partial one) */
        for (int k = 0; k < w; k++) {
            Py_ssize_t j = i * w + k, p = k * m + i;
            uint8_t x = base_at(b, nb, j);
            if (join) d[j] = s[p] ^ x;
            else d[p] = s[j] ^ x;
        }
    }
    for (Py_ssize_t j = whole; j < len; j++) /* the tail stays last, at the same offsets */
        d[j] = s[j] ^ base_at(b, nb, j);
}

static PyObject *run(PyObject *args, int join) {
    Py_buffer src, dst, base = {0};
    PyObject *base_obj;
    int width;
    if (!PyArg_ParseTuple(args, "y*Ow*i", &src, &base_obj, &dst, &width)) return NULL;
    PyObject *result = NULL;
    int have_base = base_obj != Py_None;
    if (have_base && PyObject_GetBuffer(base_obj, &base, PyBUF_SIMPLE) < 0) goto done_src;
    if (width != 1 && width != 2 && width != 4) {
        PyErr_SetString(PyExc_ValueError, "width must be 1, 2 or 4");
    } else if (dst.len != src.len) {
        PyErr_SetString(PyExc_ValueError, "dst and src differ in length");
    } else if (!((char *)dst.buf + dst.len <= (char *)src.buf ||
                 (char *)src.buf + src.len <= (char *)dst.buf)) {
        PyErr_SetString(PyExc_ValueError, "dst overlaps src");
    } else {
        Py_BEGIN_ALLOW_THREADS
        transform(join, src.buf, have_base ? base.buf : NULL, have_base ? base.len : 0, dst.buf,
                  src.len, width);
        Py_END_ALLOW_THREADS
        result = Py_NewRef(Py_None);
    }
    if (have_base) PyBuffer_Release(&base);
done_src:
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return result;
}

static PyObject *py_join_planes(PyObject *self, PyObject *args) {
    Py_buffer src, other, dst;
    int width;
    if (!PyArg_ParseTuple(args, "y*y*w*i", &src, &other, &dst, &width)) return NULL;
    PyObject *result = NULL;
    if (width != 1 && width != 2 && width != 4) {
        PyErr_SetString(PyExc_ValueError, "width must be 1, 2 or 4");
    } else if (dst.len != src.len || other.len != src.len) {
        PyErr_SetString(PyExc_ValueError, "src, other and dst differ in length");
    } else if (!((char *)dst.buf + dst.len <= (char *)src.buf ||
                 (char *)src.buf + src.len <= (char *)dst.buf) ||
               !((char *)dst.buf + dst.len <= (char *)other.buf ||
                 (char *)other.buf + other.len <= (char *)dst.buf)) {
        PyErr_SetString(PyExc_ValueError, "dst overlaps src or other");
    } else {
        Py_BEGIN_ALLOW_THREADS
        join_two(src.buf, other.buf, dst.buf, src.len, width);
        Py_END_ALLOW_THREADS
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&other);
    PyBuffer_Release(&dst);
    return result;
}

static PyObject *py_split(PyObject *self, PyObject *args) { return run(args, 0); }
static PyObject *py_join(PyObject *self, PyObject *args) { return run(args, 1); }

static PyMethodDef methods[] = {
    {"split", py_split, METH_VARARGS, "split(src, base, dst, width): dst = planes(src ^ base)"},
    {"join", py_join, METH_VARARGS, "join(src, base, dst, width): dst = unplanes(src) ^ base"},
    {"join_planes", py_join_planes, METH_VARARGS,
     "join_planes(src, other, dst, width): dst = unplanes(src ^ other)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_planes", "Byte planes fused with XOR (GIL released).", -1, methods,
};

PyMODINIT_FUNC PyInit__planes(void) { return PyModule_Create(&module); }
