/* The peer exchange across real ranks (2, 3 and 4): each rank sends a
 * payload that names it and the iteration to the out-peers of a gossip graph
 * (mpidp/peer_graphs.h) and checks every byte received from each in-peer; messages
 * in pieces; two exchanges in flight at once, waited for in opposite orders
 * on even and odd ranks; a full request table (nothing posted); bad peers;
 * and a peer that never sends (a timeout that names the exchange). */
#include <mpi.h>
#include <stdlib.h>
#include <string.h>

#include "mpidp/mpiops.h"
#include "mpidp/peer_graphs.h"
#include "mpidp/peer_exchange.h"
#include "mpidp/status.h"
#include "mpi_world.h"
#include "test.h"


/* Byte i of rank r's payload at iteration t. */
static unsigned char payload(int r, int t, size_t i)
{
    return (unsigned char)(i * 31u + (unsigned)r * 7u + (unsigned)t * 101u + (i >> 8));
}

static void fill(unsigned char *buf, int r, int t, size_t n)
{
    for (size_t i = 0; i < n; i++) buf[i] = payload(r, t, i);
}

static size_t mismatches(const unsigned char *buf, int r, int t, size_t n)
{
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) bad += buf[i] != payload(r, t, i);
    return bad;
}

TEST(gossip_rounds_deliver_every_in_peers_payload)
{
    mpidp_reqtable_t *reqs = table(256);
    const size_t n = 1000;
    int kinds[] = {MPIDP_GRAPH_DDE, MPIDP_GRAPH_RING, MPIDP_GRAPH_RING_LR, MPIDP_GRAPH_SHIFT_ONE};
    for (size_t g_i = 0; g_i < sizeof kinds / sizeof kinds[0]; g_i++) {
        mpidp_graph_t g = {.kind = kinds[g_i], .world = size_, .peers_per_itr = 1};
        if (mpidp_graph_validate(&g) != MPIDP_OK) continue; /* shift_one at 3 ranks */
        for (int t = 0; t < 5; t++) {
            int out[MPIDP_GRAPH_MAX_PEERS], in[MPIDP_GRAPH_MAX_PEERS], n_out, n_in;
            ASSERT_OK(mpidp_graph_peers(&g, rank_, t, out, &n_out, in, &n_in));
            unsigned char send[1000], recv_store[2][1000];
            void *recv[2] = {recv_store[0], recv_store[1]};
            fill(send, rank_, t, n);
            memset(recv_store, 0, sizeof recv_store);
            mpidp_peerx_spec_t s = {.out = out, .n_out = n_out, .in = in, .n_in = n_in,
                                    .send = send, .recv = recv, .bytes = n,
                                    .piece_bytes = t % 2 ? 64 : 0, .what = "gossip round"};
            mpidp_peerx_t *x = NULL;
            ASSERT_OK(mpidp_peerx_start(MPI_COMM_WORLD, &s, reqs, &x));
            ASSERT_OK(mpidp_peerx_wait(x, 30.0));
            int done = 0;
            ASSERT_OK(mpidp_peerx_test(x, &done));
            ASSERT_EQ_INT(done, 1);
            ASSERT_OK(mpidp_peerx_free(x));
            for (int i = 0; i < n_in; i++) ASSERT_EQ_INT(mismatches(recv_store[i], in[i], t, n), 0);
        }
    }
    ASSERT_OK(mpidp_reqtable_destroy(reqs));
}

TEST(two_exchanges_in_flight_keep_their_messages_apart)
{
    mpidp_reqtable_t *reqs = table(64);
    if (size_ < 2) {
        mpidp_reqtable_destroy(reqs);
        return;
    }
    int next = (rank_ + 1) % size_, prev = (rank_ + size_ - 1) % size_;
    const size_t n = 300;
    unsigned char a_send[300], b_send[300], a_recv[300], b_recv[300];
    void *a_in[1] = {a_recv}, *b_in[1] = {b_recv};
    fill(a_send, rank_, 1, n);
    fill(b_send, rank_, 2, n);
    /* Both go to the same peer with the same sizes: only the tags differ. */
    mpidp_peerx_spec_t a = {.out = &next, .n_out = 1, .in = &prev, .n_in = 1, .send = a_send,
                            .recv = a_in, .bytes = n, .piece_bytes = 100};
    mpidp_peerx_spec_t b = a;
    b.send = b_send, b.recv = b_in;
    mpidp_peerx_t *xa = NULL, *xb = NULL;
    ASSERT_OK(mpidp_peerx_start(MPI_COMM_WORLD, &a, reqs, &xa));
    ASSERT_OK(mpidp_peerx_start(MPI_COMM_WORLD, &b, reqs, &xb));
    mpidp_peerx_t *first = rank_ % 2 ? xb : xa, *second = rank_ % 2 ? xa : xb;
    ASSERT_OK(mpidp_peerx_wait(first, 30.0));
    ASSERT_OK(mpidp_peerx_wait(second, 30.0));
    ASSERT_OK(mpidp_peerx_free(xa));
    ASSERT_OK(mpidp_peerx_free(xb));
    ASSERT_EQ_INT(mismatches(a_recv, prev, 1, n), 0);
    ASSERT_EQ_INT(mismatches(b_recv, prev, 2, n), 0);
    ASSERT_OK(mpidp_reqtable_destroy(reqs));
}

