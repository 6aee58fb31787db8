"""Training a data-parallel model and a single-process reference side by side.

Every rank draws the same global batches from a seeded generator and trains on
its own slice of each; the reference trains one process on the whole batch
(the union of the slices). The data-parallel loss is the mean over ranks of
each rank's mean loss, so the reference loss is the mean of the per-slice
losses; both models must end on the same parameters."""

from __future__ import annotations

import copy
import os
import re

import torch
import torch.nn.functional as F
from mpi4py import MPI

import mpidp

RANK = MPI.COMM_WORLD.Get_rank()
SIZE = MPI.COMM_WORLD.Get_size()

# The device models and batches live on. MPIDP_TEST_DEVICE=cuda runs the same
# reference comparisons on the GPU (scripts/gpu_check.sh does); data is drawn
# on the CPU from the seeded generators either way, so both see the same numbers.
DEVICE = torch.device(os.environ.get("MPIDP_TEST_DEVICE", "cpu"))
if DEVICE.type == "cuda":
    # Bitwise-repeatable kernels and no TF32, so that a rank's slice and the
    # reference's same slice give the same gradients, as on the CPU.
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False


class SmallNet(torch.nn.Module):
    """Two layers with tanh between them: the model of the averaging tests
    (5 inputs, 7 hidden, 2 outputs unless a test asks for other sizes)."""

    def __init__(self, inputs=5, hidden=7, outputs=2):
        super().__init__()
        self.l1 = torch.nn.Linear(inputs, hidden)
        self.l2 = torch.nn.Linear(hidden, outputs)

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x)))


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rank_slice(t: torch.Tensor, rank: int = RANK, size: int = SIZE) -> torch.Tensor:
    n = t.shape[0] // size
    return t[rank * n:(rank + 1) * n]


def build(make_model, seed: int) -> torch.nn.Module:
    """make_model() initialised from `seed` (on the CPU, so the values do not
    depend on the device), on DEVICE."""
    torch.manual_seed(seed)
    return make_model().to(DEVICE)


def on_device(*tensors: torch.Tensor):
    """The tensors moved to DEVICE (a tuple, or the tensor itself for one)."""
    moved = tuple(t.to(DEVICE) for t in tensors)
    return moved[0] if len(moved) == 1 else moved


def max_abs_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    return max(((pa[k] - pb[k]).abs().max().item() for k in pa), default=0.0)


def assert_params_close(model, reference, atol=2e-5, rtol=1e-4, what=""):
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.allclose(p, q, atol=atol, rtol=rtol), (
            f"{what} parameter {name}: max difference {(p - q).abs().max().item():.3g}")


def assert_same_on_all_ranks(model: torch.nn.Module) -> None:
    """Every parameter is bitwise equal to rank 0's."""
    for name, p in model.named_parameters():
        mine = p.detach().cpu().clone()
        theirs = mine.clone()
        MPI.COMM_WORLD.Bcast(theirs.numpy(), root=0)
        assert torch.equal(mine, theirs), f"parameter {name} differs from rank 0's on rank {RANK}"


def slice_losses(model, X, Y, loss_fn, size=SIZE):
    """Per-rank losses of the reference: rank r's loss on rank r's slice."""
    return [loss_fn(model, rank_slice(X, r, size), rank_slice(Y, r, size), r) for r in range(size)]


def reference_step(model, X, Y, loss_fn, size=SIZE):
    """The single-process equivalent of one data-parallel backward."""
    loss = sum(slice_losses(model, X, Y, loss_fn, size)) / size
    loss.backward()
    return loss


def cross_entropy(model, x, y, _rank=None):
    """The classification loss of the reference comparisons, as the
    loss_fn(model, x, y[, rank]) that reference_step and
    step_like_one_process take."""
    return F.cross_entropy(model(x), y)


