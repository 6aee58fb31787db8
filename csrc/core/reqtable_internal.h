/* Core-private: the request table's wait policy, for the C tests. */
#ifndef MPIDP_CORE_REQTABLE_INTERNAL_H
#define MPIDP_CORE_REQTABLE_INTERNAL_H

#include "mpidp/reqtable.h"

/* What a wait does before its next test, after `iteration` tests and
 * `waited` seconds with spin `spin`: test again at once (the first 64),
 * yield the core while the spin lasts, then sleep 100 us. Internal; the
 * wait loops' policy, exposed for the C tests. */
typedef enum { MPIDP__WAIT_TEST, MPIDP__WAIT_YIELD, MPIDP__WAIT_SLEEP } mpidp__wait_step_t;
mpidp__wait_step_t mpidp__wait_step(unsigned long iteration, double waited, double spin);

#endif /* MPIDP_CORE_REQTABLE_INTERNAL_H */
