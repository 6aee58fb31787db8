/* Peer graphs (mpidp/peer_graphs.h): fairscale's phone books, written out by hand
 * from its construction for small worlds; then, for every graph at every
 * world size 2..64, the properties a gossip round relies on: a worker's
 * out-peers and in-peers are the same count, s is an out-peer of r exactly
 * when r is an in-peer of s, nobody is its own peer, a dynamic graph cycles
 * through its whole phone book; Bagua's shift_one is a perfect matching of
 * the two halves with p(p(r)) = r. */
#include "mpidp/peer_graphs.h"
#include "mpidp/status.h"
#include "test.h"

static int out_at(int kind, int world, int k, int rank, int64_t t, int *out)
{
    mpidp_graph_t g = {.kind = kind, .world = world, .peers_per_itr = k};
    int in[MPIDP_GRAPH_MAX_PEERS], n_out = -1, n_in = -1;
    if (mpidp_graph_peers(&g, rank, t, out, &n_out, in, &n_in) != MPIDP_OK) return -1;
    return n_out;
}

/* Rank 0's out-peers at iterations 0 .. n-1 (one peer per iteration). */
static void sequence(int kind, int world, int n, int *seq)
{
    for (int t = 0; t < n; t++) {
        int out[MPIDP_GRAPH_MAX_PEERS];
        seq[t] = out_at(kind, world, 1, 0, t, out) == 1 ? out[0] : -1;
    }
}

#define ASSERT_SEQ(kind, world, ...)                                            \
    do {                                                                        \
        int want[] = {__VA_ARGS__}, got[32];                                    \
        int n = (int)(sizeof want / sizeof want[0]);                            \
        sequence(kind, world, n, got);                                          \
        for (int i = 0; i < n; i++) ASSERT_EQ_INT(got[i], want[i]);             \
    } while (0)

/* Rank `rank`'s out-peers at iteration t, with k peers per iteration, are
 * exactly the listed ranks (at least one), in that order. */
#define ASSERT_PEERS(kind, world, k, rank, t, ...)                              \
    do {                                                                        \
        int want_[] = {__VA_ARGS__}, got_[MPIDP_GRAPH_MAX_PEERS];               \
        int n_ = (int)(sizeof want_ / sizeof want_[0]);                         \
        ASSERT_EQ_INT(out_at(kind, world, k, rank, t, got_), n_);               \
        for (int i_ = 0; i_ < n_; i_++) ASSERT_EQ_INT(got_[i_], want_[i_]);     \
    } while (0)

TEST(fairscale_phone_books_in_their_order)
{
    /* DDE, W = 8: +1, -1, +2, -2, +4 (-4 = +4 dropped), then again. */
    ASSERT_SEQ(MPIDP_GRAPH_DDE, 8, 1, 7, 2, 6, 4, 1, 7);
    /* W = 4: +1, -1, +2 (-2 = +2). W = 2: the one other worker. */
    ASSERT_SEQ(MPIDP_GRAPH_DDE, 4, 1, 3, 2, 1);
    ASSERT_SEQ(MPIDP_GRAPH_DDE, 2, 1, 1, 1);
    /* DBE, W = 8: +-1, +-(1 + 2), +-(1 + 4) (duplicates of +-3). */
    ASSERT_SEQ(MPIDP_GRAPH_DBE, 8, 1, 7, 3, 5, 1);
    /* DDL, W = 6: odd distances 1, 3, 5: +1, -1, +3 (the others repeat). */
    ASSERT_SEQ(MPIDP_GRAPH_DDL, 6, 1, 5, 3, 1);
    ASSERT_SEQ(MPIDP_GRAPH_DBL, 6, 1, 5, 3, 1);
    /* The ring is static: always the next worker. */
    ASSERT_SEQ(MPIDP_GRAPH_RING, 5, 1, 1, 1);
    /* NPDDE, W = 9, k = 2: distances j * 3^i, i <= log3(8) = 1: 1, 2, 3, 6;
     * two peers per iteration, rotating by two. */
    ASSERT_PEERS(MPIDP_GRAPH_NPDDE, 9, 2, 0, 0, 1, 2);
    ASSERT_PEERS(MPIDP_GRAPH_NPDDE, 9, 2, 4, 1, 7, 1);
    /* Offsets that are 0 mod W are dropped (NPDDE, W = 6, k = 2: 1, 2, 3, 6). */
    mpidp_graph_t g = {.kind = MPIDP_GRAPH_NPDDE, .world = 6, .peers_per_itr = 2};
    int len = -1;
    ASSERT_EQ_INT(mpidp_graph_book_len(&g, &len), MPIDP_OK);
    ASSERT_EQ_INT(len, 3);
}

