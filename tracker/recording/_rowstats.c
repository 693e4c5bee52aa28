/* Row statistics of float32 logits in two passes over each row (tracker.recording.record_stats' CPU path).
 *
 * Every recorded row of a CPU run gets its statistics (log-sum-exp, entropy, maximum, allowed count, and
 * against the natural row the removed mass and margin) on a background thread, or at record time with
 * statistics="record". Spelled with numpy each statistic is its own pass over the row, and numpy's float32
 * exp is the slowest of them: at 131,072 tokens a row took about 0.7 ms, a constrained row against its
 * natural row 2 ms more. Here one pass finds the maxima and counts, a second computes exp once per token
 * and every sum at once (exp by a polynomial the compiler vectorises, sums carried in double).
 *
 * Functions (each takes C-contiguous float32 buffers, releases the interpreter lock while it runs):
 *   row_stats(x, out)        x [B, V]; out [B, 5] float32: max, lse, entropy, allowed, special
 *   pair_stats(nat, x, out)  nat, x [B, V]; out [B, 3] float32: removed mass, margin, special
 * A row is "special" (1.0, its other values left unset) when it holds NaN or +inf: the caller computes
 * those rows another way. -inf tokens are masked: they weigh nothing and are not allowed.
 *
 * Built by setup.py as an optional extension: where it cannot be built, record_stats computes the same
 * statistics with numpy (equal within float32 rounding).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 256 /* tokens summed in float before the sums are added in double (a multiple of LANES) */

#if defined(__GNUC__) && !defined(__clang__) && (defined(__x86_64__) || defined(_M_X64))
#define VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define VECTOR_CLONES
#endif

/* Eight tokens at a time, in GCC/Clang vector types: one AVX2 register where the CPU has it (the clone of
 * each loop function picked at load time), two SSE2 registers elsewhere on x86-64. Comparisons give lane
 * masks (-1 or 0), selected with bit operations. Per lane: maxima, counts and float sums of a BLOCK of
 * tokens, then added in double (no float sum is reassociated: the results do not depend on the clone). */
typedef float vf __attribute__((vector_size(32)));
typedef int32_t vi __attribute__((vector_size(32)));
#define LANES 8

