"""DASO and DataParallelMultiGPU at 1, 2 and 4 ranks, laid out as nodes of 1
and (where the size allows) nodes of 2 ranks (MPIDP_RANKS_PER_NODE)."""

import contextlib
import copy
import gc
import re
import warnings

import pytest
import torch
import torch.nn.functional as F

import mpidp
from mpidp.topology import node_comm
from dp_reference import BNNet
from dp_reference import (DEVICE, RANK, SIZE, assert_params_close, assert_same_on_all_ranks,
                          on_device, seeded)

LAYOUTS = [k for k in (1, 2) if SIZE % k == 0]


@pytest.fixture(autouse=True)
def one_rank_per_node_by_default(monkeypatch):
    """Tests without a layout use nodes of one rank (no DDP inside a node)."""
    monkeypatch.setenv("MPIDP_RANKS_PER_NODE", "1")


@pytest.fixture(params=LAYOUTS, ids=lambda k: f"nodes_of_{k}")
def nodes_of(request, monkeypatch):
    monkeypatch.setenv("MPIDP_RANKS_PER_NODE", str(request.param))
    return request.param


@pytest.fixture(params=["direct", "staged", "device"])
def staging(request, monkeypatch):
    """Staged: sync through the host mirror, GPU parameters' fallback (forced
    on CPU so the mirror's pull/push choreography is tested without a GPU).
    Device: packed and merged in place as GPU parameters are
    (_device_paramsync.py), here on CPU tensors."""
    monkeypatch.setenv("MPIDP_DASO_STAGING", "1" if request.param == "staged" else "0")
    monkeypatch.setenv("MPIDP_DASO_DEVICE_SYNC", "1" if request.param == "device" else "0")
    return request.param != "direct"


def mlp(seed, frozen=False):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32),
                            torch.nn.ReLU(), torch.nn.Linear(32, 3))
    if frozen:
        m[0].requires_grad_(False)
    return m.to(DEVICE)


def problem(batches=12, per_rank=8, seed=7):
    """A learnable problem: labels from a fixed random linear map. Returns the
    global batches (X, Y), each of per_rank * SIZE samples."""
    g = seeded(seed)
    W = torch.randn(10, 3, generator=g)
    out = []
    for _ in range(batches):
        X = torch.randn(per_rank * SIZE, 10, generator=g)
        out.append(on_device(X, (X @ W).argmax(1)))
    return out


def my_slice(t):
    n = t.shape[0] // SIZE
    return t[RANK * n:(RANK + 1) * n]


def train(model, daso, net, data, epochs, on_epoch=None, before_step=None):
    daso.last_batch = len(data) - 1
    losses = []
    for epoch in range(epochs):
        total = 0.0
        for X, Y in data:
            daso.zero_grad()
            loss = F.cross_entropy(net(my_slice(X)), my_slice(Y))
            if daso.scaler is not None:
                daso.scaler.scale(loss).backward()
            else:
                loss.backward()
            if before_step:
                before_step(model)
            daso.step()
            total += loss.item()
        daso.epoch_loss_logic(total / len(data))
        losses.append(total / len(data))
        assert_same_on_all_ranks(model)   # every rank, every epoch end
        if on_epoch:
            on_epoch(epoch)
    return losses


def make(seed=0, frozen=False, epochs=6, **kw):
    model = mlp(100 + RANK, frozen)      # ranks start different: rank 0's wins
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05,
                          momentum=0.9)
    kw.setdefault("warmup_epochs", 1)
    kw.setdefault("cooldown_epochs", 1)
    daso = mpidp.DASO(opt, total_epochs=epochs, **kw)
    net = mpidp.DataParallelMultiGPU(model, daso)
    return model, opt, daso, net


def test_torch_defaults_span_the_whole_job(nodes_of):
    """Under DataParallelMultiGPU, torch's default group is every rank of the
    job (not the node): DistributedSampler with its defaults gives each rank a
    shard of its own, and dist.all_reduce sums over every rank."""
    from torch.utils.data import TensorDataset
    from torch.utils.data.distributed import DistributedSampler
    import torch.distributed as dist
    make()
    assert (dist.get_rank(), dist.get_world_size()) == (RANK, SIZE)
    dataset = TensorDataset(torch.arange(8 * SIZE))
    mine = list(DistributedSampler(dataset, shuffle=False))
    everyone = mpidp.MPI.COMM_WORLD.allgather(mine)
    assert sorted(i for shard in everyone for i in shard) == list(range(8 * SIZE))
    t = torch.tensor([float(RANK + 1)])
    dist.all_reduce(t)
    assert t.item() == SIZE * (SIZE + 1) / 2


