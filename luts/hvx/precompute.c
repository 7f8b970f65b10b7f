/* Precompute: the spec's int16 tables, built in scalar fp32 (qemu's HVX has no float; on the
 * device this is a few hundred scalar cycles per token, shared by every GEMV that reads x).
 * Hexagon has no divide instruction and freestanding code has no libgcc, so the two divisions
 * the spec needs are done here exactly: restoring division of the significands, rounded to
 * nearest even. Compiled with -ffp-contract=off: the sums follow the spec's operation order.
 */
#include "lut_hvx.h"

typedef union { float f; uint32_t u; } fbits;

/* a / b, correctly rounded, for positive finite nonzero a and b. */
static float divide(float a, float b) {
    fbits fa = {a}, fb = {b}, out;
    int ea = (int)(fa.u >> 23), eb = (int)(fb.u >> 23);
    uint32_t ma = fa.u & 0x7FFFFF, mb = fb.u & 0x7FFFFF;
    if (ea) ma |= 0x800000; else for (ea = 1; !(ma & 0x800000); ea--) ma <<= 1;
    if (eb) mb |= 0x800000; else for (eb = 1; !(mb & 0x800000); eb--) mb <<= 1;
    int e = ea - eb + 127; /* biased exponent of a quotient in [1, 2) */
    if (ma < mb) ma <<= 1, e--;
    uint32_t q = 0, r = ma;
    for (int i = 0; i < 26; i++) { /* 24 significand bits, a guard bit and a round bit */
        q <<= 1;
        if (r >= mb) r -= mb, q |= 1;
        r <<= 1;
    }
    int drop = 2 + (e < 1 ? 1 - e : 0); /* a subnormal result keeps fewer bits */
    if (e < 1) e = 0;
    if (drop > 26) return 0.0f;
    uint32_t rest = q & ((1u << drop) - 1), half = 1u << (drop - 1);
    q >>= drop;
    out.u = (e ? ((uint32_t)e << 23) - 0x800000 : 0) + q; /* q carries the implicit bit when e > 0 */
    if (rest > half || (rest == half && (r || (q & 1)))) out.u++; /* a carry moves into the exponent */
    if (e >= 255 || out.u >= 0x7F800000) out.u = 0x7F800000;
    return out.f;
}

/* Round half to even for |v| < 2^23: adding 2^23 leaves no fraction bits in fp32. */
static int round_even(float v) {
    const float big = 8388608.0f;
    return v >= 0 ? (int)((v + big) - big) : -(int)((-v + big) - big);
}

static float magnitude(float v) { return v < 0 ? -v : v; }

void hvx_precompute(const float *x, int k, int group, const hvx_tables *t) {
    const int runs = group / 4;
    const float qmax = 32767.0f;
    float table[128 / 4][16];
    for (int g = 0; g < hvx_groups(k, group); g++) {
        float amax = 0.0f;
        for (int c = 0; c < runs; c++) {
            const float *xs = x + (size_t)(g * runs + c) * 4;
            for (int e = 1; e < 16; e += 2) { /* odd entries left to right; even ones mirrored */
                float v = xs[0];
                v = (e & 2) ? v + xs[1] : v - xs[1];
                v = (e & 4) ? v + xs[2] : v - xs[2];
                v = (e & 8) ? v + xs[3] : v - xs[3];
                table[c][e] = v, table[c][15 - e] = -v;
                if (magnitude(v) > amax) amax = magnitude(v);
            }
        }
        const float inv = amax > 0.0f ? divide(qmax, amax) : 0.0f;
        t->t_scales[g] = amax > 0.0f ? divide(amax, qmax) : 0.0f;
        int32_t sum = 0;
        for (int c = 0; c < runs; c++) {
            const int run = g * runs + c, sel = run & 3;
            int16_t *vec = t->tables + (size_t)(run >> 2) * 64;
            for (int e = 0; e < 16; e++)
                vec[2 * (16 * (sel & 1) + e) + (sel >> 1)] = (int16_t)round_even(table[c][e] * inv);
            sum += vec[2 * (16 * (sel & 1) + 15) + (sel >> 1)];
        }
        t->xq[g] = sum;
    }
}
