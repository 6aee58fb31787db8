/* The bucket tensors a reducer's config takes, over plain host buffers laid
 * out as mpidp_bucket_plan planned them (C tests only). */
#ifndef MPIDP_TEST_BUCKET_TENSORS_H
#define MPIDP_TEST_BUCKET_TENSORS_H

#include "mpidp/bucket.h"
#include "mpidp/tensor.h"

static void bucket_tensors(mpidp_tensor_t *out, void *const *data, const mpidp_bucket_info_t *info,
                           size_t nb)
{
    for (size_t b = 0; b < nb; b++)
        out[b] = (mpidp_tensor_t){.data = data[b], .numel = info[b].numel + info[b].n_params,
                                  .dtype = (mpidp_dtype_t)info[b].dtype, .device = MPIDP_DEV_CPU};
}

#endif /* MPIDP_TEST_BUCKET_TENSORS_H */