def test_node_local_ddp_runs_on_the_expected_backend(nodes_of):
    """On the host, the node-local DDP's group is an "mpidp" one (its start-up
    broadcast and bucket layout go over MPI, not gloo's TCP); on a GPU it is
    the default group's backend (NCCL where every rank has a GPU)."""
    import torch.distributed as dist
    _, _, _, net = make()
    if nodes_of == 1:
        assert not isinstance(net.module, torch.nn.parallel.DistributedDataParallel)
        return
    group = net.module.process_group
    assert dist.get_world_size(group) == nodes_of
    want = "mpidp" if DEVICE.type == "cpu" else dist.get_backend()
    assert dist.get_backend(group) == want


def restart(model, daso, **kw):
    """A new job built with make(**kw) that loads `model`'s and `daso`'s
    checkpoint (deep copies, as if read back from disk)."""
    saved_model = copy.deepcopy(model.state_dict())
    saved_daso = copy.deepcopy(daso.state_dict())
    model, opt, daso, net = make(**kw)
    model.load_state_dict(saved_model)
    daso.load_state_dict(saved_daso)
    return model, opt, daso, net


# --- the sync kernel against the formula -------------------------------------


@pytest.mark.parametrize("wire", [torch.float32, torch.bfloat16, torch.float16])
def test_paramsync_merge_matches_the_formula(wire):
    """Every rank sends p_r - ref; the merge must give
    a*p + b*sum_r(round(p_r - ref)) + c*ref, computed here from all ranks' data."""
    def params_of(r):
        g = seeded(50 + r)
        return [torch.randn(7, 5, generator=g), torch.randn(1000, generator=g)]
    ref = [torch.randn(7, 5, generator=seeded(1)), torch.randn(1000, generator=seeded(2))]
    mine = [p + 0.01 * q for p, q in zip(ref, params_of(RANK))]
    from mpidp._runtime.dtypes import CODE_OF
    sync = mpidp._C.ParamSync(mpidp._runtime.mpi.world(), tuple(ref), CODE_OF[wire], 64)
    for t, v in zip(ref, mine):  # ParamSync took ref as its reference; now train "steps"
        t.copy_(v)
    sync.send()
    a, b, c = 0.25, 0.5, 0.75
    sync.merge(a, b, c)
    ref0 = [torch.randn(7, 5, generator=seeded(1)), torch.randn(1000, generator=seeded(2))]
    for k in range(2):
        deltas = [(r0 + 0.01 * q[k] - r0) for r0, q in
                  ((ref0[k], params_of(r)) for r in range(SIZE))]
        total = sum(d.to(wire).double() for d in deltas)
        expect = a * mine[k].double() + b * total + c * ref0[k].double()
        # fp32: exact up to summation order; 16-bit: one rounding per hop of the sum.
        tol = {torch.float32: 1e-6, torch.bfloat16: 2e-4 * SIZE, torch.float16: 2e-5 * SIZE}[wire]
        assert torch.allclose(ref[k].double(), expect, atol=tol), (wire, k)


def test_paramsync_outer_gradient_and_restore():
    """grad_into gives the averaged outer gradient ref - mean(p) (what SlowMo
    and DiLoCo step with), restore goes back to the shared reference, and the
    sum of one sync is read once."""
    from mpidp._runtime.dtypes import CODE_OF
    ref = [torch.randn(7, 5, generator=seeded(1)), torch.randn(1000, generator=seeded(2))]
    params = [r.clone() for r in ref]
    sync = mpidp._C.ParamSync(mpidp._runtime.mpi.world(), tuple(params), CODE_OF[torch.float32], 64)
    for k, p in enumerate(params):
        p.add_(0.01 * (RANK + 1) * (k + 1))
    sync.send()
    grads = tuple(torch.full_like(p, float("nan")) for p in params)   # never read
    sync.grad_into(grads, -1.0 / SIZE)
    for k, g in enumerate(grads):
        expect = -0.01 * (k + 1) * (SIZE + 1) / 2                     # ref - mean over ranks
        assert torch.allclose(g, torch.full_like(g, expect), atol=1e-6), (k, g.flatten()[:3])
    with pytest.raises(RuntimeError, match="no received sync"):
        sync.merge_average(SIZE, 0)
    sync.restore()
    for p, r in zip(params, ref):
        assert torch.equal(p, r)
    with pytest.raises(ValueError, match="grads: expected 2 tensors"):
        sync.grad_into(grads[:1], 1.0)