def classification_batch(g: torch.Generator, n: int, shape=(10, 4)):
    """n inputs and their class labels drawn from `g`, on DEVICE; shape =
    (inputs, classes)."""
    n_in, n_classes = shape
    return on_device(torch.randn(n, n_in, generator=g),
                     torch.randint(0, n_classes, (n,), generator=g))


def data_parallel_and_reference(make_model, make_opt, seed, blocking, **options):
    """make_model() wrapped in DataParallel (blocking_parameter_updates =
    `blocking`, `options` passed on) with a DataParallelOptimizer of
    make_opt(parameters), and its single-process reference with its own
    make_opt: (model, net, opt, reference, ref_opt). Every rank initialises
    its model from seed + RANK, so the wrapper must adopt rank 0's: the
    reference's, from `seed`."""
    model, reference = build(make_model, seed + RANK), build(make_model, seed)
    opt = mpidp.DataParallelOptimizer(make_opt(model.parameters()))
    net = mpidp.DataParallel(model, optimizer=opt, blocking_parameter_updates=blocking, **options)
    return model, net, opt, reference, make_opt(reference.parameters())


def step_like_one_process(net, opt, reference, ref_opt, X, Y, loss_fn=cross_entropy,
                          edit_reference_grads=None):
    """One data-parallel step of `net` and `opt` on this rank's slice of
    (X, Y), and the same step of `reference` with `ref_opt` on the whole
    batch; edit_reference_grads(reference) runs between the reference's
    backward and its step (what a user hook does to the wrapped model's
    gradients)."""
    opt.zero_grad()
    ref_opt.zero_grad()
    loss_fn(net, rank_slice(X), rank_slice(Y)).backward()
    reference_step(reference, X, Y, loss_fn)
    if edit_reference_grads is not None:
        edit_reference_grads(reference)
    opt.step()
    ref_opt.step()


def train_like_one_process(net, opt, model, reference, ref_opt, loss_fn, shape, seed,
                           steps=3, edit_reference_grads=None, what="after training"):
    """`steps` data-parallel steps of `net` (the wrapper of `model`) and `opt`
    on each rank's slice of a batch, and the same steps of `reference` with
    `ref_opt` on the whole batch; then model equals the reference on every
    rank. shape = (inputs, classes); edit_reference_grads as in
    step_like_one_process."""
    g = seeded(seed)
    for _ in range(steps):
        X, Y = classification_batch(g, 4 * SIZE, shape)
        step_like_one_process(net, opt, reference, ref_opt, X, Y, loss_fn, edit_reference_grads)
    net.synchronize()
    assert_params_close(model, reference, what=what)
    assert_same_on_all_ranks(model)


def clone_model(model):
    return copy.deepcopy(model)


def per_node_options():
    """Ranks per emulated node to test: 1, and 2 where that makes 2+ nodes."""
    return [1, 2] if SIZE % 2 == 0 and SIZE > 1 else [1]


