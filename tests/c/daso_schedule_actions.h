/* Equality of two DASO schedule actions, shared by the schedule's C tests
 * (test_daso_schedule_fuzz.c) and its fuzz harness (tests/fuzz/fuzz_schedule.c
 * includes it by path). */
#ifndef MPIDP_TEST_SCHEDULE_ACTIONS_H
#define MPIDP_TEST_SCHEDULE_ACTIONS_H

#include "mpidp/daso_schedule.h"

/* 1 when every field of a and b is equal. Field by field, because the struct
 * has padding between its int and int64_t fields that memcmp would compare. */
static inline int same_actions(const mpidp_schedule_actions_t *a,
                               const mpidp_schedule_actions_t *b)
{
    return a->complete == b->complete && a->complete_group == b->complete_group &&
           a->complete_btw == b->complete_btw && a->send == b->send &&
           a->send_group == b->send_group && a->send_btw == b->send_btw &&
           a->send_blocking == b->send_blocking && a->local_sync == b->local_sync &&
           a->epoch_done == b->epoch_done;
}

#endif /* MPIDP_TEST_SCHEDULE_ACTIONS_H */
