"""The planner's cost model (mpidp/planning): the collectives' closed forms
against their formulas, the algorithms' predictions against properties
that must hold whatever the numbers (monotone in bandwidth and size, free
communication costs nothing, the bandwidth found for a utilisation reaches
it and no less does), the fit recovering the costs that made synthetic
measurements, the profile's refusals, the CLI, and a calibration at the
suite's ranks."""

import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest

from mpidp import __version__
from mpidp.planning import algorithm_costs as alg
from mpidp.planning import costs
from mpidp.planning.costs import Cluster, Level
from mpidp.planning.plan import main as plan_main
from mpidp.planning.profile import Profile, fit_level, load

from dp_reference import RANK, SIZE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LV = Level(alpha=3e-6, beta=1 / 5e9, gamma=1 / 10e9)
NET = Level(alpha=40e-6, beta=1 / 1.25e9, gamma=1 / 10e9)


@pytest.mark.parametrize("p", [2, 3, 4, 6, 8])
def test_closed_forms(p):
    n, a, b, g = 1e6, LV.alpha, LV.beta, LV.gamma
    assert costs.ring_allreduce(p, n, LV) == pytest.approx(
        2 * (p - 1) * a + 2 * (p - 1) / p * n * b + (p - 1) / p * n * g)
    steps = math.ceil(math.log2(p)) + (p & (p - 1) != 0)
    assert costs.recursive_doubling_allreduce(p, n, LV) == pytest.approx(steps * (a + n * b + n * g))
    rab = 2 * math.ceil(math.log2(p)) * a + 2 * (p - 1) / p * n * b + (p - 1) / p * n * g
    if p & (p - 1):
        rab += 2 * (a + n / 2 * b) + n / 2 * g
    assert costs.rabenseifner_allreduce(p, n, LV) == pytest.approx(rab)
    assert costs.ring_allgather(p, n, LV) == pytest.approx((p - 1) * a + (p - 1) / p * n * b)
    assert costs.allreduce(p, n, LV) == min(costs.ring_allreduce(p, n, LV),
                                            costs.recursive_doubling_allreduce(p, n, LV),
                                            costs.rabenseifner_allreduce(p, n, LV))
    assert costs.allreduce(1, n, LV) == costs.allgather(1, n, LV) == 0.0


def test_bus_bandwidth_of_a_pure_bandwidth_ring_is_the_link_rate():
    lv = Level(0.0, 1 / 3e9, 0.0)
    for p in (2, 4, 16):
        t = costs.ring_allreduce(p, 1e8, lv)
        assert costs.bus_bandwidth("allreduce", p, 1e8, t) == pytest.approx(3e9)
        t = costs.ring_allgather(p, 1e8, lv)
        assert costs.bus_bandwidth("allgather", p, 1e8, t) == pytest.approx(3e9)


def test_hierarchical_allreduce_with_free_nodes_is_the_nodes_allreduce():
    free = Level(0.0, 0.0, 0.0)
    c = Cluster(8, 4, free, NET)
    assert costs.hierarchical_allreduce(c, 1e7) == pytest.approx(costs.allreduce(8, 1e7, NET))
    assert costs.flat_allreduce(Cluster(1, 4, LV, NET), 1e7) == costs.allreduce(4, 1e7, LV)


def test_the_node_routes_allgather_crosses_the_network_with_each_piece_once():
    """Over nodes of several ranks the wire's gather crosses the network as
    an allgather between the nodes (each piece once), where a flat one's
    steps cross it at every rank's turn; with free nodes, exactly the
    nodes' allgather. One rank a node, or one node: the flat allgather."""
    free = Level(0.0, 0.0, 0.0)
    n = 1e7
    assert costs.node_route_allgather(Cluster(4, 8, free, NET), n) == \
        pytest.approx(costs.allgather(4, n, NET))
    assert costs.node_route_allgather(Cluster(4, 8, LV, NET), n) < \
        costs.flat_allgather(Cluster(4, 8, LV, NET), n)
    for c in (Cluster(4, 1, LV, NET), Cluster(1, 8, LV, NET)):
        assert costs.node_route_allgather(c, n) == costs.flat_allgather(c, n)


CLUSTER = Cluster(4, 2, LV, NET)
WORK = alg.Workload(params=5_000_000, step_s=0.1, overlap=0.8)