def flat_params(model):
    """The model's parameters as one detached vector."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def regression_batches(seed, steps, shape=(5, 2), per_rank=4):
    """`steps` batches of per_rank * SIZE inputs and targets drawn from
    `seed` (shape = (inputs, outputs)): the averaging tests' data, of which
    each rank trains on its own slice."""
    gen = seeded(seed)
    n, (n_in, n_out) = per_rank * SIZE, shape
    return [(torch.randn(n, n_in, generator=gen), torch.randn(n, n_out, generator=gen))
            for _ in range(steps)]


def node_replicas(init, nodes, lr):
    """The start of a SlowMo-style simulation: every node's replica of `init`
    with its own SGD (momentum 0.9), and per node the slow momentum's state,
    theta (init's weights) and u (zero): (replicas, opts, theta, u)."""
    replicas = [copy.deepcopy(init) for _ in range(nodes)]
    opts = [torch.optim.SGD(r.parameters(), lr=lr, momentum=0.9) for r in replicas]
    theta = [flat_params(init).clone() for _ in range(nodes)]
    u = [torch.zeros_like(theta[0]) for _ in range(nodes)]
    return replicas, opts, theta, u


def node_loss(model, x, y, ranks):
    """The mean over the node's ranks of each rank's slice loss (what the
    node's averaged gradients are the gradient of)."""
    return sum(torch.nn.functional.mse_loss(model(rank_slice(x, r)), rank_slice(y, r))
               for r in ranks) / len(ranks)


def local_steps(replicas, opts, x, y, per_node, clip_norm=None):
    """One local SGD step of every node's replica on its ranks' slices of
    (x, y); with clip_norm the node's gradients are clipped to that norm
    before the step."""
    for n, (model, opt) in enumerate(zip(replicas, opts)):
        opt.zero_grad()
        node_loss(model, x, y, range(n * per_node, (n + 1) * per_node)).backward()
        if clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
        opt.step()


def slow_momentum_step(replicas, theta, u, beta, alpha, lr, memory_efficient):
    """SlowMo's slow momentum on simulated node replicas (in place):
    u = beta u + (theta - x_bar)/lr, theta -= alpha lr u, every replica = its
    theta; x_bar is the world mean (memory-efficient: one shared average)
    or the replica's own weights."""
    world_mean = torch.stack([flat_params(r) for r in replicas]).mean(0)
    for n, r in enumerate(replicas):
        x_bar = world_mean if memory_efficient else flat_params(r)
        u[n] = beta * u[n] + (theta[n] - x_bar) / lr
        theta[n] = theta[n] - alpha * lr * u[n]
        torch.nn.utils.vector_to_parameters(theta[n].clone(), r.parameters())


def slowmo_step(net, opt, x, y) -> None:
    """One step of a SlowMoDistributedDataParallel `net` on this rank's slice
    of (x, y): backward, opt.step(), then net.perform_slowmo(opt)."""
    opt.zero_grad()
    F.mse_loss(net(rank_slice(x)), rank_slice(y)).backward()
    opt.step()
    net.perform_slowmo(opt)


def differing_steps(who: str, step: str = r"\d+", others_step: str = r"\d+") -> str:
    """The regex of the error a sync raises when the last rank went back to
    `step` (an earlier checkpoint loaded on it alone) and the others are at
    `others_step` (mpidp._runtime.model_consistency.check_same_step)."""
    others = re.escape(str(list(range(SIZE - 1))))
    return (rf"{who}: the ranks reached this sync at different steps \(rank\(s\) "
            rf"\[{SIZE - 1}\] at step {step}; rank\(s\) {others} at step {others_step}\)")


def differing_setting(who: str, setting: str, last, rank0) -> str:
    """The regex of the error a sync raises when the last rank's optimizer
    `setting` is `last` and rank 0's is `rank0`."""
    return (rf"{who}: the optimizers' settings differ across ranks: rank\(s\) \[{SIZE - 1}\] "
            rf"do not match rank 0 \({setting} = {last} on rank {SIZE - 1}, {rank0} on rank 0\)")


# Models and an optimizer several folders' tests share.

class MLP(torch.nn.Module):
    def __init__(self, n_in=10, n_out=4):
        super().__init__()
        self.l1, self.l2, self.l3 = (torch.nn.Linear(n_in, 32), torch.nn.Linear(32, 32),
                                     torch.nn.Linear(32, n_out))

    def forward(self, x, **_):
        return self.l3(torch.relu(self.l2(torch.relu(self.l1(x)))))


class BNNet(torch.nn.Module):
    """Linear, BatchNorm (running statistics: buffers), Linear."""
    def __init__(self, inputs=6, hidden=8):
        super().__init__()
        self.l1 = torch.nn.Linear(inputs, hidden)
        self.bn = torch.nn.BatchNorm1d(hidden)
        self.l2 = torch.nn.Linear(hidden, 3)

    def forward(self, x):
        return self.l2(torch.relu(self.bn(self.l1(x))))


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3)
