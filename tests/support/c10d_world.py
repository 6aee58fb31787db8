"""The default process group of the "mpidp" backend for the tests that
need it. Other test modules run in the same process (at N ranks the whole
suite is one mpirun job) and may have made a gloo default group: it is
replaced for the module's tests and destroyed after them, and whoever needs
gloo again makes it again (mpidp.init_process_group does when none exists)."""

import pytest
import torch.distributed as dist

import mpidp


@pytest.fixture(scope="module", autouse=True)
def mpidp_world():
    if dist.is_initialized() and dist.get_backend() != "mpidp":
        dist.destroy_process_group()
    if not dist.is_initialized():
        dist.init_process_group("mpidp")
    yield
    dist.destroy_process_group()


__all__ = ["mpidp_world", "mpidp"]
