/* Peer graphs (see mpidp/peer_graphs.h). */
#include "mpidp/peer_graphs.h"

#include <stddef.h>
#include <string.h>

#include "mpidp/status.h"
#include "fail.h"

/* Offsets of a phone book: at most 2 per distance, distances < W. */
#define MAX_OFFSETS (2 * MPIDP_GRAPH_MAX_WORLD)

static int is_fairscale(int kind) { return kind >= MPIDP_GRAPH_DDE && kind <= MPIDP_GRAPH_RING; }
static int is_bipartite(int kind) { return kind == MPIDP_GRAPH_DBE || kind == MPIDP_GRAPH_DBL; }

/* floor(log_base(x)) for x >= 1, base >= 2, in integers. */
static int ilog(int64_t x, int64_t base)
{
    int e = 0;
    for (int64_t p = base; p <= x; p *= base) e++;
    return e;
}

typedef struct {
    int offs[MAX_OFFSETS];
    unsigned char seen[MPIDP_GRAPH_MAX_WORLD]; /* seen[o]: offset o is in the list */
    int n;
} book_t;

/* Appends d (mod w) unless it is 0 or already there. */
static void add(book_t *b, int w, int64_t d)
{
    int o = (int)(((d % w) + w) % w);
    if (o == 0 || b->seen[o]) return;
    b->seen[o] = 1;
    b->offs[b->n++] = o;
}

/* The shared offset list of a fairscale graph (g valid, world >= 2). */
static int offsets(const mpidp_graph_t *g, book_t *b)
{
    int w = g->world, k = g->peers_per_itr;
    b->n = 0;
    memset(b->seen, 0, (size_t)w);
    switch (g->kind) {
    case MPIDP_GRAPH_DDE:
        for (int i = 0; i <= ilog(w - 1, 2); i++) {
            add(b, w, (int64_t)1 << i);
            add(b, w, -((int64_t)1 << i));
        }
        break;
    case MPIDP_GRAPH_NPDDE: {
        int64_t step = 1;
        for (int i = 0; i <= ilog(w - 1, (int64_t)k + 1); i++, step *= k + 1)
            for (int j = 1; j <= k; j++) add(b, w, j * step);
        break;
    }
    case MPIDP_GRAPH_DBE:
        for (int i = 0; i <= ilog(w - 1, 2); i++) {
            int64_t d = i == 0 ? 1 : 1 + ((int64_t)1 << i);
            add(b, w, d);
            add(b, w, -d);
        }
        break;
    case MPIDP_GRAPH_DDL:
    case MPIDP_GRAPH_DBL:
        /* Odd distances only: for the bipartite graph (W even) they are the
         * ones joining a passive (even) worker with an active (odd) one. */
        for (int d = 1; d < w; d += 2) {
            add(b, w, d);
            add(b, w, -d);
        }
        break;
    case MPIDP_GRAPH_RING:
        add(b, w, 1);
        add(b, w, -1);
        break;
    }
    return b->n;
}

