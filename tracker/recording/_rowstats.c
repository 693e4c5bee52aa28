/* Row statistics of float32 logits in two passes over each row (tracker.recording.record_stats' CPU path).
 *
 * A row kept in float16, bfloat16 or top-k storage gets its statistics (log-sum-exp, entropy, maximum, allowed
 * count, against the natural row the removed mass and margin, and the chosen token's rank) and its top k as
 * it is recorded, on the step's thread: inside a serving engine, for every tracked row of the batch at every
 * step. Spelled with numpy each statistic is its own pass over the rows (and torch's CPU kernels were slower
 * still here); here one pass finds the maxima and counts, a second computes exp once per token and every sum
 * at once (exp by a polynomial the compiler vectorises, sums carried in double), and the top k are kept in a
 * small sorted buffer while a vector comparison skips the tokens below its smallest.
 *
 * Functions (each takes C-contiguous buffers, releases the interpreter lock while it runs):
 *   row_stats(x, eos, out)       x [B, V] float32; eos [1, E] int64 (ids in the row) or None; out [B, 8]
 *                                float32 in record_stats.ROW_STATS order: lse, allowed, max, entropy, NaN count,
 *                                p_eos (NaN without eos), and NaN for the two statistics of a pair; returns the
 *                                count of special rows
 *   pair_stats(nat, x, out)      nat, x [B, V] float32; out [B, 3] float32: removed mass, margin, special
 *   top_k(x, values, ids)        x [B, V] float32; values [B, k] float32, ids [B, k] int64: each row's k largest
 *                                entries, largest first, NaN never chosen while k others remain
 *   chosen_stats(x, ids, stats, kept, out)  x [B, V] float32, ids [B, 1] int64, stats [B, >= 2] float32 (each
 *                                row's log-sum-exp and allowed count), kept [B, k] float32 (each row's largest
 *                                values, largest first) or None; out [B, 3] float32: the chosen token's logit,
 *                                probability and rank (NaN never greater; counted among the kept values when
 *                                it is at least their last); an id outside the row gives NaN
 *   half_rows(x, offset, bits, lse, kind)  x [B, V] float32, offset [B, 1] float32 (each row's largest value);
 *                                bits [B, V] int16: x - offset rounded to float16 (kind 0, where FLOAT16 is 1: a
 *                                CPU with F16C) or bfloat16 (kind 1), to nearest even as torch rounds; lse [B, 1]
 *                                float32: the log-sum-exp of the rounded values (-inf where every one is -inf);
 *                                returns the count of rows holding NaN or +inf (their lse NaN, their bits not
 *                                to be used)
 * A row is "special" when it holds NaN or +inf (row_stats: its max is +inf or its NaN count not 0, its
 * other values left unset; pair_stats: 1.0 in its flag): the caller computes those rows another way. -inf tokens are masked: they weigh nothing and are not allowed.
 *
 * Built by setup.py as an optional extension: where it cannot be built, record_stats computes the same
 * values with torch's kernels (the statistics equal within float32 rounding, the top k's values exactly).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdarg.h>
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

/* One row: x - offset rounded into bits (to nearest even, as torch rounds), and the log-sum-exp of the
 * rounded values (all <= 0 when offset is the row's largest value; clamped to [-87, 0] for exp, as exp_sums
 * does). bfloat16 by its bits; float16 by F16C's conversions (one instruction each way for eight lanes),
 * where the CPU has them (a CPU without: record_stats rounds with torch). */
typedef uint32_t vu __attribute__((vector_size(32)));
typedef uint16_t vb __attribute__((vector_size(16)));

static inline __attribute__((always_inline)) vf round_bf16(vf a, int16_t *bits) {
    vu u = (vu)a; /* a NaN may round to inf here: half_row flags its row, whose bits are not used */
    u = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    vb h = __builtin_convertvector(u, vb);
    memcpy(bits, &h, sizeof h);
    return (vf)(u << 16);
}

static inline __attribute__((always_inline)) vf weight(vf r) { /* e^r of a rounded value, 0 for -inf */
    vf z = vsel(r > splat(0.0f), splat(0.0f), vmax(r, splat(-87.0f)));
    return vsel(r > splat(-INFINITY), exp_neg(z), splat(0.0f));
}

