"""Lightning on the "mpidp" backend under mpirun: the Trainer's own set-up
(its MPI cluster environment, init_process_group("mpidp"), its
DistributedSampler, DDP) trains like one process on the union of every
rank's batches, and a metric logged with sync_dist is every rank's mean."""

import copy
import os

import lightning as L   # installed by `make setup` (scripts/setup_env.sh)
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DistributedSampler

from dp_reference import RANK, SIZE, seeded

pytestmark = pytest.mark.ranks3
BATCH, STEPS, LR = 4, 3, 0.1


@pytest.fixture
def lightning_makes_the_group():
    """Lightning initialises torch.distributed itself: whatever default group
    earlier tests left is destroyed first, and Lightning's group and the
    MASTER_ADDR / MASTER_PORT it sets are removed after."""
    if dist.is_initialized():
        dist.destroy_process_group()
    saved = dict(os.environ)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)


class Regression(L.LightningModule):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def training_step(self, batch, index):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True, on_step=True, on_epoch=False)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


def test_lightning_ddp_strategy_on_mpidp_trains_like_one_process(lightning_makes_the_group):
    g = seeded(5)
    x = torch.randn(STEPS * BATCH * SIZE, 6, generator=g)
    y = torch.randn(STEPS * BATCH * SIZE, 2, generator=g)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))

    # The reference: a DistributedSampler without shuffling gives rank r the
    # samples r, r + SIZE, ...: step s's union is one block of BATCH x SIZE.
    ref = copy.deepcopy(net)
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    last_losses = None
    for s in range(STEPS):
        block = slice(s * BATCH * SIZE, (s + 1) * BATCH * SIZE)
        xb, yb = x[block], y[block]
        with torch.no_grad():
            out = ref(xb)
            last_losses = [nn.functional.mse_loss(out[r::SIZE], yb[r::SIZE]) for r in range(SIZE)]
        opt.zero_grad()
        nn.functional.mse_loss(ref(xb), yb).backward()
        opt.step()

    module = Regression(copy.deepcopy(net))
    trainer = L.Trainer(accelerator="cpu", devices=SIZE, num_nodes=1, max_epochs=1,
                        strategy=DDPStrategy(process_group_backend="mpidp"), logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    data = torch.utils.data.TensorDataset(x, y)
    # The user's own sampler, unshuffled (Lightning's would shuffle), made
    # before the group exists; Lightning keeps a DistributedSampler it is given.
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(
        data, num_replicas=SIZE, rank=RANK, shuffle=False))
    trainer.fit(module, loader)

    assert dist.get_backend() == "mpidp"
    assert (trainer.world_size, trainer.global_rank) == (SIZE, RANK)
    assert trainer.global_step == STEPS
    for (name, p), q in zip(module.net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), atol=1e-6, rtol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")
    torch.testing.assert_close(trainer.callback_metrics["train_loss"],
                               torch.stack(last_losses).mean(), atol=1e-6, rtol=1e-5)
