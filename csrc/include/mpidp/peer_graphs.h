/* Peer graphs of decentralized training: who sends to whom at iteration t.
 *
 * Pure functions of (graph, rank, t): no state, no allocation, no MPI, so
 * every rank computes its own and its peers' views alike, and a resumed job
 * at iteration t talks to the same peers as the uninterrupted one.
 *
 * fairscale's gossip graphs (SGP, the SlowMo base), over W workers (SlowMo's
 * nodes): each worker r has a phone book, r + o_k (mod W) for an offset list
 * o_0, o_1, .. that every worker shares (duplicates mod W dropped, first
 * kept). At iteration t a worker sends to its book's entries
 * (t * k + j) mod len, j = 0 .. k-1 (k = peers_per_itr), as fairscale's
 * group indices do when it rotates them once per gossip round (the static
 * ring never rotates: t is ignored). It receives from the workers whose
 * entry at the same index is r: r - o_index. An offset that is 0 mod W
 * (which fairscale would keep, making a worker its own peer) is dropped.
 * Offsets, with L = floor(log2(W - 1)) + 1 (integer logarithms: fairscale's
 * floating-point log gives one level fewer at W - 1 = 243 for k = 2 and
 * 1000 for k = 9):
 *   DDE   DynamicDirectedExponentialGraph:       +2^i, -2^i          (i < L)
 *   NPDDE NPeerDynamicDirectedExponentialGraph:  +j (k+1)^i, j = 1..k (i <= floor(log_{k+1}(W - 1)))
 *   DBE   DynamicBipartiteExponentialGraph:      +-1, then +-(1 + 2^i) (1 <= i < L)
 *   DDL   DynamicDirectedLinearGraph:            +-i for odd i < W
 *   DBL   DynamicBipartiteLinearGraph:           +-i for odd i < W
 *   RING  RingGraph:                              +1, -1, static
 * The bipartite graphs join even ("passive") and odd workers only; that
 * needs an even W (fairscale's construction is not regular for an odd one:
 * refused here).
 *
 * Bagua's peer rules, over n ranks:
 *   SHIFT_ONE  one peer per iteration, p = ((t + r) mod n/2) + n/2 for
 *              r < n/2, else (r - n/2 - t) mod n/2: the halves pair up, a
 *              different pairing each iteration; p(p(r)) = r; n even.
 *   RING_LR    the left and right neighbours r - 1 and r + 1 every
 *              iteration (LowPrecisionDecentralized's ring; one neighbour
 *              when n = 2, none when n = 1). */
#ifndef MPIDP_PEER_GRAPHS_H
#define MPIDP_PEER_GRAPHS_H

#include <stdint.h>

enum {
    MPIDP_GRAPH_DDE = 0,
    MPIDP_GRAPH_NPDDE = 1,
    MPIDP_GRAPH_DBE = 2,
    MPIDP_GRAPH_DDL = 3,
    MPIDP_GRAPH_DBL = 4,
    MPIDP_GRAPH_RING = 5,
    MPIDP_GRAPH_SHIFT_ONE = 6,
    MPIDP_GRAPH_RING_LR = 7,
    MPIDP_GRAPH_KINDS = 8
};

/* At most this many workers for fairscale's graphs (their offset lists are
 * built on the stack); Bagua's rules take any int. */
#define MPIDP_GRAPH_MAX_WORLD 4096
/* At most this many peers in one iteration, either way. */
#define MPIDP_GRAPH_MAX_PEERS 64

typedef struct {
    int kind;          /* MPIDP_GRAPH_* */
    int world;         /* workers, >= 1 */
    int peers_per_itr; /* k >= 1: fairscale's graphs; 1 for Bagua's */
} mpidp_graph_t;

/* MPIDP_OK, or MPIDP_EINVAL with a detail naming the field and what it
 * takes (an odd world for a bipartite graph or shift_one, more peers per
 * iteration than a phone book holds, ...). */
int mpidp_graph_validate(const mpidp_graph_t *g);

/* Length of every worker's phone book (the number of distinct peers a
 * dynamic graph cycles through); 0 for a world of 1. */
int mpidp_graph_book_len(const mpidp_graph_t *g, int *len);

/* The peers `rank` sends to (out) and receives from (in) at iteration t >= 0,
 * in the graph's order, at most MPIDP_GRAPH_MAX_PEERS each; *n_out / *n_in
 * are their counts. Never rank itself. MPIDP_EINVAL for a bad graph, rank or
 * t. */
int mpidp_graph_peers(const mpidp_graph_t *g, int rank, int64_t t, int *out, int *n_out,
                      int *in, int *n_in);

#endif /* MPIDP_PEER_GRAPHS_H */
