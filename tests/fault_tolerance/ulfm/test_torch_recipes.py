"""The fault-tolerant recipes of docs/fault-tolerance.md for torch.distributed's
own data parallelism on the "mpidp" backend, tested by killing ranks:
DistributedDataParallel built again over the survivors, and FSDP2 in HSDP
form (replicate x shard), where the replica group that lost a rank is
dropped and the whole ones go on (FT-HSDP's rule). Each launches
tests/fault_tolerance/ulfm/torch_ft.py and compares every survivor with
a single-process simulation of the ranks whose data still counts."""

import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import train_ft  # noqa: E402
from test_fault_tolerance import (assert_matches, launch, launched_ranks_lost,  # noqa: E402
                                  simulate)

pytestmark = pytest.mark.serial

# (FT_TORCH, kill spec, {launched rank: the first step its data does not
# count in}, the ranks that leave, FT_HABITS: AMP's scaler and clipping).
# HSDP runs 2 replica groups of 2 ranks: {0, 1} and {2, 3}.
CASES = {
    "DDP with AMP and clipping, a rank lost in backward with buckets in flight":
        ("ddp", "2:3:backward", {2: 3}, set(), True),
    "HSDP, a rank lost once its backward is done: its group is dropped at that step":
        ("hsdp", "2:3:step", {2: 3, 3: 3}, {3}, False),
    "HSDP with AMP and clipping, rank 0 lost in the forward's all-gather: the other group "
    "goes on": ("hsdp", "0:2:forward", {0: 2, 1: 2}, {1}, True),
}


# kill spec: {key (the place's data stream): the (lost, joined) of each
# recovery it sees}, numbered in the world before it (the order the ranks joined).
GROWTHS = {
    "rank 2 lost once its backward is done": ("2:3:step", {
        0: [((2,), (3,))], 1: [((2,), (3,))], 3: [((2,), (3,))], 2: []}),
    "then rank 1, of the other group, after the first replacement joined (the world "
    "in the order the ranks joined, no longer their places)": ("2:3:step;1:5:step", {
        0: [((2,), (3,)), ((1,), (3,))], 3: [((2,), (3,)), ((1,), (3,))],
        2: [((1,), (3,))], 1: []}),
}


@pytest.mark.parametrize("growth", list(GROWTHS))
def test_hsdp_grows_back_with_a_replacement_taking_the_lost_shards(tmp_path, growth):
    """HSDP, recover(replace=True): the group that lost a rank is made whole
    again -- a replacement in the lost rank's place, its shards and
    momentum from the rank of that place in the other group -- and the step
    is done again by all four, so every rank ends as a single process that
    never lost a rank's data."""
    kill, recoveries = GROWTHS[growth]
    proc = launch(tmp_path, 4, kill, FT_SCRIPT="torch_ft.py", FT_TORCH="hsdp", FT_REPLACE=1)
    saved = {int(f[5:-3]): torch.load(tmp_path / f, weights_only=False)
             for f in os.listdir(tmp_path) if f.startswith("rank-")}
    assert set(saved) == set(range(4)), (
        f"ranks that finished: {sorted(saved)}; mpirun exit {proc.returncode}\n"
        + proc.stderr[-4000:])
    params, momentum, _ = simulate(4, 8, {})
    for key, got in saved.items():
        assert not got["left"], (key, got)
        assert [(r["lost"], r["joined"]) for r in got["recoveries"]] == recoveries[key], \
            (key, got["recoveries"])
        assert_matches(f"the rank of place {key}", got, params, momentum)


@pytest.mark.parametrize("case", list(CASES))
def test_torch_data_parallel_goes_on_as_the_recipe_says(tmp_path, case):
    """The step a rank died in is applied by no rank (every step ends with
    the ranks' agreement); the survivors go on from the last step all
    applied, and end as a single process that averaged, at each step, the
    gradients of the ranks still training. HSDP's survivors of the broken
    group leave at the loss, saying so."""
    mode, kill, lost_from, leave, habits = CASES[case]
    proc = launch(tmp_path, 4, kill, FT_SCRIPT="torch_ft.py", FT_TORCH=mode,
                  **({"FT_HABITS": 1} if habits else {}))
    saved = {int(f[5:-3]): torch.load(tmp_path / f, weights_only=False)
             for f in os.listdir(tmp_path) if f.startswith("rank-")}
    victim = int(kill.split(":")[0])
    assert set(saved) == set(range(4)) - {victim}, (
        f"ranks that finished: {sorted(saved)}; mpirun exit {proc.returncode}\n"
        + proc.stderr[-4000:])
    params, momentum, _ = simulate(4, 8, lost_from, clip=train_ft.CLIP if habits else None)
    for rank, got in saved.items():
        assert got["left"] == (rank in leave), (rank, got)
        assert launched_ranks_lost(got["recoveries"], 4) == [victim], got["recoveries"]
        if got["left"]:
            continue
        assert_matches(f"rank {rank}", got, params, momentum)