@pytest.mark.parametrize("a", alg.ALGORITHMS, ids=lambda a: f"{a.name} {a.settings}")
def test_each_algorithm_is_monotone_and_free_communication_costs_nothing(a):
    steps = [alg.predict(a, CLUSTER.with_network(bandwidth=bw), WORK).step_s
             for bw in (1e6, 1e7, 1e8, 1e9, 1e10)]
    assert all(x >= y - 1e-15 for x, y in zip(steps, steps[1:])), steps
    sizes = [alg.predict(a, CLUSTER, alg.Workload(n, 0.1, 0.8)).step_s
             for n in (1e5, 1e6, 1e7, 1e8)]
    assert all(x <= y + 1e-15 for x, y in zip(sizes, sizes[1:])), sizes
    free = Cluster(4, 2, Level(0, 0, 0), Level(0, 0, 0))
    p = alg.predict(a, free, WORK)
    assert p.step_s == WORK.step_s and p.utilisation == 1.0 and p.dominant == "compute"
    one = alg.predict(a, Cluster(1, 1, LV, NET), WORK)
    assert one.comm_s == 0.0 and one.bytes_per_step == 0.0


@pytest.mark.parametrize("a", alg.ALGORITHMS, ids=lambda a: f"{a.name} {a.settings}")
def test_the_bandwidth_for_a_utilisation_reaches_it_and_no_less_does(a):
    for u in (0.8, 0.95):
        bw = alg.bandwidth_for(a, CLUSTER, WORK, u)
        if bw is None:        # unreachable: not even an infinite rate reaches it
            assert alg.predict(a, CLUSTER.with_network(bandwidth=1e14), WORK).utilisation < u
            continue
        assert alg.predict(a, CLUSTER.with_network(bandwidth=bw), WORK).utilisation >= u
        if bw > 1e3:
            below = CLUSTER.with_network(bandwidth=bw * 0.99)
            assert alg.predict(a, below, WORK).utilisation < u


def test_the_dense_limits():
    """SparseLoCo at full density, values unquantized, sends every value (the
    slots implicit) and gathers them all: more than DiLoCo's dense allreduce,
    so sparsity or codes are what pay; MuLoCo's 2-bit codes of every entry
    send a sixteenth of the values' bytes; DataParallel's
    bf16 wire sends half the fp32 wire's bytes."""
    n = 4096 * 100
    assert alg.sparseloco_payload(n, top_k=4096, chunk=64, bins=0) == n * 4
    assert alg.sparseloco_payload(n, top_k=4096, chunk=64, bins=4) == 4 * 5 + n // 4
    full = alg.Algorithm("SparseLoCo", "full", alg.sparseloco(50, 4096, 64, 0))
    dense = alg.Algorithm("DiLoCo", "fp32", alg.diloco(50, alg.FP32))
    w = alg.Workload(n, 0.1)
    assert alg.predict(full, CLUSTER, w).bytes_per_step > alg.predict(dense, CLUSTER, w).bytes_per_step
    fp32, bf16 = (alg.predict(a, CLUSTER, w) for a in alg.ALGORITHMS[:2])
    assert bf16.bytes_per_step == pytest.approx(fp32.bytes_per_step / 2)


@pytest.mark.parametrize("size, group_size, most, mean", [
    (4, 2, 1, 1.0), (5, 2, 2, 1.6), (7, 3, 3, 18 / 7), (1, 2, 0, 0.0), (3, 2, 2, 2.0)])
def test_noloco_sends_its_replica_to_each_peer_of_its_group(size, group_size, most, mean):
    """4 B per parameter to each peer: the mean over the ranks in the bytes
    (5 ranks in pairs: a pair and a group of 3), the largest group's in the
    time, against the groups the algorithm draws."""
    from mpidp.algorithms.noloco import groups_of
    groups = groups_of(size, group_size, seed=0, number=0)
    peers = [len(g) - 1 for g in groups for _ in g]
    assert (max(peers), sum(peers) / size) == (most, pytest.approx(mean))
    assert alg.noloco_peers(size, group_size) == (most, pytest.approx(mean))
    n, every = 1000, 50
    cluster = Cluster(1, size, LV, NET)
    got = alg.predict(alg.Algorithm("NoLoCo", "", alg.noloco(every, group_size)), cluster,
                      alg.Workload(n, 0.1))
    assert got.bytes_per_step == pytest.approx(mean * 4 * n / every)
    assert got.comm_s == pytest.approx(most * (LV.alpha + 4 * n * (LV.beta + LV.gamma)) / every)