int mpidp_graph_validate(const mpidp_graph_t *g)
{
    if (g == NULL) return mpidp__fail(MPIDP_EINVAL, "graph: NULL");
    if (g->kind < 0 || g->kind >= MPIDP_GRAPH_KINDS)
        return mpidp__fail(MPIDP_EINVAL, "graph: kind %d is not a graph (0 .. %d)", g->kind,
                           MPIDP_GRAPH_KINDS - 1);
    if (g->world < 1) return mpidp__fail(MPIDP_EINVAL, "graph: world %d, expected >= 1", g->world);
    if (g->peers_per_itr < 1 || g->peers_per_itr > MPIDP_GRAPH_MAX_PEERS)
        return mpidp__fail(MPIDP_EINVAL, "graph: peers_per_itr %d, expected 1 .. %d",
                           g->peers_per_itr, MPIDP_GRAPH_MAX_PEERS);
    if (!is_fairscale(g->kind)) {
        if (g->peers_per_itr != 1)
            return mpidp__fail(MPIDP_EINVAL, "graph: Bagua's peer rules take peers_per_itr 1, got %d",
                               g->peers_per_itr);
        if (g->kind == MPIDP_GRAPH_SHIFT_ONE && g->world % 2)
            return mpidp__fail(MPIDP_EINVAL, "graph: shift_one pairs the two halves of the ranks "
                               "and needs an even number of them, got %d", g->world);
        return MPIDP_OK;
    }
    if (g->world > MPIDP_GRAPH_MAX_WORLD)
        return mpidp__fail(MPIDP_EINVAL, "graph: world %d, at most %d for a gossip graph", g->world,
                           MPIDP_GRAPH_MAX_WORLD);
    if (is_bipartite(g->kind) && g->world % 2)
        return mpidp__fail(MPIDP_EINVAL, "graph: a bipartite graph joins even and odd workers and "
                           "needs an even number of them, got %d", g->world);
    if (g->world > 1) {
        book_t b;
        int n = offsets(g, &b);
        if (g->peers_per_itr > n)
            return mpidp__fail(MPIDP_EINVAL, "graph: peers_per_itr %d, but a worker's phone book "
                               "holds %d peer(s) at world %d", g->peers_per_itr, n, g->world);
    }
    return MPIDP_OK;
}

int mpidp_graph_book_len(const mpidp_graph_t *g, int *len)
{
    int rc = mpidp_graph_validate(g);
    if (rc != MPIDP_OK) return rc;
    if (len == NULL) return mpidp__fail(MPIDP_EINVAL, "graph: NULL length");
    if (g->world == 1) {
        *len = 0;
    } else if (is_fairscale(g->kind)) {
        book_t b;
        *len = offsets(g, &b);
    } else if (g->kind == MPIDP_GRAPH_SHIFT_ONE) {
        *len = g->world / 2; /* the partners in the other half, in turn */
    } else {
        *len = g->world == 2 ? 1 : 2;
    }
    return MPIDP_OK;
}

static int shift_one(int n, int r, int64_t t)
{
    int half = n / 2;
    int s = (int)(t % half);
    return r < half ? (s + r) % half + half : ((r - half - s) % half + half) % half;
}

int mpidp_graph_peers(const mpidp_graph_t *g, int rank, int64_t t, int *out, int *n_out, int *in,
                      int *n_in)
{
    int rc = mpidp_graph_validate(g);
    if (rc != MPIDP_OK) return rc;
    if (out == NULL || n_out == NULL || in == NULL || n_in == NULL)
        return mpidp__fail(MPIDP_EINVAL, "graph: NULL output");
    *n_out = *n_in = 0;
    if (rank < 0 || rank >= g->world)
        return mpidp__fail(MPIDP_EINVAL, "graph: rank %d outside 0 .. %d", rank, g->world - 1);
    if (t < 0) return mpidp__fail(MPIDP_EINVAL, "graph: iteration %lld < 0", (long long)t);
    int w = g->world;
    if (w == 1) return MPIDP_OK;
    if (g->kind == MPIDP_GRAPH_SHIFT_ONE) {
        out[0] = in[0] = shift_one(w, rank, t);
        *n_out = *n_in = 1;
    } else if (g->kind == MPIDP_GRAPH_RING_LR) {
        out[0] = in[0] = (rank + w - 1) % w;
        out[1] = in[1] = (rank + 1) % w;
        *n_out = *n_in = w == 2 ? 1 : 2;
    } else {
        book_t b;
        int len = offsets(g, &b), k = g->peers_per_itr;
        int64_t turn = g->kind == MPIDP_GRAPH_RING ? 0 : t % len; /* the ring is static */
        for (int j = 0; j < k; j++) {
            int o = b.offs[(int)((turn * k + j) % len)];
            out[j] = (rank + o) % w;
            in[j] = (rank - o + w) % w;
        }
        *n_out = *n_in = k;
    }
    return MPIDP_OK;
}