static inline __attribute__((always_inline)) float half_row(const float *x, Py_ssize_t v, float offset,
                                                            int16_t *bits, vf (*round)(vf, int16_t *)) {
    const vf shift = splat(offset), pinf = splat(INFINITY);
    Py_ssize_t i = 0, whole = v - v % LANES;
    vi odd = {0}; /* a NaN or +inf entry: the caller's other path */
    double s = 0.0;
    while (i < whole) {
        vf bs = splat(0.0f);
        for (Py_ssize_t end = i + BLOCK < whole ? i + BLOCK : whole; i < end; i += LANES) {
            vf a = load(x + i);
            odd |= (a != a) | (a == pinf);
            bs += weight(round(a - shift, bits + i));
        }
        for (int l = 0; l < LANES; l++)
            s += bs[l];
    }
    if (i < v) { /* the row's last tokens, padded with -inf */
        float tail[LANES];
        int16_t tail_bits[LANES];
        for (int l = 0; l < LANES; l++)
            tail[l] = i + l < v ? x[i + l] : -INFINITY;
        vf a = load(tail);
        odd |= (a != a) | (a == pinf);
        vf e = weight(round(a - shift, tail_bits));
        memcpy(bits + i, tail_bits, (size_t)(v - i) * sizeof *bits);
        for (int l = 0; l < LANES; l++)
            s += e[l];
    }
    for (int l = 0; l < LANES; l++)
        if (odd[l])
            return NAN;
    return s > 0.0 ? (float)log(s) : -INFINITY;
}

VECTOR_CLONES
static float bf16_row(const float *x, Py_ssize_t v, float offset, int16_t *bits) {
    return half_row(x, v, offset, bits, round_bf16);
}