def test_eager_diloco_hides_its_allreduce_under_the_next_inner_phase():
    """The same bytes and allreduce as DiLoCo's, none of it exposed while
    the allreduce takes less than the inner phase; the excess where it
    takes more."""
    n, every = 4096 * 100, 100
    diloco = alg.Algorithm("DiLoCo", "", alg.diloco(every, alg.FP32))
    eager = alg.Algorithm("Eager", "", alg.eager_diloco(every, alg.FP32))
    for step_s in (0.1, 1e-7):
        w = alg.Workload(n, step_s)
        plain, overlapped = alg.predict(diloco, CLUSTER, w), alg.predict(eager, CLUSTER, w)
        assert overlapped.bytes_per_step == plain.bytes_per_step
        assert overlapped.comm_s == pytest.approx(plain.comm_s)
        allreduce = plain.comm_s * every
        assert overlapped.exposed_s == pytest.approx(max(0.0, allreduce - every * step_s) / every)
    assert alg.predict(eager, CLUSTER, alg.Workload(n, 0.1)).exposed_s == 0.0


def test_desloc_sends_half_of_local_adams_bytes_at_the_papers_periods():
    """Local Adam averages three model-sized tensors every K steps; DES-LOC
    at K, 3K and 6K sends (1 + 1/3 + 1/6) / 3 = 1/2 of that."""
    w = alg.Workload(4096 * 100, 0.1)
    local = alg.predict(alg.Algorithm("Local Adam", "", alg.desloc(8, 8, 8)), CLUSTER, w)
    desynced = alg.predict(alg.Algorithm("DES-LOC", "", alg.desloc(8, 24, 48)), CLUSTER, w)
    dp = alg.predict(alg.ALGORITHMS[0], CLUSTER, w)
    assert desynced.bytes_per_step == pytest.approx(local.bytes_per_step / 2)
    assert local.bytes_per_step == pytest.approx(3 * dp.bytes_per_step / 8)


def test_compression_compute_is_added_and_never_hidden():
    demo, sparse = (next(a for a in alg.ALGORITHMS if a.name == name)
                    for name in ("DeMo", "SparseLoCo"))
    plain = alg.Workload(1_000_000, 0.1)
    heavy = alg.Workload(1_000_000, 0.1, overheads={"DeMo": 2e-9, "SparseLoCo": 5e-9})
    assert (alg.predict(demo, CLUSTER, heavy).step_s - alg.predict(demo, CLUSTER, plain).step_s
            == pytest.approx(2e-9 * 1e6))
    every = 50     # SparseLoCo's H in ALGORITHMS
    assert (alg.predict(sparse, CLUSTER, heavy).step_s
            - alg.predict(sparse, CLUSTER, plain).step_s == pytest.approx(5e-9 * 1e6 / every))
    free = Cluster(4, 2, Level(0, 0, 0), Level(0, 0, 0))
    assert alg.predict(demo, free, heavy).dominant == "compute"
    assert alg.predict(demo, free, alg.Workload(1_000_000, 1e-4, overheads={"DeMo": 2e-9})
                       ).dominant == "compression"


def _synthetic(p, lv, sizes=(1024, 65536, 1 << 20, 1 << 24)):
    return {"allreduce": [(float(n), costs.ring_allreduce(p, n, lv)) for n in sizes],
            "allgather": [(float(n), costs.ring_allgather(p, n, lv)) for n in sizes],
            "allreduce_bf16": [(float(n), costs.wire_allreduce(p, n, lv, costs.BF16_WIRE))
                               for n in sizes]}


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("wire_bf16", [0.0, 0.7e-9])
def test_the_fit_recovers_the_costs_that_made_the_measurements(p, wire_bf16):
    made = dataclasses.replace(LV, wire_bf16=wire_bf16)
    fit = fit_level(p, _synthetic(p, made))
    assert fit.alpha == pytest.approx(LV.alpha, rel=1e-6)
    assert fit.beta == pytest.approx(LV.beta, rel=1e-6)
    assert fit.gamma == pytest.approx(LV.gamma, rel=1e-6)
    assert fit.wire_bf16 == pytest.approx(wire_bf16, rel=1e-6, abs=1e-18)
    assert fit.residuals["allreduce_bf16"]["max"] < 0.05


