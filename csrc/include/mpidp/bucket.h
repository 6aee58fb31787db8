/* Gradient bucket layout.
 *
 * Parameters are grouped into buckets that are reduced with one collective
 * each. The plan walks the parameters in reverse registration order (the order
 * in which backward usually produces their gradients), keeps one open bucket
 * per dtype, and closes a bucket when the next parameter would push it past
 * its byte cap: a small cap for the very first bucket (so communication starts
 * early in backward) and a larger one after. A parameter bigger than the cap
 * gets a bucket of its own. Bucket indices are the order in which buckets are
 * opened, which is the order they are posted in, on every rank. */
#ifndef MPIDP_BUCKET_H
#define MPIDP_BUCKET_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    size_t numel;       /* elements of gradient data (sum over its parameters) */
    size_t n_params;
    int dtype;          /* mpidp_dtype_t of every parameter in the bucket */
} mpidp_bucket_info_t;

/* Plans buckets for `n_params` parameters given in registration order.
 *
 * Inputs: numel[i] and dtype[i] (mpidp_dtype_t) of each parameter;
 * first_cap_bytes and cap_bytes (> 0). Outputs, all caller-allocated with
 * n_params entries: out_bucket[i] (bucket of parameter i), out_offset[i] (its
 * element offset inside the bucket), buckets[b] for b < *out_n_buckets.
 * Within a bucket, parameters are laid out in the order they were added
 * (reverse registration order). Zero-element parameters still get a bucket
 * slot so that every parameter has one. Returns MPIDP_EINVAL (with a detail)
 * for a NULL pointer, an unknown dtype or a zero cap; outputs are then
 * unspecified. */
int mpidp_bucket_plan(const size_t *numel, const int *dtype, size_t n_params,
                      size_t first_cap_bytes, size_t cap_bytes, uint32_t *out_bucket,
                      size_t *out_offset, mpidp_bucket_info_t *buckets,
                      size_t *out_n_buckets);

#endif /* MPIDP_BUCKET_H */