#if defined(__GNUC__) && !defined(__clang__) && (defined(__x86_64__) || defined(_M_X64))
#include <immintrin.h>
#define HAVE_F16C 1
__attribute__((target("avx2,f16c"), always_inline)) static inline vf round_f16(vf a, int16_t *bits) {
    __m128i h = _mm256_cvtps_ph((__m256)a, _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128((__m128i *)bits, h);
    return (vf)_mm256_cvtph_ps(h);
}

__attribute__((target("avx2,f16c"))) static float f16_row(const float *x, Py_ssize_t v, float offset,
                                                           int16_t *bits) {
    return half_row(x, v, offset, bits, round_f16);
}
#else
#define HAVE_F16C 0
#endif

static int float16_here(void) {
#if HAVE_F16C
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
#else
    return 0;
#endif
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

/* The k largest entries of a row, largest first, into values/ids (k <= v). NaN is never taken while there are k
 * other entries (then NaN entries stand for -inf, as nothing else is left). Ties: the lower id first.
 *
 * A first pass folds the row into v / 16 group maxima (group j: the tokens j + g r, r < 16, an elementwise maximum
 * of sixteen contiguous slabs); the k-th largest of them is a floor that at least k tokens reach, so the top k are
 * among the tokens at or above it. A second pass keeps those in a sorted buffer, vector comparisons skipping
 * 32 tokens at a time while none reaches the floor (later, the buffer's smallest). */
VECTOR_CLONES
static float group_floor(const float *x, Py_ssize_t v, Py_ssize_t k, float *maxima) {
    Py_ssize_t groups = v / 16, j = 0;
    for (; j + LANES <= groups; j += LANES) {
        vf m = load(x + j);
        for (Py_ssize_t r = 1; r < 16; r++)
            m = vmax(load(x + j + r * groups), m); /* a NaN lane never wins a comparison: it is skipped */
        memcpy(maxima + j, &m, sizeof m);
    }
    for (; j < groups; j++) {
        float m = x[j];
        m = m == m ? m : -INFINITY;
        for (Py_ssize_t r = 1; r < 16; r++)
            m = x[j + r * groups] > m ? x[j + r * groups] : m;
        maxima[j] = m;
    }
    for (j = 0; j < groups; j++) /* a NaN first slab lane: its group's maximum is the others' */
        maxima[j] = maxima[j] == maxima[j] ? maxima[j] : -INFINITY;
    Py_ssize_t lo = 0, hi = groups - 1, want = k - 1; /* quickselect: the k-th largest of the maxima */
    while (lo < hi) {
        float pivot = maxima[(lo + hi) / 2];
        Py_ssize_t a = lo, b = hi;
        while (a <= b) {
            while (maxima[a] > pivot)
                a++;
            while (maxima[b] < pivot)
                b--;
            if (a <= b) {
                float swap = maxima[a];
                maxima[a++] = maxima[b];
                maxima[b--] = swap;
            }
        }
        if (want <= b)
            hi = b;
        else if (want >= a)
            lo = a;
        else
            break;
    }
    return maxima[want];
}

/* Whether any lane of a comparison's mask is set (four 64-bit words OR-ed: no lane extracted one by one). */
static inline int lanes_any(vi m) {
    uint64_t w[4];
    memcpy(w, &m, sizeof w);
    return (w[0] | w[1] | w[2] | w[3]) != 0;
}

#define SKIP (4 * LANES) /* tokens a skip test covers */

VECTOR_CLONES
static void row_top_k(const float *x, Py_ssize_t v, Py_ssize_t k, float *values, int64_t *ids, float *maxima) {
    float floor = maxima != NULL ? group_floor(x, v, k, maxima) : -INFINITY;
    Py_ssize_t filled = 0, i = 0;
    float low = floor;
    vf bar = splat(low);
    while (i < v) {
        if (i + SKIP <= v) { /* skip 32 tokens below the bar at once */
            const float *p = x + i;
            vi above = filled < k ? (load(p) >= bar) | (load(p + LANES) >= bar) | (load(p + 2 * LANES) >= bar) |
                                        (load(p + 3 * LANES) >= bar)
                                  : (load(p) > bar) | (load(p + LANES) > bar) | (load(p + 2 * LANES) > bar) |
                                        (load(p + 3 * LANES) > bar);
            if (!lanes_any(above)) {
                i += SKIP;
                continue;
            }
        }
        Py_ssize_t end = i + SKIP <= v ? i + SKIP : v;
        for (; i < end; i++) {
            float a = x[i];
            if (filled < k ? !(a >= low) : !(a > low))
                continue;
            Py_ssize_t j = filled < k ? filled++ : k - 1;
            for (; j > 0 && values[j - 1] < a; j--) {
                values[j] = values[j - 1];
                ids[j] = ids[j - 1];
            }
            values[j] = a;
            ids[j] = i;
            if (filled == k) {
                low = values[k - 1];
                bar = splat(low);
            }
        }
    }
    for (Py_ssize_t j = 0; filled < k && j < v; j++) /* fewer than k entries that are not NaN: NaN ones last */
        if (x[j] != x[j]) {
            values[filled] = -INFINITY;
            ids[filled++] = j;
        }
}

/* Entries of a row greater than value (NaN never greater). */
VECTOR_CLONES
static Py_ssize_t row_count_above(const float *x, Py_ssize_t v, float value) {
    const vf bar = splat(value);
    Py_ssize_t n = 0, i = 0;
    while (i + LANES <= v) { /* int32 lane counts, flushed every 2^20 tokens */
        vi c = {0};
        Py_ssize_t end = i + (1 << 20) <= v ? i + (1 << 20) : v - (v - i) % LANES;
        for (; i < end; i += LANES)
            c += load(x + i) > bar;
        n += lane_count(c);
    }
    for (; i < v; i++)
        n += x[i] > value;
    return n;
}

/* The buffers of a call, from a spec of one letter per argument: f a float32, q an int64, h an int16 array
 * (2-D, C-contiguous; upper case: written to; a '?' after it: None is allowed, its view left empty), i an
 * argument that is not a buffer. 0, or -1 with an exception set and no buffer held. */
static void release(Py_buffer *views, int n) {
    for (int i = 0; i < n; i++)
        if (views[i].obj != NULL)
            PyBuffer_Release(&views[i]);
}

static int get_all(const char *call, const char *spec, const char *const *names, PyObject *const *args,
                   Py_ssize_t nargs, Py_buffer *views) {
    int n = 0;
    for (const char *c = spec; *c; c++)
        n += *c != '?';
    if (nargs != n) {
        PyErr_Format(PyExc_TypeError, "%s takes %d arguments, got %zd", call, n, nargs);
        return -1;
    }
    for (int i = 0; *spec; spec++, i++) {
        char type = (char)(*spec | 0x20); /* lower case */
        int writable = *spec != type, optional = spec[1] == '?';
        spec += optional;
        views[i].obj = NULL;
        if (type == 'i' || (optional && args[i] == Py_None))
            continue;
        const char *want = type == 'f' ? "float32" : type == 'q' ? "int64" : "int16";
        Py_ssize_t size = type == 'f' ? 4 : type == 'q' ? 8 : 2;
        int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_ND | (writable ? PyBUF_WRITABLE : 0);
        if (PyObject_GetBuffer(args[i], &views[i], flags) < 0) {
            views[i].obj = NULL;
            release(views, i);
            return -1;
        }
        const char *format = views[i].format == NULL ? "" : views[i].format;
        int same = type == 'q' ? strcmp(format, "l") == 0 || strcmp(format, "q") == 0 : format[0] == type && !format[1];
        if (views[i].ndim != 2 || views[i].itemsize != size || !same) {
            PyErr_Format(PyExc_ValueError, "%s: a 2-D C-contiguous %s array is needed", names[i], want);
            release(views, i + 1);
            return -1;
        }
    }
    return 0;
}

/* ValueError(format, ...) with the call's buffers released. */
static PyObject *refuse(Py_buffer *views, int n, const char *format, ...) {
    release(views, n);
    va_list args;
    va_start(args, format);
    PyErr_FormatV(PyExc_ValueError, format, args);
    va_end(args);
    return NULL;
}

static PyObject *row_stats(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    static const char *const names[] = {"x", "eos", "out"};
    Py_buffer vw[3];
    if (get_all("row_stats(x, eos, out)", "fq?F", names, args, nargs, vw) < 0)
        return NULL;
    int has_eos = vw[1].obj != NULL;
    Py_ssize_t b = vw[0].shape[0], v = vw[0].shape[1], n_eos = has_eos ? vw[1].shape[1] : 0;
    const int64_t *eos = has_eos ? (const int64_t *)vw[1].buf : NULL;
    int bad = vw[2].shape[0] != b || vw[2].shape[1] != 8 || (has_eos && vw[1].shape[0] != 1);
    for (Py_ssize_t j = 0; j < n_eos && !bad; j++)
        bad = eos[j] < 0 || eos[j] >= v;
    if (bad)
        return refuse(vw, 3, "row_stats: out (%zd, 8) and eos (1, E) of ids in [0, %zd) or None needed", b, v);
    const float *x = (const float *)vw[0].buf;
    float *out = (float *)vw[2].buf;
    Py_ssize_t special = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t r = 0; r < b; r++) {
        const float *row = x + r * v;
        float *o = out + r * 8;
        float top;
        Py_ssize_t nan, posinf, neginf;
        scan(row, v, &top, &nan, &posinf, &neginf);
        o[1] = (float)(v - neginf);
        o[2] = top;
        o[4] = (float)nan;
        o[5] = o[6] = o[7] = NAN;
        if (nan || posinf) {
            special++; /* its top is +inf or its NaN count not 0 */
            continue;
        }
        if (top == -INFINITY) { /* nothing allowed */
            o[0] = -INFINITY;
            o[3] = NAN;
            o[5] = has_eos ? 0.0f : NAN;
            continue;
        }
        double total, weighted;
        exp_sums(row, v, top, &total, &weighted);
        double log_total = log(total);
        float lse = (float)((double)top + log_total);
        o[0] = lse;
        o[3] = (float)(log_total - weighted / total);
        if (has_eos) {
            float p = 0.0f; /* a masked EOS weighs 0 */
            for (Py_ssize_t j = 0; j < n_eos; j++)
                p += row[eos[j]] > -INFINITY ? expf(row[eos[j]] - lse) : 0.0f;
            o[5] = p;
        }
    }
    Py_END_ALLOW_THREADS
    release(vw, 3);
    return PyLong_FromSsize_t(special);
}

static PyObject *pair_stats(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    static const char *const names[] = {"nat", "x", "out"};
    Py_buffer vw[3];
    if (get_all("pair_stats(nat, x, out)", "ffF", names, args, nargs, vw) < 0)
        return NULL;
    Py_ssize_t b = vw[0].shape[0], v = vw[0].shape[1];
    if (vw[1].shape[0] != b || vw[1].shape[1] != v || vw[2].shape[0] != b || vw[2].shape[1] != 3)
        return refuse(vw, 3, "pair_stats: nat and x must have one shape (%zd, %zd), out (%zd, 3)", b, v, b);
    const float *nat = (const float *)vw[0].buf, *x = (const float *)vw[1].buf;
    float *out = (float *)vw[2].buf;
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
    release(vw, 3);
    Py_RETURN_NONE;
}

static PyObject *top_k(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    static const char *const names[] = {"x", "values", "ids"};
    Py_buffer vw[3];
    if (get_all("top_k(x, values, ids)", "fFQ", names, args, nargs, vw) < 0)
        return NULL;
    Py_ssize_t b = vw[0].shape[0], v = vw[0].shape[1], k = vw[1].shape[1];
    if (vw[1].shape[0] != b || vw[2].shape[0] != b || vw[2].shape[1] != k || k < 1 || k > v)
        return refuse(vw, 3, "top_k: values and ids must have one shape (%zd, k) with 1 <= k <= %zd", b, v);
    const float *x = (const float *)vw[0].buf;
    float *values = (float *)vw[1].buf;
    int64_t *ids = (int64_t *)vw[2].buf;
    float *maxima = v / 16 >= 2 * k ? PyMem_RawMalloc((size_t)(v / 16) * sizeof(float)) : NULL; /* else one pass */
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t r = 0; r < b; r++)
        row_top_k(x + r * v, v, k, values + r * k, ids + r * k, maxima);
    Py_END_ALLOW_THREADS
    PyMem_RawFree(maxima);
    release(vw, 3);
    Py_RETURN_NONE;
}

