/* Core-private: how a core function records why it fails. */
#ifndef MPIDP_CORE_FAIL_H
#define MPIDP_CORE_FAIL_H

#include "mpidp/status.h"

/* Record a detail for the failure about to be returned; printf-style.
 * Returns `status` so callers can write `return mpidp__fail(MPIDP_EINVAL, ...)`. */
int mpidp__fail(int status, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

#endif /* MPIDP_CORE_FAIL_H */
