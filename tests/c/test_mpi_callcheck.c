/* mpidp_callcheck across real ranks (mpirun -np 2, also 3 and 4): a
 * repeated sequence of calls is exchanged once, then predicted on every
 * rank with its data right; a rank that leaves the sequence at any point
 * makes every rank see DIFFER (those that posted the prediction see it
 * while they wait, and their call completes on the others' scratch
 * buffers), after which the ranks go on in step; ranks that all leave it
 * differently, and a forced exchange, are told apart; polling a predicted
 * call (mpidp_callcheck_poll) resolves it as waiting does; a rank that
 * waits late (as part of its next call) is marked so in every rank's rows;
 * bad arguments are refused. The data call is an allgather of each rank's own values. */
#include <mpi.h>
#include <stdint.h>
#include <stdlib.h>

#include "mpidp/callcheck.h"
#include "mpidp/collectives.h"
#include "mpidp/status.h"
#include "mpi_world.h"
#include "test.h"

#define N 3 /* fields: call id, element count, a spare */
#define T 20.0

/* An allgather of n int64 per rank, each `value`: its buffers (recv:
 * size x n) and the core tensors over them. */
typedef struct {
    int64_t *send, *recv;
    mpidp_tensor_t s, r;
} gather_t;

static gather_t gather_of(size_t n, int64_t value)
{
    gather_t g = {calloc(n, sizeof(int64_t)), calloc(n * (size_t)size_, sizeof(int64_t)),
                  {0}, {0}};
    for (size_t i = 0; i < n; i++) g.send[i] = value;
    g.s = (mpidp_tensor_t){g.send, n, MPIDP_I64, MPIDP_DEV_CPU, 0, 1};
    g.r = (mpidp_tensor_t){g.recv, n * (size_t)size_, MPIDP_I64, MPIDP_DEV_CPU, 0, 0};
    return g;
}

static void gather_free(gather_t *g)
{
    free(g->send);
    free(g->recv);
}

/* How call() resolves a predicted call: waiting, polling, or waiting late
 * (as the backend does when the group's next call ends the call). */
enum { WAITING, POLLING, WAITING_LATE };
static int resolving = WAITING;

/* Polls until the predicted call `x` is resolved (deadline T). */
static int poll_until_resolved(mpidp_callcheck_t *c, mpidp_reqtable_t *reqs, mpidp_coll_t *x,
                               int *outcome)
{
    double end = MPI_Wtime() + T;
    int resolved = 0;
    while (!resolved && MPI_Wtime() < end) {
        int rc = mpidp_callcheck_poll(c, &mpidp_coll_operation, x, reqs, T, &resolved, outcome);
        if (rc != MPIDP_OK) return rc;
    }
    return resolved ? MPIDP_OK : MPIDP_ETIMEDOUT;
}

/* One call of signature {id, count, extra}: checked, then (unless the ranks
 * differ) an allgather of `count` int64 that each rank fills with its rank
 * and id. Where this rank did not post the prediction that others posted,
 * it completes their allgather on scratch buffers, as the backend does.
 * Returns the outcome (-1 when a step failed; *bad counts wrong values). */
static int call(mpidp_callcheck_t *c, mpidp_reqtable_t *reqs, int64_t id, int64_t count,
                int64_t extra, int *bad)
{
    int64_t sig[N] = {id, count, extra};
    int outcome = -1, ended = 0, posted = 0;
    if (mpidp_callcheck_begin(c, sig, 0, reqs, T, &outcome) != MPIDP_OK) return -1;
    gather_t g = gather_of((size_t)count, rank_ * 1000 + id);
    mpidp_coll_t *x = NULL;
    if (outcome != MPIDP_CALL_DIFFER) {
        if (mpidp_allgather_start(MPI_COMM_WORLD, &g.s, &g.r, reqs, &x) != MPIDP_OK) return -1;
        posted = outcome == MPIDP_CALL_PREDICTED;
        if (posted && (resolving == POLLING
                           ? poll_until_resolved(c, reqs, x, &outcome)
                           : mpidp_callcheck_wait(c, &mpidp_coll_operation, x, reqs, T,
                                                  resolving == WAITING_LATE, &outcome)) != MPIDP_OK)
            return -1;
        if (mpidp_operation_finish(&mpidp_coll_operation, x, T, &ended) != MPIDP_OK) return -1;
    }
    if (outcome == MPIDP_CALL_DIFFER && !posted) {
        /* Complete the prediction that other ranks posted, if any did. */
        const int64_t *rows = mpidp_callcheck_rows(c);
        for (int q = 0; q < size_; q++) {
            const int64_t *row = rows + (size_t)q * MPIDP_CALLCHECK_ROW(N);
            if (!row[MPIDP_CALLCHECK_POSTED(N)]) continue;
            gather_t scratch = gather_of((size_t)row[1], 0);
            if (mpidp_allgather_start(MPI_COMM_WORLD, &scratch.s, &scratch.r, reqs, &x) !=
                    MPIDP_OK ||
                mpidp_operation_finish(&mpidp_coll_operation, x, T, &ended) != MPIDP_OK)
                return -1;
            gather_free(&scratch);
            break;
        }
    }
    if (outcome != MPIDP_CALL_DIFFER)
        for (int q = 0; q < size_; q++)
            for (int64_t i = 0; i < count; i++)
                *bad += g.recv[(size_t)q * (size_t)count + (size_t)i] != q * 1000 + id;
    gather_free(&g);
    return outcome;
}