# --- training ---------------------------------------------------------------------


def one_process_epochs(model, reference, data, edit=None):
    """An on_epoch callback for train(): one epoch of `reference` on all the
    data in one process (make()'s SGD with momentum; edit(reference) before
    each step), then `model` must equal it."""
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)

    def on_epoch(_):
        for X, Y in data:
            ref_opt.zero_grad()
            F.cross_entropy(reference(X), Y).backward()
            if edit is not None:
                edit(reference)
            ref_opt.step()
        assert_params_close(model, reference, atol=1e-5, what="after an epoch")
    return on_epoch


def test_blocking_phase_equals_single_process_sgd(nodes_of, staging):
    """With a blocking average every batch and fp32 on the wire, DASO is plain
    data-parallel SGD with momentum: compare with one process on all the data."""
    data = problem(batches=6)
    model, opt, daso, net = make(epochs=3, warmup_epochs=3, cooldown_epochs=0,
                                 downcast_type=torch.float32)
    train(model, daso, net, data, epochs=3, on_epoch=one_process_epochs(model, mlp(100), data))


def test_node_average_over_several_ddp_buckets_equals_single_process_sgd(monkeypatch):
    """On the host, the node's DDP comm hook averages each bucket over MPI:
    with a model bigger than DDP's first bucket (1 MiB) backward calls it
    for several buckets, and every batch must still equal one process on
    all the data."""
    monkeypatch.setenv("MPIDP_RANKS_PER_NODE", "2" if SIZE % 2 == 0 else "1")
    calls = []
    hook = mpidp.data_parallel_multi._mpi_allreduce_mean

    def counting_hook(state, bucket):
        calls.append(bucket.is_last())
        return hook(state, bucket)
    monkeypatch.setattr(mpidp.data_parallel_multi, "_mpi_allreduce_mean", counting_hook)

    def wide(seed):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(10, 512), torch.nn.ReLU(),
                                   torch.nn.Linear(512, 512), torch.nn.ReLU(),
                                   torch.nn.Linear(512, 512), torch.nn.ReLU(),
                                   torch.nn.Linear(512, 3)).to(DEVICE)
    data = problem(batches=3)
    model = wide(100 + RANK)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    daso = mpidp.DASO(opt, total_epochs=2, warmup_epochs=2, cooldown_epochs=0,
                      downcast_type=torch.float32)
    net = mpidp.DataParallelMultiGPU(model, daso)
    train(model, daso, net, data, epochs=2, on_epoch=one_process_epochs(model, wide(100), data))
    if SIZE % 2 == 0 and DEVICE.type == "cpu":
        # One last bucket per backward, and backwards of several buckets
        # (DDP re-buckets after the first iteration).
        assert calls.count(True) == 2 * len(data) and len(calls) > calls.count(True) + 2


def _halve_in_place(model):
    for p in model.parameters():
        p.grad.mul_(0.5)


def _halve_by_replacing(model):
    for p in model.parameters():
        p.grad = p.grad * 0.5     # a new tensor, not the node-local bucket's view


@pytest.mark.parametrize("edit", [_halve_in_place, _halve_by_replacing, "scaler"],
                         ids=["grad_edited_in_place", "grad_replaced", "amp_scaler"])
def test_habits_in_the_blocking_phase_equal_single_process_sgd(nodes_of, edit):
    """The node-local average lands in `.grad` (on the host: the DDP bucket's
    views, filled over MPI); what users do to it before step() -- scale it in
    place, assign a new tensor, step through a GradScaler -- must act as on
    one process with all the data, batch after batch."""
    data = problem(batches=4)
    model, opt, daso, net = make(epochs=2, warmup_epochs=2, cooldown_epochs=0,
                                 downcast_type=torch.float32)
    if edit == "scaler":
        daso.add_scaler(torch.amp.GradScaler(DEVICE.type, init_scale=1024.0))
        edit = None
    train(model, daso, net, data, epochs=2, on_epoch=one_process_epochs(model, mlp(100), data, edit),
          before_step=edit)


