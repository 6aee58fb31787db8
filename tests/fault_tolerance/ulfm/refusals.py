"""Run by tests/fault_tolerance/ulfm/test_fault_tolerance.py under ULFM: in fault-tolerant mode
what cannot go on after a rank is lost is refused when it is set up, with a
message naming it, and recover(replace=True) refuses algorithms that cannot
take a replacement. Prints one line per check and "ALL REFUSED" at the end."""

import torch

import mpidp
from mpidp._runtime.mpi import communicator
from mpidp.algorithms.driver import Driver


def refused(what, build, expected):
    try:
        build()
    except NotImplementedError as error:
        assert expected in str(error), f"{what}: {error}"
        print(f"{what}: refused: {error}", flush=True)
        return
    raise AssertionError(f"{what}: was accepted in fault-tolerant mode")


def model():
    return torch.nn.Linear(4, 2)


class OwnDriver(Driver):
    """A program's own algorithm's driver, with no recovery."""
    what = "OwnAlgorithm"

    def __init__(self, module):
        self.module = module
        self._claim(module, communicator(None))

    def _remove_hooks(self):
        pass


refused("a driver of the program's own with no recovery", lambda: OwnDriver(model()),
        "OwnAlgorithm's has no recovery (_continue_on(survivors))")
# Growing back with an algorithm that cannot take a replacement yet: refused
# by recover(replace=True) before anything of the recovery.
m = model()
daso = mpidp.DASO(torch.optim.SGD(m.parameters(), lr=0.1), total_epochs=1)
net = mpidp.DataParallelMultiGPU(m, daso)
refused("recover(replace=True) under DASO", lambda: mpidp.recover(replace=True),
        "DASO cannot take a replacement (growing back is not built")
daso.detach()
averager = mpidp.PeriodicModelAverager(period=2)
refused("recover(replace=True) beside a PeriodicModelAverager",
        lambda: mpidp.recover(replace=True), "PeriodicModelAverager alone knows no model")
del averager
print("ALL REFUSED", flush=True)
