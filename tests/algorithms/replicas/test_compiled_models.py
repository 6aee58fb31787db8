"""The habit of torch.compile: `model = torch.compile(model)` before the
algorithm wraps it. Each low-communication algorithm trains the compiled
model (AOTAutograd's graphs, forward and backward) exactly as the model
itself, each rank on batches of its own, over several syncs; the eager run
is the reference the other tests hold to their simulations."""

import pytest
import torch

import mpidp
from dp_reference import RANK, SmallNet, seeded

pytestmark = pytest.mark.ranks3

OUTER = dict(lr=0.7, momentum=0.9, nesterov=True)


def inner_sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1)


def outer_sgd(model):
    return torch.optim.SGD(model.parameters(), **OUTER)


# name -> model -> (algorithm, the optimizer the loop steps)
MAKERS = {
    "DiLoCo": lambda m: (lambda opt: (mpidp.DiLoCo(m, opt, outer_sgd(m), 3), opt))(inner_sgd(m)),
    "EagerDiLoCo": lambda m: (lambda opt: (mpidp.EagerDiLoCo(m, opt, outer_sgd(m), 3), opt))(
        inner_sgd(m)),
    "NoLoCo": lambda m: (lambda opt: (mpidp.NoLoCo(m, opt, outer_sgd(m), 3), opt))(inner_sgd(m)),
    "SparseLoCo": lambda m: (lambda opt: (mpidp.SparseLoCo(m, opt, 3, top_k=4, chunk_size=4),
                                          opt))(inner_sgd(m)),
    "MuLoCo": lambda m: (lambda opt: (mpidp.MuLoCo(m, opt, outer_sgd(m), 3), opt))(inner_sgd(m)),
    "DESLOC": lambda m: (lambda opt: (mpidp.DESLOC(m, opt, 2), opt))(
        torch.optim.Adam(m.parameters(), lr=0.01)),
}


def train(compiled: bool, name: str):
    torch.manual_seed(3)
    model = SmallNet()
    run = torch.compile(model, backend="aot_eager") if compiled else model
    algorithm, opt = MAKERS[name](run)
    with algorithm:
        for step in range(8):
            g = seeded(100 * RANK + step)
            x, y = torch.randn(6, 5, generator=g), torch.randn(6, 2, generator=g)
            opt.zero_grad()
            torch.nn.functional.mse_loss(run(x), y).backward()
            opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_a_compiled_model_trains_as_the_model_itself(name):
    torch._dynamo.reset()
    want = train(False, name)
    got = train(True, name)
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7,
                                   msg=lambda m: f"{name}, parameter {i}, rank {RANK}: {m}")
