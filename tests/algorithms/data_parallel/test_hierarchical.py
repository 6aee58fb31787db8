"""DataParallel(hierarchical=True): gradients summed within each node, each
local rank's slice across the nodes, then gathered within the node.

Nodes are emulated with MPIDP_RANKS_PER_NODE (every divisor of the job's
size): with at least two nodes of at least two ranks the mode is on, and the
averaged gradients must equal a single-process reference (every rank's loss
on its own slice, averaged) -- to float32 rounding (the sum is taken in
another order than a flat allreduce), to the wire's rounding for bfloat16,
and to the quantization bound for uint8 (only the cross-node phase is
quantized). With one rank per node or a single node it warns and reduces
flat. Several small buckets, so buckets' phases overlap."""

import warnings

import pytest
import torch

import mpidp
from dp_reference import RANK, SIZE, rank_slice, seeded

pytestmark = pytest.mark.ranks3


def node_sizes():
    return [k for k in range(1, SIZE + 1) if SIZE % k == 0]


def net_and_reference():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(50, 40), torch.nn.Tanh(), torch.nn.Linear(40, 3),
                                torch.nn.Linear(3, 3))
    reference = torch.nn.Sequential(torch.nn.Linear(50, 40), torch.nn.Tanh(),
                                    torch.nn.Linear(40, 3), torch.nn.Linear(3, 3))
    reference.load_state_dict(model.state_dict())
    return model, reference


@pytest.mark.parametrize("wire,tol", [(None, 1e-6), (torch.bfloat16, 2e-2), (torch.uint8, 1e-2)])
@pytest.mark.parametrize("per_node", node_sizes())
def test_gradients_match_the_reference(per_node, wire, tol, monkeypatch):
    monkeypatch.setenv("MPIDP_RANKS_PER_NODE", str(per_node))
    model, reference = net_and_reference()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        net = mpidp.DataParallel(model, hierarchical=True, wire_dtype=wire,
                                 first_bucket_cap_mb=0.001, bucket_cap_mb=0.004)
    helps = per_node > 1 and SIZE // per_node > 1
    assert net.hierarchical == helps
    assert any("hierarchical=True cannot help" in str(w.message) for w in caught) == (not helps)
    gen = seeded(5)
    for step in range(2):
        x, y = torch.randn(4 * SIZE, 50, generator=gen), torch.randn(4 * SIZE, 3, generator=gen)
        model.zero_grad()
        torch.nn.functional.mse_loss(net(rank_slice(x, RANK)), rank_slice(y, RANK)).backward()
        reference.zero_grad()
        for r in range(SIZE):
            (torch.nn.functional.mse_loss(reference(rank_slice(x, r)), rank_slice(y, r)) / SIZE).backward()
        # Relative to the largest gradient: a quantization block (or bf16's
        # rounding of partial sums) spans every parameter of a bucket.
        scale = max(q.grad.abs().max().item() for q in reference.parameters())
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=tol * scale,
                                       msg=lambda m: f"step {step}, {name}: {m}")


def test_unused_parameters_keep_grad_none_and_settings_are_checked(monkeypatch):
    monkeypatch.setenv("MPIDP_RANKS_PER_NODE", str(2 if SIZE % 2 == 0 else 1))
    model, _ = net_and_reference()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        net = mpidp.DataParallel(model, hierarchical=True)
    x = torch.randn(4, 50)
    out = model[2](model[1](model[0](x)))          # the last layer unused
    net.zero_grad()
    torch.nn.functional.mse_loss(net.module[:3](x), out.detach() + 1).backward()
    assert model[3].weight.grad is None
    with pytest.raises(TypeError, match="hierarchical: expected a bool"):
        mpidp.DataParallel(model, hierarchical=1)