def test_a_flat_measurement_fits_a_slow_link_not_an_infinitely_fast_one():
    """A loaded machine: every size took the same few milliseconds of
    scheduling delay, the larger ones by chance a little less (seen in a CI
    run). The fit's bandwidth stays finite."""
    times = {1024.0: 3.2e-3, 16384.0: 3.1e-3, 262144.0: 3.0e-3}
    flat = {"allreduce": list(times.items()), "allgather": list(times.items())}
    fit = fit_level(2, flat)
    assert fit.alpha >= 0 and 0 < fit.beta < math.inf and fit.gamma >= 0
    # Pessimistic (the largest message's whole time taken as bandwidth), not absurd.
    assert 3.0e-3 <= costs.allgather(2, 262144.0, fit.level) <= 3 * 3.2e-3


def test_a_bf16_wire_halves_the_bytes_and_adds_its_conversions():
    """What the wire adds costs the bf16 wire its edge where the link is
    fast, and it counts as reduction; on a slow link half the bytes win."""
    n, p = 4e6, 4
    lv = dataclasses.replace(NET, wire_bf16=2e-9)
    assert costs.wire_allreduce(p, n, lv, costs.BF16_WIRE) == pytest.approx(
        costs.allreduce(p, n / 2, lv) + n * 2e-9)
    assert costs.wire_allreduce(p, n, lv) == costs.allreduce(p, n, lv)
    assert costs.wire_allreduce(1, n, lv, costs.BF16_WIRE) == 0.0
    w = alg.Workload(1_000_000, 0.001, overlap=0.0)
    fp32, bf16 = alg.ALGORITHMS[:2]
    fast = Cluster(4, 1, LV, dataclasses.replace(lv, beta=1 / 100e9))
    slow = Cluster(4, 1, LV, dataclasses.replace(lv, beta=1 / 0.1e9))
    assert alg.predict(bf16, fast, w).step_s > alg.predict(fp32, fast, w).step_s
    assert alg.predict(bf16, fast, w).dominant == "reduction"
    assert alg.predict(bf16, slow, w).step_s < alg.predict(fp32, slow, w).step_s
    assert costs.hierarchical_allreduce(Cluster(2, 2, lv, lv), n, costs.BF16_WIRE) == \
        pytest.approx(costs.hierarchical_allreduce(Cluster(2, 2, lv, lv), n / 2) + n * 2e-9)


def _profile(nodes=2, rpn=2, inter=True) -> Profile:
    levels = {"intra": fit_level(rpn, _synthetic(rpn, LV)) if rpn > 1 else None,
              "inter": fit_level(nodes, _synthetic(nodes, NET)) if inter else None}
    return Profile(__version__, nodes * rpn, nodes, rpn, levels, "synthetic", 1_000_000, 0.05,
                   0.9)


def test_a_profile_is_refused_naming_the_difference(tmp_path):
    path = str(tmp_path / "p.json")
    _profile().save(path)
    assert load(path).levels["inter"].alpha == pytest.approx(NET.alpha)
    with pytest.raises(ValueError, match="calibrated at 4 ranks, this job has 8"):
        load(path, world_size=8)
    raw = json.load(open(path))
    raw["mpidp_version"] = "0.0.1"
    json.dump(raw, open(path, "w"))
    with pytest.raises(ValueError, match=f"made by mpidp 0.0.1, this is mpidp {__version__}"):
        load(path)
    one_node = _profile(nodes=1, rpn=4, inter=False)
    with pytest.raises(ValueError, match="needs the network's costs, which this profile did "
                                         "not measure"):
        one_node.cluster(8, 4)
    assert one_node.cluster(8, 4, bandwidth=1e9, latency=1e-4).inter.alpha == 1e-4
    across_only = _profile(nodes=2, rpn=1)
    with pytest.raises(ValueError, match="needs the costs within a node, which this profile did "
                                         "not measure"):
        across_only.cluster(2, 4)
    assert across_only.cluster(8, 1).inter.alpha == pytest.approx(NET.alpha)


def _plan(args, tmp_path):
    return subprocess.run([sys.executable, "-m", "mpidp", "plan", *args], capture_output=True,
                          text=True, cwd=tmp_path, timeout=120)


def _plan_here(args, capsys):
    """The CLI's main in this process, as `python -m mpidp plan` runs it:
    (exit code, stdout, stderr). One subprocess checks the entry point; the
    rest run here, as each subprocess costs an import of torch."""
    code = plan_main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.skipif(SIZE > 1, reason="runs the CLI once, in the one-rank pass")
