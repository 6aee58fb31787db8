"""A pytest plugin for runs of Horovod's own test suite on mpidp
(tests/horovod/test_horovod_suite.py loads it with -p suite_plugin):

- deselects, by exact name, the tests that fail with Horovod itself here
  (on this torch they build every optimizer class in torch.optim, and torch
  2.13's Muon refuses 1-D parameters; at 3 ranks three float16 tests expect
  a value float16 cannot hold; one times a barrier from an unsynchronised
  start, which a loaded node breaks), keeping the reason;
- writes each test's outcome, as it ends, to the JSON-lines file named by
  MPIDP_SUITE_OUT with ".rank<N>" appended (every rank runs the whole
  file), so that a job that ends inside a test still tells which."""

import json
import os

NOT_OURS = {
    name: "fails with Horovod itself on torch 2.13: it builds every torch.optim optimizer, "
          "and Muon refuses 1-D parameters"
    for name in ("test_broadcast_state", "test_broadcast_state_options", "test_force_allreduce")
}
# It asserts each rank waited >= 5 s in the barrier rank 0 enters 5 s late,
# timed from that rank's own return from the allreduce before it. On a loaded
# node one rank can return a scheduler slice (4 ms and more measured here)
# after rank 0, longer than the barrier takes to release it once rank 0 is in
# (1-16 ms measured): the rank then measures 4.99 s, with Horovod too. What
# the test means is checked on a shared clock by tests/horovod/
# test_horovod_ops.py::test_barrier_holds_every_rank_until_the_last_arrives.
NOT_OURS["test_global_barrier_op"] = (
    "times each rank from its own return from the allreduce before: on a loaded node one rank's "
    "return lags by more than the barrier's release and it measures under 5 s, with Horovod too; "
    "test_horovod_ops.py checks the barrier on a shared clock")
# At 3 ranks these expect a float16 sum of 3 equal float16 values to equal
# the float32 product 3 x value exactly, which is (almost always) not a
# float16 number: no float16 result can pass, Horovod's included (its CI
# runs them at 2 ranks, where 2 x value is exact).
if os.environ.get("OMPI_COMM_WORLD_SIZE") == "3":
    NOT_OURS.update({
        name: "at 3 ranks it expects a float16 result to equal 3 x a float16 value computed in "
              "float32, which is not a float16 number: Horovod fails it too"
        for name in ("test_horovod_allreduce_prescale", "test_horovod_reducescatter_prescale",
                     "test_horovod_grouped_reducescatter_prescale")})


def _out():
    path = os.environ.get("MPIDP_SUITE_OUT")
    if not path:
        return None
    return open(f"{path}.rank{os.environ.get('OMPI_COMM_WORLD_RANK', '0')}", "a")


def pytest_collection_modifyitems(config, items):
    kept, dropped = [], []
    for item in items:
        (dropped if item.name in NOT_OURS else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
        with _out() or open(os.devnull, "w") as f:
            for item in dropped:
                f.write(json.dumps({"test": item.name, "outcome": "deselected",
                                    "reason": NOT_OURS[item.name]}) + "\n")


def pytest_runtest_logstart(nodeid, location):
    with _out() or open(os.devnull, "w") as f:
        f.write(json.dumps({"started": nodeid.split("::")[-1]}) + "\n")


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        if report.when == "teardown" and report.outcome == "passed":
            return
        reason = ""
        if report.skipped and isinstance(report.longrepr, tuple):
            reason = str(report.longrepr[2])
        elif report.failed:
            reason = report.longreprtext[-1500:]
        with _out() or open(os.devnull, "w") as f:
            f.write(json.dumps({"test": report.nodeid.split("::")[-1], "when": report.when,
                                "outcome": report.outcome, "reason": reason}) + "\n")