static inline vf load(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline vf splat(float a) { return (vf){a, a, a, a, a, a, a, a}; }

static inline vf vsel(vi mask, vf a, vf b) { return (vf)((mask & (vi)a) | (~mask & (vi)b)); }

static inline vf vmax(vf a, vf b) { return vsel(a > b, a, b); }

/* e^x for x in [-87, 0] (the caller clamps), within 2 ulp: Cephes' expf polynomial on the reduced argument
 * x - n ln 2, times 2^n built from its bits. */
static inline vf exp_neg(vf x) {
    vf fx = x * splat(1.44269504088896341f);
    vi n = __builtin_convertvector(fx - splat(0.5f), vi); /* round(fx) for fx <= 0: truncation toward zero */
    vf fn = __builtin_convertvector(n, vf);
    vf r = x - fn * splat(0.693359375f);
    r = r - fn * splat(-2.12194440e-4f);
    vf p = splat(1.9875691500e-4f);
    p = p * r + splat(1.3981999507e-3f);
    p = p * r + splat(8.3334519073e-3f);
    p = p * r + splat(4.1665795894e-2f);
    p = p * r + splat(1.6666665459e-1f);
    p = p * r + splat(5.0000001201e-1f);
    p = p * r * r + r + splat(1.0f);
    vi bits = (n + 127) << 23;
    return p * (vf)bits;
}

static inline float exp_neg1(float x) {
    vf v = exp_neg(splat(x));
    return v[0];
}

static inline float lane_max(vf m) {
    float best = -INFINITY;
    for (int j = 0; j < LANES; j++)
        best = m[j] > best ? m[j] : best;
    return best;
}

static inline Py_ssize_t lane_count(vi c) {
    Py_ssize_t n = 0;
    for (int j = 0; j < LANES; j++)
        n -= c[j]; /* lanes count down: a true comparison is -1 */
    return n;
}

/* Pass 1 of a row: its maximum over the values that are not NaN, and counts of NaN, +inf and -inf. */
VECTOR_CLONES
static void scan(const float *x, Py_ssize_t v, float *top, Py_ssize_t *nan, Py_ssize_t *posinf,
                 Py_ssize_t *neginf) {
    const vf pinf = splat(INFINITY), ninf = splat(-INFINITY);
    vf m = ninf;
    Py_ssize_t n_nan = 0, n_pos = 0, n_neg = 0, i = 0;
    while (i + LANES <= v) { /* int32 lane counts, flushed every 2^20 tokens */
        vi cn = {0}, cp = {0}, cg = {0};
        Py_ssize_t end = i + (1 << 20) <= v ? i + (1 << 20) : v - (v - i) % LANES;
        for (; i < end; i += LANES) {
            vf a = load(x + i);
            m = vmax(a, m);
            cn += a != a;
            cp += a == pinf;
            cg += a == ninf;
        }
        n_nan += lane_count(cn);
        n_pos += lane_count(cp);
        n_neg += lane_count(cg);
    }
    float best = lane_max(m);
    for (; i < v; i++) {
        float a = x[i];
        best = a > best ? a : best;
        n_nan += a != a;
        n_pos += a == INFINITY;
        n_neg += a == -INFINITY;
    }
    *top = best;
    *nan = n_nan;
    *posinf = n_pos;
    *neginf = n_neg;
}

/* Pass 2 of a row with maximum top (finite): the sums of e = exp(x - top) (0 for a masked token) and of
 * e (x - top), with x - top clamped at -87, where e stops mattering to a sum whose largest term is 1. */
VECTOR_CLONES
static void exp_sums(const float *x, Py_ssize_t v, float top, double *total, double *weighted) {
    const vf ninf = splat(-INFINITY), floor = splat(-87.0f), shift = splat(top), zero = splat(0.0f);
    double s = 0.0, sz = 0.0;
    Py_ssize_t i = 0;
    while (i + LANES <= v) {
        vf bs = zero, bsz = zero;
        Py_ssize_t end = i + BLOCK <= v ? i + BLOCK : v - (v - i) % LANES;
        for (; i < end; i += LANES) {
            vf a = load(x + i);
            vf z = vmax(a - shift, floor);
            vf e = vsel(a > ninf, exp_neg(z), zero);
            bs += e;
            bsz += e * z;
        }
        for (int j = 0; j < LANES; j++) {
            s += bs[j];
            sz += bsz[j];
        }
    }
    for (; i < v; i++) {
        if (!(x[i] > -INFINITY))
            continue;
        float z = x[i] - top;
        z = z > -87.0f ? z : -87.0f;
        float e = exp_neg1(z);
        s += e;
        sz += e * z;
    }
    *total = s;
    *weighted = sz;
}

/* Pass 1 of a pair: the natural row's maximum where the stage masks the token (x == -inf) and where it
 * allows it (the larger of the two is the row's maximum), and its counts of NaN and +inf. */
VECTOR_CLONES
static void split_max(const float *nat, const float *x, Py_ssize_t v, float *gone, float *kept, Py_ssize_t *odd) {
    const vf ninf = splat(-INFINITY), pinf = splat(INFINITY);
    vf g = ninf, k = ninf;
    Py_ssize_t n_odd = 0, i = 0;
    while (i + LANES <= v) { /* int32 lane counts, flushed every 2^20 tokens */
        vi c = {0};
        Py_ssize_t end = i + (1 << 20) <= v ? i + (1 << 20) : v - (v - i) % LANES;
        for (; i < end; i += LANES) {
            vf a = load(nat + i);
            vi allowed = load(x + i) > ninf;
            g = vmax(vsel(allowed, ninf, a), g);
            k = vmax(vsel(allowed, a, ninf), k);
            c += (a != a) | (a == pinf);
        }
        n_odd += lane_count(c);
    }
    float gg = lane_max(g), kk = lane_max(k);
    for (; i < v; i++) {
        float a = nat[i];
        n_odd += a != a || a == INFINITY;
        if (x[i] > -INFINITY)
            kk = a > kk ? a : kk;
        else
            gg = a > gg ? a : gg;
    }
    *gone = gg;
    *kept = kk;
    *odd = n_odd;
}

/* Pass 2 of a pair: the natural row's sum of exp(nat - top) over its tokens (the total), and of
 * exp(nat - gone) over the tokens the stage masks (its own shift, so that a mass far below the best token
 * is still summed, not lost); factor = exp(gone - top) turns the second kind of term into the first. */
VECTOR_CLONES
static void split_sums(const float *nat, const float *x, Py_ssize_t v, float top, float gone, float factor,
                       double *total, double *removed) {
    const vf ninf = splat(-INFINITY), floor = splat(-87.0f), zero = splat(0.0f), one = splat(1.0f);
    const vf top_v = splat(top), gone_v = splat(gone), factor_v = splat(factor);
    double s = 0.0, sg = 0.0;
    Py_ssize_t i = 0;
    while (i + LANES <= v) {
        vf bs = zero, bsg = zero;
        Py_ssize_t end = i + BLOCK <= v ? i + BLOCK : v - (v - i) % LANES;
        for (; i < end; i += LANES) {
            vf n = load(nat + i);
            vi allowed = load(x + i) > ninf;
            vf z = vmax(n - vsel(allowed, top_v, gone_v), floor);
            vf e = vsel(n > ninf, exp_neg(z), zero);
            bs += e * vsel(allowed, one, factor_v);
            bsg += vsel(allowed, zero, e);
        }
        for (int j = 0; j < LANES; j++) {
            s += bs[j];
            sg += bsg[j];
        }
    }
    for (; i < v; i++) {
        float n = nat[i];
        if (!(n > -INFINITY))
            continue;
        int allowed = x[i] > -INFINITY;
        float z = n - (allowed ? top : gone);
        z = z > -87.0f ? z : -87.0f;
        float e = exp_neg1(z);
        s += allowed ? e : e * factor;
        sg += allowed ? 0.0f : e;
    }
    *total = s;
    *removed = sg;
}

static int get_rows(PyObject *obj, Py_buffer *view, int writable, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_ND | (writable ? PyBUF_WRITABLE : 0)) <
        0)
        return -1;
    if (view->ndim != 2 || view->itemsize != 4 || view->format == NULL || strcmp(view->format, "f") != 0) {
        PyErr_Format(PyExc_ValueError, "%s: a 2-D C-contiguous float32 array is needed", name);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *row_stats(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "row_stats(x, out) takes 2 arguments, got %zd", nargs);
        return NULL;
    }
    Py_buffer xb, ob;
    if (get_rows(args[0], &xb, 0, "x") < 0)
        return NULL;
    if (get_rows(args[1], &ob, 1, "out") < 0) {
        PyBuffer_Release(&xb);
        return NULL;
    }
    Py_ssize_t b = xb.shape[0], v = xb.shape[1];
    if (ob.shape[0] != b || ob.shape[1] != 5) {
        PyErr_Format(PyExc_ValueError, "out must have shape (%zd, 5), got (%zd, %zd)", b, ob.shape[0], ob.shape[1]);
        PyBuffer_Release(&xb);
        PyBuffer_Release(&ob);
        return NULL;
    }
    const float *x = (const float *)xb.buf;
    float *out = (float *)ob.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t r = 0; r < b; r++) {
        const float *row = x + r * v;
        float *o = out + r * 5;
        float top;
        Py_ssize_t nan, posinf, neginf;
        scan(row, v, &top, &nan, &posinf, &neginf);
        o[0] = top;
        o[3] = (float)(v - neginf);
        o[4] = (nan || posinf) ? 1.0f : 0.0f;
        if (o[4] != 0.0f)
            continue;
        if (top == -INFINITY) { /* nothing allowed */
            o[1] = -INFINITY;
            o[2] = NAN;
            continue;
        }
        double total, weighted;
        exp_sums(row, v, top, &total, &weighted);
        double log_total = log(total);
        o[1] = (float)((double)top + log_total);
        o[2] = (float)(log_total - weighted / total);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&xb);
    PyBuffer_Release(&ob);
    Py_RETURN_NONE;
}