@pytest.mark.parametrize("wire", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("groups", [True, False], ids=["mpi_groups", "split"])
def test_training_converges_and_stays_consistent(nodes_of, wire, groups):
    data = problem()
    # A chunk far smaller than one parameter tensor (32x32 = 1024 elements).
    model, opt, daso, net = make(epochs=8, downcast_type=wire, use_mpi_groups=groups,
                                 sending_chunk_size=100, warmup_epochs=1, cooldown_epochs=1)
    losses = train(model, daso, net, data, epochs=8)
    assert losses[-1] < 0.5 * losses[0], losses
    assert daso.phase == "cooldown"
    if daso.n_nodes > 1:
        assert daso.bytes_sent > 0


def test_cycling_phase_runs_and_skips(nodes_of):
    data = problem(batches=16)
    model, opt, daso, net = make(epochs=5, warmup_epochs=0, cooldown_epochs=0)
    assert daso.phase == "cycling" and daso.global_skip == 4   # Heat never leaves warm-up here
    train(model, daso, net, data, epochs=5)


def test_frozen_parameters(nodes_of):
    model, opt, daso, net = make(frozen=True, epochs=3)
    train(model, daso, net, problem(), epochs=3)
    assert torch.equal(model[0].weight, mlp(100)[0].weight)  # rank 0's init, never changed


def test_scheduler_and_scaler(nodes_of):
    model = mlp(100 + RANK)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + 0.01 * step))
    daso = mpidp.DASO(opt, total_epochs=3, warmup_epochs=1, cooldown_epochs=1, scheduler=sched)
    daso.add_scaler(torch.amp.GradScaler(DEVICE.type, init_scale=1024.0))
    net = mpidp.DataParallelMultiGPU(model, daso)
    losses = train(model, daso, net, problem(), epochs=3)
    assert losses[-1] < losses[0]
    assert opt.param_groups[0]["lr"] < 0.05   # the scheduler stepped


def test_checkpoint_restart_is_exact(nodes_of, staging):
    data = problem(batches=10)
    kw = dict(epochs=6, warmup_epochs=1, cooldown_epochs=1)
    model, opt, daso, net = make(**kw)
    train(model, daso, net, data, epochs=6)
    uninterrupted = copy.deepcopy(model)

    model, opt, daso, net = make(**kw)
    train(model, daso, net, data, epochs=3)
    model, opt, daso, net = restart(model, daso, **kw)   # a new job: fresh everything
    assert daso.epoch == 3
    train(model, daso, net, data, epochs=3)
    for (name, p), q in zip(model.named_parameters(), uninterrupted.parameters()):
        assert torch.equal(p, q), f"{name} differs after restart by {(p - q).abs().max().item()}"


def test_state_dict_mid_epoch_is_refused():
    model, opt, daso, net = make(epochs=2)
    daso.last_batch = 3
    net(on_device(torch.randn(2, 10))).sum().backward()
    daso.step()
    with pytest.raises(RuntimeError, match="between epochs"):
        daso.state_dict()


def test_one_rank_per_node_warns(monkeypatch):
    monkeypatch.setenv("MPIDP_RANKS_PER_NODE", "1")
    model = mlp(0)
    daso = mpidp.DASO(torch.optim.SGD(model.parameters(), lr=0.1), total_epochs=2)
    with pytest.warns(UserWarning, match="one rank per node"):
        mpidp.DataParallelMultiGPU(model, daso)


# --- bad input ---------------------------------------------------------------------


# Each constructor argument's check: tests/package/test_argument_types.py.


def test_misuse_is_explained():
    model = mlp(0)
    with pytest.raises(TypeError, match="optimizer: expected a mpidp.DASO"):
        mpidp.DataParallelMultiGPU(model, torch.optim.SGD(model.parameters(), lr=0.1))
    daso = mpidp.DASO(torch.optim.SGD(model.parameters(), lr=0.1), total_epochs=2)
    with pytest.raises(RuntimeError, match="no model"):
        daso.step()
    with pytest.raises(TypeError, match="DataParallelMultiGPU"):
        mpidp.DataParallel(model, optimizer=daso)
    with pytest.raises(TypeError, match="scaler"):
        daso.add_scaler(object())
    daso.set_model(model)
    with pytest.raises(ValueError, match="last_batch"):
        daso.step()
    with pytest.raises(ValueError, match="loss: expected a scalar"):
        daso.epoch_loss_logic(torch.ones(3))