static mpidp_callcheck_t *check(mpidp_reqtable_t *reqs)
{
    mpidp_callcheck_t *c = NULL;
    mpidp_callcheck_create(MPI_COMM_WORLD, N, reqs, T, &c);
    return c;
}

/* A test's end: frees both; returns how many requests were still pending
 * (a call that left one in flight). */
static int teardown(mpidp_callcheck_t *c, mpidp_reqtable_t *reqs)
{
    int pending = (int)mpidp_reqtable_pending(reqs);
    mpidp_callcheck_destroy(c);
    mpidp_reqtable_destroy(reqs);
    return pending;
}

TEST(a_repeated_sequence_is_predicted_with_its_data_right)
{
    mpidp_reqtable_t *reqs = table(64);
    mpidp_callcheck_t *c = check(reqs);
    ASSERT_TRUE(c != NULL);
    static const int64_t ids[] = {1, 2, 1, 3}; /* 1 is followed by 2 or 3: two calls of context */
    int bad = 0;
    for (int step = 0; step < 6; step++)
        for (int k = 0; k < 4; k++) {
            int outcome = call(c, reqs, ids[k], 4 + ids[k], 0, &bad);
            /* Learnt: the first pass's contexts, then (1, 3) and (3, 1). */
            int learnt = step > 1 || (step == 1 && k > 1);
            ASSERT_EQ_INT(outcome, (learnt ? MPIDP_CALL_PREDICTED : MPIDP_CALL_AGREED));
        }
    ASSERT_EQ_INT(bad, 0);
    ASSERT_EQ_INT(teardown(c, reqs), 0);
}

TEST(a_long_cycle_of_distinct_calls_is_predicted_whole)
{
    mpidp_reqtable_t *reqs = table(64);
    mpidp_callcheck_t *c = check(reqs);
    ASSERT_TRUE(c != NULL);
    int bad = 0, predicted = 0;
    for (int pass = 0; pass < 3; pass++)
        for (int64_t k = 0; k < 60; k++) /* a bucket each, as DDP's */
            predicted += call(c, reqs, 10 + k, 1 + k % 7, 0, &bad) == MPIDP_CALL_PREDICTED;
    ASSERT_EQ_INT(predicted, 58 + 60); /* the second pass's first two contexts are new */
    ASSERT_EQ_INT(bad, 0);
    ASSERT_EQ_INT(teardown(c, reqs), 0);
}

/* Every rank, in turn, leaves a learnt sequence in each field (the body of
 * a test: its asserts fail the test that calls it). */
static void leave_the_sequence(int *mpidp__test_failed)
{
    mpidp_reqtable_t *reqs = table(64);
    mpidp_callcheck_t *c = check(reqs);
    ASSERT_TRUE(c != NULL);
    int bad = 0;
    for (int odd = 0; odd < size_; odd++)
        for (int field = 0; field < N; field++) {
            for (int step = 0; step < 3; step++) {
                call(c, reqs, 1, 5, 0, &bad);
                call(c, reqs, 2, 3, 0, &bad);
            }
            int64_t sig[N] = {1, 5, 0};
            if (rank_ == odd) sig[field] += 1;
            int outcome = call(c, reqs, sig[0], sig[1], sig[2], &bad);
            ASSERT_EQ_INT(outcome, size_ == 1 ? MPIDP_CALL_PREDICTED : MPIDP_CALL_DIFFER);
            if (size_ > 1) {
                const int64_t *rows = mpidp_callcheck_rows(c);
                for (int q = 0; q < size_; q++) {
                    const int64_t *row = rows + (size_t)q * MPIDP_CALLCHECK_ROW(N);
                    ASSERT_EQ_INT((int)row[field], (int)(field == 0 ? 1 : field == 1 ? 5 : 0) +
                                                       (q == odd));
                    /* The others posted the prediction, unless the odd rank's
                     * notification came before they began. */
                    if (q == odd) ASSERT_EQ_INT((int)row[MPIDP_CALLCHECK_POSTED(N)], 0);
                    /* How those that posted it joined, on every rank. */
                    else if (row[MPIDP_CALLCHECK_POSTED(N)])
                        ASSERT_EQ_INT((int)row[MPIDP_CALLCHECK_POSTED(N)],
                                      resolving == WAITING_LATE ? MPIDP_CALLCHECK_POSTED_LATE
                                                                : MPIDP_CALLCHECK_POSTED_WAITING);
                    ASSERT_EQ_INT((int)row[MPIDP_CALLCHECK_TOLD(N)], (q == odd));
                }
            }
            /* In step again, from the context of a fresh start. */
            outcome = call(c, reqs, 2, 3, 0, &bad);
            ASSERT_TRUE(outcome == MPIDP_CALL_AGREED || outcome == MPIDP_CALL_PREDICTED);
        }
    ASSERT_EQ_INT(bad, 0);
    ASSERT_EQ_INT(teardown(c, reqs), 0);
}

