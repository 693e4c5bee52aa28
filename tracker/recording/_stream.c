/* Copies into chunk memory that bypass the cache (non-temporal stores).
 *
 * A recorded row is written once and read much later (a query, an export), long after it has left every
 * cache. An ordinary copy (memcpy, numpy's copyto) first reads each destination line from memory, then
 * writes it back: twice the traffic of the write itself. Streaming stores write whole lines straight to
 * memory, so copying a 512 KiB row into memory no cache holds takes about half the time (an AMD EPYC core:
 * 33-38 us against 70-85 us). The source is read normally (it is the model's output, usually in cache).
 *
 * One function, copy(dst, src): dst a writable, src a readable C-contiguous buffer of the same byte size.
 * The interpreter lock is released during the copy. On other than x86-64 it is a memcpy. Built by setup.py
 * as an optional extension: where it cannot be built, tracker.recording.streaming copies with numpy.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define STREAMING 1
#else
#define STREAMING 0
#endif

static void stream_copy(char *dst, const char *src, size_t n) {
#if STREAMING
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;  /* bytes until dst is 16-byte aligned */
    if (n < head + 64) {
        memcpy(dst, src, n);
        return;
    }
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    size_t body = n & ~(size_t)63;
    for (size_t i = 0; i < body; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    _mm_sfence(); /* the streamed lines are visible to every thread before the copy returns */
    memcpy(dst + body, src + body, n - body);
#else
    memcpy(dst, src, n);
#endif
}

static PyObject *copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "copy(dst, src) takes 2 arguments, got %zd", nargs);
        return NULL;
    }
    Py_buffer dst, src;
    if (PyObject_GetBuffer(args[0], &dst, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        return NULL;
    }
    if (PyObject_GetBuffer(args[1], &src, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    if (dst.len != src.len) {
        PyErr_Format(PyExc_ValueError, "copy: dst holds %zd bytes and src %zd; they must be the same size", dst.len,
                     src.len);
    } else {
        Py_BEGIN_ALLOW_THREADS stream_copy((char *)dst.buf, (const char *)src.buf, (size_t)src.len);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    if (PyErr_Occurred()) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy", (PyCFunction)(void (*)(void))copy, METH_FASTCALL,
     "copy(dst, src): copy the C-contiguous buffer src into dst (the same byte size) with streaming stores."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_stream", NULL, -1, methods};

PyMODINIT_FUNC PyInit__stream(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "STREAMING", STREAMING) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
