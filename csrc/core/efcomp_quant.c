/* Error-feedback compression: the statistical n-bit quantizer and the
 * packing of its codes (mpidp/efcomp.h; the arithmetic is written out in
 * docs/error-feedback.md so that a reference can follow it exactly). */
#include <math.h>
#include <string.h>

#include "fail.h"
#include "mpidp/efcomp.h"
#include "mpidp/status.h"

int mpidp_ef_code_bits(int bins)
{
    return bins <= 2 ? 1 : bins <= 4 ? 2 : bins <= 16 ? 4 : 8;
}

int mpidp_ef_quantize(const float *v, int64_t n, int bins, double range, uint8_t *codes,
                      float *mu, float *lookup)
{
    if (bins < 2 || bins > MPIDP_EF_MAX_BINS)
        return mpidp__fail(MPIDP_EINVAL, "bins: expected 2 .. %d, got %d", MPIDP_EF_MAX_BINS,
                           bins);
    if (!(range > 0) || !isfinite(range))
        return mpidp__fail(MPIDP_EINVAL, "range: expected a positive finite number, got %g",
                           range);
    if (n < 0 || mu == NULL || lookup == NULL || (n > 0 && (v == NULL || codes == NULL)))
        return mpidp__fail(MPIDP_EINVAL, "quantize: NULL argument");
    double sum = 0.0;
    for (int64_t i = 0; i < n; i++) sum += v[i];
    float m = n > 0 ? (float)(sum / (double)n) : 0.0f;
    double squares = 0.0;
    for (int64_t i = 0; i < n; i++) {
        double c = (double)(v[i] - m);
        squares += c * c;
    }
    double sigma = n > 1 ? sqrt(squares / (double)(n - 1)) : 0.0;
    double step = range * sigma / bins;
    if (!(step > 0) || !isfinite(step)) step = 1.0;
    double bin_sum[MPIDP_EF_MAX_BINS] = {0};
    int64_t bin_count[MPIDP_EF_MAX_BINS] = {0};
    for (int64_t i = 0; i < n; i++) {
        float c = v[i] - m;
        double x = rint((double)c / step + bins / 2.0); /* half to even */
        int q = x != x ? 0 : x < 0 ? 0 : x > bins - 1 ? bins - 1 : (int)x;
        codes[i] = (uint8_t)q;
        bin_sum[q] += c;
        bin_count[q]++;
    }
    for (int b = 0; b < bins; b++)
        lookup[b] = bin_count[b] ? (float)(bin_sum[b] / (double)bin_count[b]) : 0.0f;
    *mu = m;
    return MPIDP_OK;
}

void mpidp_ef_pack_codes(const uint8_t *codes, int64_t n, int bits, uint8_t *out)
{
    int per = 8 / bits;
    int64_t bytes = (n * bits + 7) / 8;
    memset(out, 0, (size_t)bytes);
    for (int64_t i = 0; i < n; i++)
        out[i / per] |= (uint8_t)(codes[i] << ((i % per) * bits));
}

int mpidp_ef_unpack_codes(const uint8_t *in, int64_t n, int bits, int bins, uint8_t *codes)
{
    int per = 8 / bits;
    unsigned mask = (1u << bits) - 1u;
    for (int64_t i = 0; i < n; i++) {
        unsigned q = (in[i / per] >> ((i % per) * bits)) & mask;
        if ((int)q >= bins)
            return mpidp__fail(MPIDP_EINVAL, "payload: code %u at entry %lld is outside the %d "
                               "bins", q, (long long)i, bins);
        codes[i] = (uint8_t)q;
    }
    return MPIDP_OK;
}