static PyObject *pair_stats(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "pair_stats(nat, x, out) takes 3 arguments, got %zd", nargs);
        return NULL;
    }
    Py_buffer nb, xb, ob;
    if (get_rows(args[0], &nb, 0, "nat") < 0)
        return NULL;
    if (get_rows(args[1], &xb, 0, "x") < 0) {
        PyBuffer_Release(&nb);
        return NULL;
    }
    if (get_rows(args[2], &ob, 1, "out") < 0) {
        PyBuffer_Release(&nb);
        PyBuffer_Release(&xb);
        return NULL;
    }
    Py_ssize_t b = nb.shape[0], v = nb.shape[1];
    if (xb.shape[0] != b || xb.shape[1] != v || ob.shape[0] != b || ob.shape[1] != 3) {
        PyErr_Format(PyExc_ValueError, "pair_stats: nat and x must have one shape (%zd, %zd), out (%zd, 3)", b, v, b);
        PyBuffer_Release(&nb);
        PyBuffer_Release(&xb);
        PyBuffer_Release(&ob);
        return NULL;
    }
    const float *nat = (const float *)nb.buf, *x = (const float *)xb.buf;
    float *out = (float *)ob.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t r = 0; r < b; r++) {
        const float *nrow = nat + r * v, *xrow = x + r * v;
        float *o = out + r * 3;
        float gone, kept;
        Py_ssize_t odd;
        split_max(nrow, xrow, v, &gone, &kept, &odd);
        o[2] = odd ? 1.0f : 0.0f; /* NaN or +inf in the natural row */
        if (odd)
            continue;
        float top = gone > kept ? gone : kept;
        o[1] = top - kept; /* inf when nothing is allowed; NaN when the natural row allows nothing either */
        if (top == -INFINITY) {
            o[0] = 0.0f; /* no natural mass to remove */
            continue;
        }
        if (gone == -INFINITY) {
            o[0] = 0.0f; /* nothing masked (or only tokens the natural row masked already) */
            continue;
        }
        double total, removed;
        float factor = (float)exp((double)gone - (double)top);
        split_sums(nrow, xrow, v, top, gone, factor, &total, &removed);
        double mass = exp(log(removed) + (double)gone - (log(total) + (double)top));
        o[0] = (float)(mass < 0.0 ? 0.0 : mass > 1.0 ? 1.0 : mass);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&nb);
    PyBuffer_Release(&xb);
    PyBuffer_Release(&ob);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"row_stats", (PyCFunction)(void (*)(void))row_stats, METH_FASTCALL,
     "row_stats(x, out): max, lse, entropy, allowed count and a special flag of each float32 row"},
    {"pair_stats", (PyCFunction)(void (*)(void))pair_stats, METH_FASTCALL,
     "pair_stats(nat, x, out): removed natural mass, margin and a special flag of each row pair"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rowstats", NULL, -1, methods};

PyMODINIT_FUNC PyInit__rowstats(void) { return PyModule_Create(&module); }