def test_resume_with_more_epochs_follows_the_new_settings():
    """A checkpoint taken in cooldown of a 3-epoch job, restored into a 6-epoch
    job, continues in the phase a 6-epoch job has there (not the old one)."""
    model, opt, daso, net = make(epochs=3, warmup_epochs=1, cooldown_epochs=1)
    train(model, daso, net, problem(batches=4), epochs=3)
    assert daso.phase == "cooldown"
    model2, _, daso2, net2 = restart(model, daso, epochs=6, warmup_epochs=1, cooldown_epochs=1)
    assert (daso2.epoch, daso2.phase, daso2.total_epochs) == (3, "cycling", 6)
    train(model2, daso2, net2, problem(batches=4), epochs=3)
    assert daso2.phase == "cooldown"


def test_resume_with_more_warmup_epochs_goes_back_to_warmup():
    model, opt, daso, net = make(epochs=6, warmup_epochs=1, cooldown_epochs=1)
    train(model, daso, net, problem(batches=4), epochs=3)
    assert daso.phase == "cycling"
    model2, _, daso2, net2 = restart(model, daso, epochs=8, warmup_epochs=5, cooldown_epochs=1)
    assert (daso2.epoch, daso2.phase) == (3, "warmup")
    train(model2, daso2, net2, problem(batches=4), epochs=2)
    assert daso2.phase == "cycling"


@pytest.mark.skipif(SIZE < 2, reason="one node has no global sync to progress")
def test_global_sync_is_progressed_by_forward_and_gradient_hooks():
    """Every submodule's forward and every trainable parameter's gradient
    accumulation test the sync in flight (once each; set_model again replaces
    them); with hook progress off (MPIDP_HOOK_PROGRESS=0) none are installed.
    Training with them in place is checked against the references by the
    other tests."""
    before = mpidp._C.process_state()["hook_progress"]
    mpidp._C.configure(hook_progress=True)
    try:
        model, opt, daso, net = make(frozen=True)
        trainable = [p for p in model.parameters() if p.requires_grad]
        expected = len(list(net.module.modules())) + len(trainable)
        assert len(daso._progress_handles) == expected
        daso.set_model(net.module)
        assert len(daso._progress_handles) == expected
        mpidp._C.configure(hook_progress=False)
        daso.set_model(net.module)
        assert daso._progress_handles == []
    finally:
        mpidp._C.configure(hook_progress=before)
    losses = train(model, daso, net, problem(batches=4), epochs=3)
    assert losses[-1] < losses[0]


@pytest.mark.skipif(SIZE < 2, reason="one node has no global sync to progress")
def test_a_new_daso_for_the_same_model_takes_the_hooks_over():
    """Rebuilding DASO for a model (a new training phase) used to leave every
    earlier DASO's progress hooks on the parameters and submodules, piling up
    with each rebuild; the newest one's are the only ones left, and a DASO
    the program drops takes its hooks with it."""
    model, opt, daso, net = make()
    counts = [len(p._post_accumulate_grad_hooks or {}) for p in model.parameters()]
    for _ in range(5):
        daso = mpidp.DASO(opt, total_epochs=6, warmup_epochs=1, cooldown_epochs=1)
        net = mpidp.DataParallelMultiGPU(model, daso)
    assert [len(p._post_accumulate_grad_hooks or {}) for p in model.parameters()] == counts
    losses = train(model, daso, net, problem(batches=4), epochs=3)
    assert losses[-1] < losses[0]
    del net, daso
    gc.collect()
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())


def test_wrapping_a_wrapper_is_refused():
    model, opt, daso, net = make()
    with pytest.raises(TypeError, match="module: is already a mpidp.DataParallelMultiGPU"):
        mpidp.DataParallelMultiGPU(net, mpidp.DASO(opt, total_epochs=2))


def one_epoch(daso, net, data):
    for X, Y in data:
        daso.zero_grad()
        F.cross_entropy(net(my_slice(X)), my_slice(Y)).backward()
        daso.step()