static PyObject *chosen_stats(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    static const char *const names[] = {"x", "ids", "stats", "kept", "out"};
    Py_buffer vw[5];
    if (get_all("chosen_stats(x, ids, stats, kept, out)", "fqff?F", names, args, nargs, vw) < 0)
        return NULL;
    int has_kept = vw[3].obj != NULL;
    Py_ssize_t b = vw[0].shape[0], v = vw[0].shape[1], k = has_kept ? vw[3].shape[1] : 0, s = vw[2].shape[1];
    if (vw[1].shape[0] != b || vw[1].shape[1] != 1 || vw[2].shape[0] != b || s < 2 || vw[4].shape[0] != b ||
        vw[4].shape[1] != 3 || (has_kept && (vw[3].shape[0] != b || k < 1)))
        return refuse(vw, 5, "chosen_stats: ids (%zd, 1), stats (%zd, >= 2), kept (%zd, >= 1) or None, out (%zd, 3) needed",
                      b, b, b, b);
    const float *x = (const float *)vw[0].buf, *stats = (const float *)vw[2].buf;
    const float *kept = has_kept ? (const float *)vw[3].buf : NULL;
    const int64_t *ids = (const int64_t *)vw[1].buf;
    float *out = (float *)vw[4].buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t r = 0; r < b; r++) {
        float *o = out + r * 3, lse = stats[r * s], allowed = stats[r * s + 1];
        if (ids[r] < 0 || ids[r] >= v) {
            o[0] = o[1] = o[2] = NAN;
            continue;
        }
        float value = x[r * v + ids[r]];
        if (isnan(value))
            value = -INFINITY; /* a NaN entry weighs 0: it ranks after every allowed token */
        Py_ssize_t rank = 0;
        if (kept != NULL && value >= kept[r * k + k - 1]) /* among the kept values: none outside is larger */
            for (Py_ssize_t j = 0; j < k; j++)
                rank += kept[r * k + j] > value;
        else
            rank = row_count_above(x + r * v, v, value);
        float p = expf(value - lse); /* in float32, as the torch kernels of an accelerator compute it */
        if (lse == INFINITY) { /* a row holding +inf: a one-hot on its +inf tokens, every other token after them */
            rank = value == INFINITY ? 0 : (Py_ssize_t)allowed;
            p = value == INFINITY ? 1.0f / (allowed > 1.0f ? allowed : 1.0f) : 0.0f;
        }
        o[0] = value;
        o[1] = isnan(p) ? 0.0f : p; /* nothing allowed: a masked token's probability is 0 */
        o[2] = (float)rank;
    }
    Py_END_ALLOW_THREADS
    release(vw, 5);
    Py_RETURN_NONE;
}

