/* Peer exchange: one buffer sent to each of a few peers and one buffer
 * received from each of a few (possibly other) peers, non-blocking -- the
 * communication of decentralized training (gossip, neighbour averaging),
 * whose peers change every iteration (mpidp/peer_graphs.h), so that MPI's
 * neighbourhood collectives, fixed at a communicator's creation, do not fit.
 *
 * Every rank of the communicator starts the exchanges on it in the same
 * order (a rank with no peers at some iteration still calls start, which
 * then posts nothing): their messages are tagged with the operation's number
 * on the communicator (one count per communicator, shared with the quantized
 * allreduce), so two exchanges in flight at once, or one beside a quantized
 * allreduce, never take each other's messages. A message longer than
 * `piece_bytes` goes in pieces (MPI counts are ints).
 *
 * Every request is registered in the request table: test and wait have
 * deadlines and a stuck exchange is reported with what it waited for. The
 * table's slots are claimed before anything is posted, so MPIDP_EFULL leaves
 * nothing in flight. */
#ifndef MPIDP_PEER_EXCHANGE_H
#define MPIDP_PEER_EXCHANGE_H

#include <mpi.h>
#include <stddef.h>

#include "mpidp/reqtable.h"

/* Default largest piece of one message, and the most pieces a message may
 * take (message tags hold the piece number in 6 bits). */
#define MPIDP_PEERX_PIECE ((size_t)1 << 30)
#define MPIDP_PEERX_MAX_PIECES 64
/* At most this many peers either way. */
#define MPIDP_PEERX_MAX_PEERS 64

typedef struct mpidp_peerx mpidp_peerx_t;

typedef struct {
    const int *out;     /* ranks of the communicator that receive `send` */
    int n_out;          /* 0 .. MPIDP_PEERX_MAX_PEERS */
    const int *in;      /* ranks whose message lands in recv[i] */
    int n_in;           /* 0 .. MPIDP_PEERX_MAX_PEERS */
    const void *send;   /* `bytes` bytes, unchanged until the exchange is done */
    void *const *recv;  /* n_in distinct buffers of `bytes` bytes each */
    size_t bytes;       /* the same on every rank of an exchange */
    const size_t *recv_bytes; /* NULL, or each recv buffer's size: each must be `bytes` */
    size_t piece_bytes; /* 0: MPIDP_PEERX_PIECE */
    double drain_timeout_s; /* bounds the wait for what was posted when a post fails */
    const char *what;   /* for messages; NULL: "peer exchange" */
} mpidp_peerx_spec_t;

/* Posts the exchange. MPIDP_EINVAL (nothing posted) for a peer outside the
 * communicator or the rank itself, a peer listed twice on one side, NULL
 * buffers, a receive buffer of another size than `bytes`, a message over
 * MPIDP_PEERX_MAX_PIECES pieces; MPIDP_EFULL when
 * the request table has no room for all its requests (nothing posted);
 * MPIDP_ENOMEM, MPIDP_EMPI (what was posted is drained first). */
int mpidp_peerx_start(MPI_Comm comm, const mpidp_peerx_spec_t *spec, mpidp_reqtable_t *reqs,
                      mpidp_peerx_t **out);
/* Progresses without blocking; *done = 1 once every message has gone and
 * arrived (recv then holds the peers' buffers). */
int mpidp_peerx_test(mpidp_peerx_t *x, int *done);
/* Blocks until done; `timeout_s` bounds each request's wait (<= 0: none).
 * MPIDP_ETIMEDOUT names what is still pending. */
int mpidp_peerx_wait(mpidp_peerx_t *x, double timeout_s);
/* Frees x. MPIDP_ESTATE (nothing freed) while a message is in flight. */
int mpidp_peerx_free(mpidp_peerx_t *x);

#endif /* MPIDP_PEER_EXCHANGE_H */
