/* The LUT-GEMV as a CPython function, for the decode path's calls from Python.
 *
 * Through ctypes, a GEMV call spent a measurable share of even a 4096² GEMV in Python before the
 * kernel started (numpy attribute reads, buffer views, argument conversion, each a trip to memory
 * with the caller's objects evicted by the weights streamed since: docs/performance.md, "Call
 * overhead"). Here the same checks take one buffer request per array. The module is optional:
 * luts/build.py compiles it on first use when Python's headers are present, and the ctypes path
 * serves otherwise.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "lut.h"

typedef int (*gemv_fn)(const lut_weight *, const float *, int, int, float *, int32_t *, int);

static int is_float32(const Py_buffer *b) { return b->format && b->format[0] == 'f' && b->format[1] == '\0'; }

/* gemv(kernel, weight, x, out, table_bits, threads) -> bool
 *
 * kernel: the address of a kernel library's npumoe_lut_gemv; weight: a lut_weight (any object exposing
 * its bytes, such as the ctypes struct); x: float32 C-contiguous [K] or [M, K]; out: writable float32
 * C-contiguous [row_blocks·16] or [M, row_blocks·16]. Runs y = x Wᵀ into out and returns True; returns
 * False, running nothing, when the arguments do not fit, so that the caller's checked path explains. */
static PyObject *gemv(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 6) return PyErr_Format(PyExc_TypeError, "gemv takes 6 arguments, got %zd", nargs);
    const gemv_fn kernel = (gemv_fn)PyLong_AsVoidPtr(args[0]);
    const long table_bits = PyLong_AsLong(args[4]), threads = PyLong_AsLong(args[5]);
    if (PyErr_Occurred()) return NULL;
    Py_buffer w, x, y;
    if (PyObject_GetBuffer(args[1], &w, PyBUF_SIMPLE) < 0) return NULL;
    if (w.len != sizeof(lut_weight)) {
        PyBuffer_Release(&w);
        return PyErr_Format(PyExc_TypeError, "weight is %zd bytes, not a lut_weight", w.len);
    }
    const lut_weight *weight = w.buf;
    int fits = 0, failed = 0;
    if (PyObject_GetBuffer(args[2], &x, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) == 0) {
        if (PyObject_GetBuffer(args[3], &y, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) == 0) {
            const Py_ssize_t rows = x.ndim == 2 ? x.shape[0] : 1, outputs = (Py_ssize_t)weight->row_blocks * LUT_ROWS;
            fits = is_float32(&x) && is_float32(&y) && (table_bits == 8 || table_bits == 16) && rows <= INT_MAX &&
                   (x.ndim == 1 || x.ndim == 2) && y.ndim == x.ndim && x.shape[x.ndim - 1] == weight->k &&
                   y.shape[y.ndim - 1] == outputs && (x.ndim == 1 || y.shape[0] == rows);
            if (fits) {
                Py_BEGIN_ALLOW_THREADS
                failed = kernel(weight, x.buf, (int)rows, (int)table_bits, y.buf, NULL, (int)threads);
                Py_END_ALLOW_THREADS
            }
            PyBuffer_Release(&y);
        }
        PyBuffer_Release(&x);
    }
    PyErr_Clear(); /* an array that cannot be viewed so is left to the checked path */
    PyBuffer_Release(&w);
    if (failed) return PyErr_NoMemory();
    return PyBool_FromLong(fits);
}

static PyMethodDef methods[] = {
    {"gemv", (PyCFunction)(void (*)(void))gemv, METH_FASTCALL,
     "y = x Wᵀ through a kernel library; False if x, out do not fit"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_lutcall", "The LUT-GEMV as a CPython function.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__lutcall(void) { return PyModule_Create(&module); }