static PyObject *half_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    static const char *const names[] = {"x", "offset", "bits", "lse", "kind"};
    Py_buffer vw[5];
    if (get_all("half_rows(x, offset, bits, lse, kind)", "ffHFi", names, args, nargs, vw) < 0)
        return NULL;
    long kind = PyLong_AsLong(args[4]);
    if (kind == -1 && PyErr_Occurred()) {
        release(vw, 5);
        return NULL;
    }
    if ((kind != 0 || !float16_here()) && kind != 1)
        return refuse(vw, 5, "half_rows: kind must be %s1 (bfloat16), got %ld", float16_here() ? "0 (float16) or " : "",
                      kind);
    Py_ssize_t b = vw[0].shape[0], v = vw[0].shape[1];
    if (vw[1].shape[0] != b || vw[1].shape[1] != 1 || vw[2].shape[0] != b || vw[2].shape[1] != v ||
        vw[3].shape[0] != b || vw[3].shape[1] != 1)
        return refuse(vw, 5, "half_rows: offset (%zd, 1), bits (%zd, %zd) and lse (%zd, 1) needed", b, b, v, b);
    const float *x = (const float *)vw[0].buf, *offset = (const float *)vw[1].buf;
    int16_t *bits = (int16_t *)vw[2].buf;
    float *lse = (float *)vw[3].buf;
    Py_ssize_t odd = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t r = 0; r < b; r++) {
#if HAVE_F16C
        if (kind == 0) {
            lse[r] = f16_row(x + r * v, v, offset[r], bits + r * v);
            odd += isnan(lse[r]);
            continue;
        }
#endif
        lse[r] = bf16_row(x + r * v, v, offset[r], bits + r * v);
        odd += isnan(lse[r]);
    }
    Py_END_ALLOW_THREADS
    release(vw, 5);
    return PyLong_FromSsize_t(odd);
}

static PyMethodDef methods[] = {
    {"row_stats", (PyCFunction)(void (*)(void))row_stats, METH_FASTCALL,
     "row_stats(x, eos, out): lse, allowed count, max, entropy, NaN count and p_eos of each float32 row"},
    {"pair_stats", (PyCFunction)(void (*)(void))pair_stats, METH_FASTCALL,
     "pair_stats(nat, x, out): removed natural mass, margin and a special flag of each row pair"},
    {"top_k", (PyCFunction)(void (*)(void))top_k, METH_FASTCALL,
     "top_k(x, values, ids): the k largest entries of each float32 row, largest first, NaN never chosen"},
    {"chosen_stats", (PyCFunction)(void (*)(void))chosen_stats, METH_FASTCALL,
     "chosen_stats(x, ids, stats, kept, out): each row's chosen token's logit, probability and rank"},
    {"half_rows", (PyCFunction)(void (*)(void))half_rows, METH_FASTCALL,
     "half_rows(x, offset, bits, lse, kind): rows minus offset rounded to float16 or bfloat16, their log-sum-exp"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rowstats", NULL, -1, methods};

PyMODINIT_FUNC PyInit__rowstats(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "FLOAT16", float16_here()) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
