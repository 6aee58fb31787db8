/* Gradient bucket layout (see mpidp/bucket.h for the rules). */
#include "mpidp/bucket.h"

#include "mpidp/status.h"
#include "mpidp/tensor.h"
#include "fail.h"

int mpidp_bucket_plan(const size_t *numel, const int *dtype, size_t n_params,
                      size_t first_cap_bytes, size_t cap_bytes, uint32_t *out_bucket,
                      size_t *out_offset, mpidp_bucket_info_t *buckets,
                      size_t *out_n_buckets)
{
    if (out_n_buckets == NULL || (n_params > 0 && (numel == NULL || dtype == NULL ||
                                                    out_bucket == NULL || out_offset == NULL ||
                                                    buckets == NULL)))
        return mpidp__fail(MPIDP_EINVAL, "bucket plan: NULL argument");
    if (first_cap_bytes == 0 || cap_bytes == 0)
        return mpidp__fail(MPIDP_EINVAL, "bucket plan: caps must be > 0 bytes");
    if (n_params > UINT32_MAX)
        return mpidp__fail(MPIDP_EINVAL, "bucket plan: too many parameters");

    /* One open bucket per dtype; -1 when none is open. */
    long open[MPIDP_N_DTYPES];
    for (int d = 0; d < MPIDP_N_DTYPES; d++) open[d] = -1;
    size_t n_buckets = 0;

    for (size_t k = 0; k < n_params; k++) {
        size_t i = n_params - 1 - k;
        int dt = dtype[i];
        size_t esize = mpidp_dtype_size(dt);
        if (esize == 0 || !mpidp_dtype_is_float(dt))
            return mpidp__fail(MPIDP_EINVAL, "bucket plan: parameter %zu has dtype %d, not a "
                               "floating-point one", i, dt);
        size_t bytes = numel[i] * esize;
        long b = open[dt];
        if (b >= 0) {
            /* The first bucket ever opened keeps the small cap. */
            size_t cap = (b == 0) ? first_cap_bytes : cap_bytes;
            size_t used = buckets[b].numel * esize;
            if (used + bytes > cap && buckets[b].n_params > 0) b = -1;
        }
        if (b < 0) {
            b = (long)n_buckets++;
            buckets[b].numel = 0;
            buckets[b].n_params = 0;
            buckets[b].dtype = dt;
            open[dt] = b;
        }
        out_bucket[i] = (uint32_t)b;
        out_offset[i] = buckets[b].numel;
        buckets[b].numel += numel[i];
        buckets[b].n_params++;
        /* A bucket already past its cap takes nothing more. */
        size_t cap = (b == 0) ? first_cap_bytes : cap_bytes;
        if (buckets[b].numel * esize >= cap) open[dt] = -1;
    }
    *out_n_buckets = n_buckets;
    return MPIDP_OK;
}