TEST(a_full_table_posts_nothing_and_bad_peers_are_refused)
{
    mpidp_reqtable_t *reqs = table(3);
    if (size_ < 2) {
        mpidp_reqtable_destroy(reqs);
        return;
    }
    int next = (rank_ + 1) % size_, prev = (rank_ + size_ - 1) % size_;
    unsigned char send[16] = {0}, recv[16];
    void *in[1] = {recv};
    /* 4 pieces x 2 requests > 3 slots. */
    mpidp_peerx_spec_t s = {.out = &next, .n_out = 1, .in = &prev, .n_in = 1, .send = send,
                            .recv = in, .bytes = 16, .piece_bytes = 4};
    mpidp_peerx_t *x = NULL;
    ASSERT_EQ_INT(mpidp_peerx_start(MPI_COMM_WORLD, &s, reqs, &x), MPIDP_EFULL);
    ASSERT_TRUE(x == NULL);
    ASSERT_EQ_INT(mpidp_reqtable_pending(reqs), 0);
    int self = rank_, outside = size_, twice[2] = {next, next};
    s.piece_bytes = 0;
    s.out = &self;
    ASSERT_EQ_INT(mpidp_peerx_start(MPI_COMM_WORLD, &s, reqs, &x), MPIDP_EINVAL);
    ASSERT_TRUE(strstr(mpidp_error_detail(), "out peer") != NULL);
    s.out = &outside;
    ASSERT_EQ_INT(mpidp_peerx_start(MPI_COMM_WORLD, &s, reqs, &x), MPIDP_EINVAL);
    s.out = twice, s.n_out = 2;
    ASSERT_EQ_INT(mpidp_peerx_start(MPI_COMM_WORLD, &s, reqs, &x), MPIDP_EINVAL);
    ASSERT_TRUE(strstr(mpidp_error_detail(), "listed twice") != NULL);
    s.out = &next, s.n_out = 1;
    size_t short_recv = 15;
    s.recv_bytes = &short_recv;
    ASSERT_EQ_INT(mpidp_peerx_start(MPI_COMM_WORLD, &s, reqs, &x), MPIDP_EINVAL);
    ASSERT_TRUE(strstr(mpidp_error_detail(), "receive buffer 0 holds 15 bytes, the message 16") != NULL);
    s.recv_bytes = NULL;
    s.bytes = 65, s.piece_bytes = 1;
    ASSERT_EQ_INT(mpidp_peerx_start(MPI_COMM_WORLD, &s, reqs, &x), MPIDP_EINVAL);
    ASSERT_TRUE(strstr(mpidp_error_detail(), "pieces") != NULL);
    ASSERT_EQ_INT(mpidp_reqtable_pending(reqs), 0);
    ASSERT_OK(mpidp_reqtable_destroy(reqs));
}

TEST(a_peer_that_never_sends_times_out_naming_the_exchange)
{
    mpidp_reqtable_t *reqs = table(8);
    if (size_ < 2) {
        mpidp_reqtable_destroy(reqs);
        return;
    }
    /* A fresh communicator: its first exchange has number 0, tag 1. */
    MPI_Comm comm;
    MPI_Comm_dup(MPI_COMM_WORLD, &comm);
    unsigned char send[8] = {1, 2, 3, 4, 5, 6, 7, 8}, recv[8] = {0};
    void *in[1] = {recv};
    int from = 1;
    /* Rank 0 expects a message from rank 1; rank 1 takes part with no peers. */
    mpidp_peerx_spec_t s = {.in = &from, .n_in = rank_ == 0 ? 1 : 0, .send = send, .recv = in,
                            .bytes = 8, .what = "neighbour exchange of step 7"};
    mpidp_peerx_t *x = NULL;
    ASSERT_OK(mpidp_peerx_start(comm, &s, reqs, &x));
    if (rank_ == 0) {
        ASSERT_EQ_INT(mpidp_peerx_wait(x, 0.2), MPIDP_ETIMEDOUT);
        ASSERT_TRUE(strstr(mpidp_error_detail(), "neighbour exchange of step 7") != NULL);
        ASSERT_EQ_INT(mpidp_peerx_free(x), MPIDP_ESTATE);
    }
    MPI_Barrier(comm);
    if (rank_ == 1) MPI_Send(send, 8, MPI_BYTE, 0, 1, comm); /* the message, late */
    ASSERT_OK(mpidp_peerx_wait(x, 30.0));
    ASSERT_OK(mpidp_peerx_free(x));
    if (rank_ == 0) ASSERT_EQ_INT(memcmp(recv, send, 8), 0);
    MPI_Comm_free(&comm);
    ASSERT_OK(mpidp_reqtable_destroy(reqs));
}

TEST_MAIN_MPI(gossip_rounds_deliver_every_in_peers_payload,
              two_exchanges_in_flight_keep_their_messages_apart,
              a_full_table_posts_nothing_and_bad_peers_are_refused,
              a_peer_that_never_sends_times_out_naming_the_exchange)