/* Every property of one graph over iterations 0 .. 2 * len + 1. */
static int check_graph(int kind, int world, int k)
{
    mpidp_graph_t g = {.kind = kind, .world = world, .peers_per_itr = k};
    int len = 0;
    if (mpidp_graph_book_len(&g, &len) != MPIDP_OK) return 0;
    for (int64_t t = 0; t < 2 * len + 2; t++) {
        int out[64][MPIDP_GRAPH_MAX_PEERS], in[64][MPIDP_GRAPH_MAX_PEERS], n_out[64], n_in[64];
        for (int r = 0; r < world; r++) {
            if (mpidp_graph_peers(&g, r, t, out[r], &n_out[r], in[r], &n_in[r]) != MPIDP_OK) return 0;
            if (n_out[r] != n_in[r] || n_out[r] < 1) return 0;
            for (int j = 0; j < n_out[r]; j++) {
                if (out[r][j] == r || in[r][j] == r) return 0;
                for (int i = 0; i < j; i++)
                    if (out[r][i] == out[r][j] || in[r][i] == in[r][j]) return 0;
            }
        }
        for (int r = 0; r < world; r++) /* s in out(r)  <=>  r in in(s) */
            for (int j = 0; j < n_out[r]; j++) {
                int s = out[r][j], found = 0;
                for (int i = 0; i < n_in[s]; i++) found |= in[s][i] == r;
                if (!found) return 0;
            }
        for (int r = 0; r < world; r++)
            for (int j = 0; j < n_in[r]; j++) {
                int s = in[r][j], found = 0;
                for (int i = 0; i < n_out[s]; i++) found |= out[s][i] == r;
                if (!found) return 0;
            }
        if (kind == MPIDP_GRAPH_DBE || kind == MPIDP_GRAPH_DBL) /* even with odd only */
            for (int r = 0; r < world; r++)
                for (int j = 0; j < n_out[r]; j++)
                    if ((out[r][j] - r) % 2 == 0) return 0;
    }
    /* A dynamic graph reaches every entry of its phone book within len
     * consecutive iterations. */
    if (kind <= MPIDP_GRAPH_DBL) {
        unsigned char reached[64] = {0};
        int n = 0;
        for (int64_t t = 3; t < 3 + len; t++) {
            int out[MPIDP_GRAPH_MAX_PEERS], in[MPIDP_GRAPH_MAX_PEERS], n_out, n_in;
            if (mpidp_graph_peers(&g, 0, t, out, &n_out, in, &n_in) != MPIDP_OK) return 0;
            for (int j = 0; j < n_out; j++) n += !reached[out[j]], reached[out[j]] = 1;
        }
        if (n != len) return 0;
    }
    return 1;
}

TEST(every_graph_is_consistent_at_every_world_size_up_to_64)
{
    for (int world = 2; world <= 64; world++)
        for (int kind = 0; kind < MPIDP_GRAPH_KINDS; kind++)
            for (int k = 1; k <= 3; k++) {
                mpidp_graph_t g = {.kind = kind, .world = world, .peers_per_itr = k};
                if (mpidp_graph_validate(&g) != MPIDP_OK) continue; /* refusals: next test */
                if (!check_graph(kind, world, k))
                    MPIDP__FAIL_AT("graph %d, world %d, %d peer(s) per iteration", kind, world, k);
            }
}

TEST(shift_one_pairs_the_halves_differently_each_iteration)
{
    for (int n = 2; n <= 64; n += 2) {
        for (int r = 0; r < n; r++) {
            unsigned char met[64] = {0};
            for (int64_t t = 0; t < n / 2; t++) {
                int p[1], q[1];
                ASSERT_EQ_INT(out_at(MPIDP_GRAPH_SHIFT_ONE, n, 1, r, t, p), 1);
                ASSERT_EQ_INT(out_at(MPIDP_GRAPH_SHIFT_ONE, n, 1, p[0], t, q), 1);
                ASSERT_EQ_INT(q[0], r);                     /* p(p(r)) = r */
                ASSERT_TRUE((r < n / 2) != (p[0] < n / 2)); /* across the halves */
                met[p[0]] = 1;
            }
            int n_met = 0;
            for (int s = 0; s < n; s++) n_met += met[s];
            ASSERT_EQ_INT(n_met, n / 2); /* everyone of the other half, once */
        }
    }
    /* The spec's formula at n = 8, iteration 3: rank 1 -> (3 + 1) % 4 + 4 = 4. */
    ASSERT_PEERS(MPIDP_GRAPH_SHIFT_ONE, 8, 1, 1, 3, 4);
    ASSERT_PEERS(MPIDP_GRAPH_SHIFT_ONE, 8, 1, 4, 3, 1);
}