TEST(a_rank_that_leaves_the_sequence_is_seen_by_every_rank)
{
    resolving = WAITING;
    leave_the_sequence(mpidp__test_failed);
}

TEST(a_rank_that_waits_late_is_marked_late_on_every_rank)
{
    resolving = WAITING_LATE;
    leave_the_sequence(mpidp__test_failed);
    resolving = WAITING;
}

TEST(polling_a_predicted_call_resolves_it_as_waiting_does)
{
    resolving = POLLING;
    leave_the_sequence(mpidp__test_failed);
    resolving = WAITING;
    mpidp_reqtable_t *reqs = table(8);
    int resolved = 0, outcome = -1;
    ASSERT_EQ_INT(mpidp_callcheck_poll(NULL, &mpidp_coll_operation, NULL, reqs, T, &resolved,
                                       &outcome),
                  MPIDP_EINVAL);
    mpidp_reqtable_destroy(reqs);
}

TEST(ranks_that_all_leave_it_differently_differ_and_nothing_was_posted)
{
    mpidp_reqtable_t *reqs = table(64);
    mpidp_callcheck_t *c = check(reqs);
    ASSERT_TRUE(c != NULL);
    int bad = 0;
    for (int step = 0; step < 3; step++) call(c, reqs, 1, 2, 0, &bad);
    int outcome = call(c, reqs, 9, 2, rank_, &bad);
    ASSERT_EQ_INT(outcome, size_ == 1 ? MPIDP_CALL_AGREED : MPIDP_CALL_DIFFER);
    const int64_t *rows = mpidp_callcheck_rows(c);
    for (int q = 0; q < size_; q++) {
        ASSERT_EQ_INT((int)rows[(size_t)q * MPIDP_CALLCHECK_ROW(N) + 2], q);
        ASSERT_EQ_INT((int)rows[(size_t)q * MPIDP_CALLCHECK_ROW(N) + MPIDP_CALLCHECK_POSTED(N)],
                      0);
    }
    /* From a fresh start's context, which predicts the first call ever made. */
    ASSERT_EQ_INT(call(c, reqs, 1, 2, 0, &bad), MPIDP_CALL_PREDICTED);
    ASSERT_EQ_INT(bad, 0);
    ASSERT_EQ_INT(teardown(c, reqs), 0);
}

TEST(a_forced_exchange_agrees_on_a_predicted_call)
{
    mpidp_reqtable_t *reqs = table(64);
    mpidp_callcheck_t *c = check(reqs);
    ASSERT_TRUE(c != NULL);
    int bad = 0;
    for (int step = 0; step < 3; step++) call(c, reqs, 4, 1, 0, &bad);
    int64_t sig[N] = {4, 1, 0};
    int outcome = -1;
    ASSERT_OK(mpidp_callcheck_begin(c, sig, 1, reqs, T, &outcome));
    ASSERT_EQ_INT(outcome, MPIDP_CALL_AGREED);
    ASSERT_EQ_INT(call(c, reqs, 4, 1, 0, &bad), MPIDP_CALL_PREDICTED);
    ASSERT_EQ_INT(bad, 0);
    ASSERT_EQ_INT(teardown(c, reqs), 0);
}

TEST(bad_arguments_are_refused)
{
    mpidp_reqtable_t *reqs = table(8);
    mpidp_callcheck_t *c = NULL;
    ASSERT_EQ_INT(mpidp_callcheck_create(MPI_COMM_WORLD, 0, reqs, T, &c), MPIDP_EINVAL);
    ASSERT_EQ_INT(mpidp_callcheck_create(MPI_COMM_WORLD, MPIDP_CALLCHECK_MAX_FIELDS + 1, reqs, T,
                                         &c),
                  MPIDP_EINVAL);
    ASSERT_TRUE(c == NULL);
    int outcome = -1;
    ASSERT_EQ_INT(mpidp_callcheck_begin(NULL, NULL, 0, reqs, T, &outcome), MPIDP_EINVAL);
    ASSERT_EQ_INT((int)mpidp_reqtable_pending(reqs), 0);
    mpidp_reqtable_destroy(reqs);
}

TEST_MAIN_MPI(a_repeated_sequence_is_predicted_with_its_data_right,
              a_long_cycle_of_distinct_calls_is_predicted_whole,
              a_rank_that_leaves_the_sequence_is_seen_by_every_rank,
              a_rank_that_waits_late_is_marked_late_on_every_rank,
              polling_a_predicted_call_resolves_it_as_waiting_does,
              ranks_that_all_leave_it_differently_differ_and_nothing_was_posted,
              a_forced_exchange_agrees_on_a_predicted_call, bad_arguments_are_refused)