def test_forgotten_epoch_loss_logic_and_non_finite_losses_warn_once():
    """Without epoch_loss_logic the schedule never leaves warm-up, silently;
    a NaN or infinite epoch loss tells it nothing. Each warns once."""
    model, opt, daso, net = make()
    data = problem(batches=2)
    daso.last_batch = len(data) - 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            one_epoch(daso, net, data)
        daso.epoch_loss_logic(float("nan"))
        one_epoch(daso, net, data)
        daso.epoch_loss_logic(float("inf"))
    messages = [str(w.message) for w in caught]
    unclosed = [m for m in messages if "ended without epoch_loss_logic" in m]
    assert len(unclosed) == 1 and "warmup" in unclosed[0], messages
    non_finite = [m for m in messages if "the epoch loss is" in m]
    assert len(non_finite) == 1 and "nan" in non_finite[0], messages


@pytest.mark.skipif(SIZE < 2, reason="one rank cannot differ from the others")
@pytest.mark.parametrize("how", ["older checkpoint", "offset"])
def test_a_rank_that_differs_is_brought_back_at_the_epoch_end(nodes_of, how):
    """A rank that reloads an older checkpoint alone, or whose model is
    changed alone, used to stay apart (a +0.1 offset through 5 epochs), each
    rank averaging differences from its own reference. At every epoch end the
    ranks are now equal (train() checks): where they are not, every rank
    takes rank 0's, with a warning."""
    model, opt, daso, net = make(epochs=6)
    data = problem(batches=4)
    train(model, daso, net, data, epochs=1)
    older = copy.deepcopy(model.state_dict())
    train(model, daso, net, data, epochs=1)
    if RANK == SIZE - 1:
        with torch.no_grad():
            if how == "older checkpoint":
                # Its DASO state is this epoch's (the schedule must match the
                # others'), its model the older one: the reference is reset
                # from it, so each rank would keep averaging from its own.
                current = copy.deepcopy(daso.state_dict())
                model.load_state_dict(older)
                daso.load_state_dict(current)
            else:
                for p in model.parameters():
                    p.add_(0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = train(model, daso, net, data, epochs=2)  # the same on every rank at each end
    assert losses[-1] < 1.5
    # Where the epoch's blocking sync did not already bring them together, the
    # epoch end did, and said so.
    told = [str(w.message) for w in caught if "parameters differ" in str(w.message)]
    for message in told:   # the changed rank, and the node-local ranks its DDP spread it to
        named = re.search(r"rank\(s\) \[([\d, ]+)\] do not match rank 0", message)
        assert named and SIZE - 1 in {int(r) for r in named.group(1).split(",")}, message


@pytest.mark.parametrize("broadcast", [True, False])
def test_buffers_are_rank0s_after_every_blocking_sync(nodes_of, broadcast):
    """Warm-up syncs globally (blocking) every batch: with broadcast_buffers
    every rank then holds rank 0's BatchNorm statistics; without it each
    rank's own (ranks train on different data)."""
    torch.manual_seed(5)
    model = BNNet(inputs=10, hidden=16).to(DEVICE)
    daso = mpidp.DASO(torch.optim.SGD(model.parameters(), lr=0.05), total_epochs=4,
                      warmup_epochs=1, cooldown_epochs=1)
    net = mpidp.DataParallelMultiGPU(model, daso, broadcast_buffers=broadcast)
    data = problem(batches=4)
    daso.last_batch = len(data) - 1
    for X, Y in data:
        daso.zero_grad()
        F.cross_entropy(net(my_slice(X)), my_slice(Y)).backward()
        daso.step()
        mean = model.bn.running_mean.detach().cpu()
        everyone = mpidp.MPI.COMM_WORLD.allgather(mean)
        same = all(torch.equal(everyone[0], m) for m in everyone)
        assert same == (broadcast or SIZE == 1), [m[:3] for m in everyone]


@pytest.mark.parametrize("broadcast", [True, False])
def test_buffers_are_node_rank0s_before_every_synced_forward(nodes_of, broadcast):
    """DDP's buffer rule inside the node (over MPI on the host): each
    training forward sees node rank 0's BatchNorm statistics as they were
    before it, unless the backward before was inside no_sync(); without
    broadcast_buffers each rank's own. Cycling phase: no global sync resets
    them in between, so the node's ranks drift apart unless synced."""
    torch.manual_seed(5)
    model = BNNet(inputs=10, hidden=16).to(DEVICE)
    daso = mpidp.DASO(torch.optim.SGD(model.parameters(), lr=0.05), total_epochs=4,
                      warmup_epochs=0, cooldown_epochs=0, max_global_skips=8)
    net = mpidp.DataParallelMultiGPU(model, daso, broadcast_buffers=broadcast)
    node = node_comm(mpidp.MPI.COMM_WORLD)
    seen = []
    model.bn.register_forward_pre_hook(lambda m, _: seen.append(m.running_mean.detach().cpu().clone()))
    data = problem(batches=6)
    daso.last_batch = 99   # the epoch goes on: its blocking sync would reset the buffers
    synced_before = True              # DDP syncs buffers before the first forward
    for b, (X, Y) in enumerate(data):
        before = model.bn.running_mean.detach().cpu().clone()
        node_rank0s = node.bcast(before, root=0)
        inside = b == 3
        with net.no_sync() if inside else contextlib.nullcontext():
            daso.zero_grad()
            F.cross_entropy(net(my_slice(X)), my_slice(Y)).backward()
        if not inside:
            daso.step()
        want = node_rank0s if broadcast and synced_before else before
        assert torch.equal(seen[-1], want), (b, seen[-1][:3], want[:3])
        synced_before = not inside
    everyone = node.allgather(model.bn.running_mean.detach().cpu())
    assert all(torch.equal(everyone[0], m) for m in everyone) == (node.size == 1), \
        "the node's ranks train on different data: their own statistics must differ"


def test_no_sync_accumulates_within_the_node(nodes_of):
    """Inside no_sync the node's ranks keep their own gradients; the first
    backward after it gives each the node's mean of the accumulated sums.
    DASO.step() inside raises."""
    model, opt, daso, net = make()
    plain = copy.deepcopy(model)   # the same values, no wrapper: each rank's own sums
    node = node_comm(mpidp.MPI.COMM_WORLD)
    batches = problem(batches=3)
    daso.zero_grad()
    for X, Y in batches[:2]:
        F.cross_entropy(plain(my_slice(X)), my_slice(Y)).backward()
    with net.no_sync():
        for X, Y in batches[:2]:
            F.cross_entropy(net(my_slice(X)), my_slice(Y)).backward()
        for (name, p), q in zip(model.named_parameters(), plain.parameters()):
            assert torch.allclose(p.grad, q.grad, atol=1e-6), f"{name}: averaged inside no_sync"
        with pytest.raises(RuntimeError, match="no_sync"):
            daso.step()
    X, Y = batches[2]
    F.cross_entropy(net(my_slice(X)), my_slice(Y)).backward()
    F.cross_entropy(plain(my_slice(X)), my_slice(Y)).backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        sums = node.allgather(q.grad.detach().cpu())
        want = torch.stack(sums).mean(0)
        assert torch.allclose(p.grad.detach().cpu(), want, atol=1e-6), name


@pytest.mark.skipif(SIZE < 2, reason="one rank cannot differ from the others")
def test_an_lr_changed_on_one_rank_is_named_at_the_next_epoch(nodes_of):
    """A scheduler stepped on the last rank only: its node's replicas would
    drift apart within each epoch, taken back to rank 0's at each epoch end
    with a warning, for ever. The next epoch's first forward names it."""
    model, opt, daso, net = make(epochs=6)
    data = problem(batches=4)
    train(model, daso, net, data, epochs=1)
    if RANK == SIZE - 1:
        opt.param_groups[0]["lr"] *= 0.5
    with pytest.raises(RuntimeError, match=r"DASO: the optimizers' settings differ across ranks: "
                                           rf"rank\(s\) \[{SIZE - 1}\] do not match rank 0 "
                                           r"\(param group 0: lr = "):
        train(model, daso, net, data, epochs=1)


@pytest.mark.skipif(SIZE < 2, reason="one rank cannot differ from the others")
def test_a_rank_that_loads_another_epochs_checkpoint_is_named_not_hung(nodes_of):
    """A rank that reloads an older epoch's DASO state alone would run other
    collectives than the rest (it used to end at the timeout); the first
    training forward of the next epoch compares the schedules and every rank
    raises, naming it."""
    model, opt, daso, net = make(epochs=6)
    data = problem(batches=4)
    train(model, daso, net, data, epochs=1)
    older = (copy.deepcopy(model.state_dict()), copy.deepcopy(daso.state_dict()))
    train(model, daso, net, data, epochs=1)
    if RANK == SIZE - 1:
        model.load_state_dict(older[0])
        daso.load_state_dict(older[1])
    with pytest.raises(RuntimeError, match=rf"rank\(s\) \[{SIZE - 1}\] do not match rank 0.*"
                                           r"checkpoint of the same epoch"):
        train(model, daso, net, data, epochs=1)