TEST(ring_lr_has_both_neighbours_and_one_at_two_ranks)
{
    ASSERT_PEERS(MPIDP_GRAPH_RING_LR, 5, 1, 0, 7, 4, 1);
    ASSERT_PEERS(MPIDP_GRAPH_RING_LR, 2, 1, 1, 0, 0);
    int out[MPIDP_GRAPH_MAX_PEERS]; /* one worker: no peers, which ASSERT_PEERS cannot list */
    ASSERT_EQ_INT(out_at(MPIDP_GRAPH_RING_LR, 1, 1, 0, 0, out), 0);
}

TEST(bad_graphs_and_queries_are_refused_with_a_reason)
{
    mpidp_graph_t g = {.kind = MPIDP_GRAPH_DBE, .world = 5, .peers_per_itr = 1};
    ASSERT_EQ_INT(mpidp_graph_validate(&g), MPIDP_EINVAL);
    ASSERT_TRUE(strstr(mpidp_error_detail(), "even number") != NULL);
    g = (mpidp_graph_t){.kind = MPIDP_GRAPH_SHIFT_ONE, .world = 3, .peers_per_itr = 1};
    ASSERT_EQ_INT(mpidp_graph_validate(&g), MPIDP_EINVAL);
    ASSERT_TRUE(strstr(mpidp_error_detail(), "shift_one") != NULL);
    g = (mpidp_graph_t){.kind = MPIDP_GRAPH_RING, .world = 4, .peers_per_itr = 3};
    ASSERT_EQ_INT(mpidp_graph_validate(&g), MPIDP_EINVAL);
    ASSERT_TRUE(strstr(mpidp_error_detail(), "phone book holds 2") != NULL);
    g = (mpidp_graph_t){.kind = MPIDP_GRAPH_KINDS, .world = 4, .peers_per_itr = 1};
    ASSERT_EQ_INT(mpidp_graph_validate(&g), MPIDP_EINVAL);
    g = (mpidp_graph_t){.kind = MPIDP_GRAPH_DDE, .world = MPIDP_GRAPH_MAX_WORLD + 1, .peers_per_itr = 1};
    ASSERT_EQ_INT(mpidp_graph_validate(&g), MPIDP_EINVAL);
    g = (mpidp_graph_t){.kind = MPIDP_GRAPH_SHIFT_ONE, .world = 4, .peers_per_itr = 2};
    ASSERT_EQ_INT(mpidp_graph_validate(&g), MPIDP_EINVAL);
    g = (mpidp_graph_t){.kind = MPIDP_GRAPH_DDE, .world = 4, .peers_per_itr = 1};
    int out[MPIDP_GRAPH_MAX_PEERS], in[MPIDP_GRAPH_MAX_PEERS], n_out, n_in;
    ASSERT_EQ_INT(mpidp_graph_peers(&g, 4, 0, out, &n_out, in, &n_in), MPIDP_EINVAL);
    ASSERT_EQ_INT(mpidp_graph_peers(&g, 0, -1, out, &n_out, in, &n_in), MPIDP_EINVAL);
    ASSERT_EQ_INT(mpidp_graph_peers(&g, 0, 0, NULL, &n_out, in, &n_in), MPIDP_EINVAL);
    /* One worker: no peers, nothing refused. */
    g.world = 1;
    ASSERT_EQ_INT(mpidp_graph_peers(&g, 0, 5, out, &n_out, in, &n_in), MPIDP_OK);
    ASSERT_EQ_INT(n_out + n_in, 0);
}

TEST(large_worlds_and_iterations_stay_in_range)
{
    mpidp_graph_t g = {.kind = MPIDP_GRAPH_DDL, .world = MPIDP_GRAPH_MAX_WORLD, .peers_per_itr = 7};
    int out[MPIDP_GRAPH_MAX_PEERS], in[MPIDP_GRAPH_MAX_PEERS], n_out, n_in;
    ASSERT_EQ_INT(mpidp_graph_peers(&g, 4095, INT64_MAX, out, &n_out, in, &n_in), MPIDP_OK);
    ASSERT_EQ_INT(n_out, 7);
    for (int j = 0; j < n_out; j++) ASSERT_TRUE(out[j] >= 0 && out[j] < g.world && in[j] >= 0 && in[j] < g.world);
    g = (mpidp_graph_t){.kind = MPIDP_GRAPH_SHIFT_ONE, .world = 1 << 30, .peers_per_itr = 1};
    ASSERT_EQ_INT(mpidp_graph_peers(&g, (1 << 30) - 1, INT64_MAX, out, &n_out, in, &n_in), MPIDP_OK);
    ASSERT_TRUE(out[0] >= 0 && out[0] < (1 << 29));
}

TEST_MAIN(fairscale_phone_books_in_their_order, every_graph_is_consistent_at_every_world_size_up_to_64,
          shift_one_pairs_the_halves_differently_each_iteration,
          ring_lr_has_both_neighbours_and_one_at_two_ranks,
          bad_graphs_and_queries_are_refused_with_a_reason, large_worlds_and_iterations_stay_in_range)