def test_plan_cli_table_json_picture_and_bad_input(tmp_path, capsys):
    path = str(tmp_path / "p.json")
    _profile().save(path)
    out = _plan(["--profile", path, "--nodes", "2,8", "--bandwidth", "100mbit,10gbit",
                 "--json", "--plot", str(tmp_path / "map.png")], tmp_path)
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)["rows"]
    assert len(rows) == 2 * 2 * len(alg.ALGORITHMS)
    for n in (2, 8):
        for bw in (100e6 / 8, 10e9 / 8):
            cell = [r for r in rows if r["nodes"] == n and r["bandwidth"] == pytest.approx(bw)]
            assert sum(r["recommended"] for r in cell) == 1
            best = min(cell, key=lambda r: r["step_s"])
            assert best["recommended"]
            assert all(r["label"] and r["label"].startswith("extrapolated") for r in cell)
    assert os.path.getsize(tmp_path / "map.png") > 10_000
    code, text, _ = _plan_here(["--profile", path, "--nodes", "2"], capsys)
    assert code == 0 and "by step time alone" in text
    code, _, err = _plan_here(["--profile", path, "--bandwidth", "fast"], capsys)
    assert code == 2 and "--bandwidth: expected a rate like 1gbit" in err
    one = str(tmp_path / "one.json")
    _profile(nodes=1, rpn=4, inter=False).save(one)
    code, _, err = _plan_here(["--profile", one, "--nodes", "4"], capsys)
    assert code == 2 and "calibrate across 2 or more nodes" in err
    # Every bad value names its flag, and none is silently replaced by the profile's.
    not_json = tmp_path / "notes.txt"
    not_json.write_text("not a profile\n")
    for args, words in [(["--ranks-per-node", "0"], "--ranks-per-node: expected a count >= 1"),
                        (["--nodes", "abc"], "--nodes: expected counts >= 1"),
                        (["--nodes", "2,0"], "--nodes: expected counts >= 1"),
                        (["--params", "0"], "--params: expected a positive count"),
                        (["--step-ms", "0"], "--step-ms: expected a positive time"),
                        (["--steps-to-target", str(not_json)],
                         "--steps-to-target " + str(not_json) + ": expected a JSON object")]:
        code, _, err = _plan_here(["--profile", path, *args], capsys)
        assert code == 2 and words in err, (args, err)
    code, _, err = _plan_here(["--profile", str(not_json)], capsys)
    assert code == 2 and "not a profile from python -m mpidp calibrate" in err
    assert "Expecting value" in err      # the parser's own words, after ours


@pytest.mark.skipif(SIZE > 1, reason="runs the CLI once, in the one-rank pass")
def test_an_unknown_command_is_refused_with_the_usage(tmp_path, capsys):
    """A typo of plan or calibrate must not print the report and exit 0: the
    entry point once, in a subprocess; the other words through its dispatch,
    here."""
    from mpidp.__main__ import dispatch
    usage = "usage: python -m mpidp [calibrate | plan]"
    out = subprocess.run([sys.executable, "-m", "mpidp", "foo"], capture_output=True, text=True,
                         cwd=tmp_path, timeout=120)
    assert out.returncode == 2, out
    assert usage in out.stderr and "unknown command 'foo'" in out.stderr and out.stdout == ""
    for word in ("plna", "--nodes"):
        assert dispatch([word]) == 2
        got = capsys.readouterr()
        assert usage in got.err and f"unknown command {word!r}" in got.err and got.out == ""


def test_calibrate_at_the_suites_ranks():
    """A short calibration (collective): the fit's costs are positive and
    finite, the step was timed, the overlap is a share."""
    from mpidp.planning.calibrate import calibrate
    prof = calibrate(max_bytes=1 << 20, steps=2, min_s=0.01, quick=True)
    if RANK != 0:
        assert prof is None
        return
    assert prof.world_size == SIZE and prof.params > 0 and prof.step_s > 0
    assert 0.0 <= prof.overlap <= 1.0
    assert set(prof.overheads) == {"DeMo", "SparseLoCo"}
    assert all(v >= 0 for v in prof.overheads.values())
    for name, fit in prof.levels.items():
        if fit is None:
            continue
        assert fit.alpha >= 0 and 0 < fit.beta < 1e-6, (name, fit)
        assert len(fit.measured["allreduce"]) == len(fit.measured["allgather"]) >= 2
        assert len(fit.measured["allreduce_bf16"]) == len(fit.measured["allreduce"])
        assert 0 <= fit.wire_bf16 < 1e-6, (name, fit)
    if SIZE > 1:
        assert any(f is not None for f in prof.levels.values())
