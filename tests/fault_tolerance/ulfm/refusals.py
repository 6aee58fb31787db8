"""Run by tests/fault_tolerance/ulfm/test_fault_tolerance.py under ULFM: in fault-tolerant mode
what cannot go on after a rank is lost is refused when it is set up, with a
message naming it, and recover(replace=True) refuses algorithms that cannot
take a replacement. Prints one line per check and "ALL REFUSED" at the end."""

import warnings

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


class OwnRecoveringDriver(OwnDriver):
    """A program's own algorithm's driver that goes on over the survivors but
    does not say that it repeats a replacement's set-up."""

    def _continue_on(self, survivors):
        self._claim(self.module, communicator(survivors))


# Growing back with an algorithm that cannot take a replacement: refused by
# recover(replace=True) before anything of the recovery.
own = OwnRecoveringDriver(model())
refused("recover(replace=True) under a program's own driver", lambda: mpidp.recover(replace=True),
        "OwnAlgorithm cannot take a replacement (its recovery does not say")
own.detach()
averager = mpidp.PeriodicModelAverager(period=2)
refused("recover(replace=True) beside a PeriodicModelAverager",
        lambda: mpidp.recover(replace=True), "PeriodicModelAverager alone knows no model")
del averager
# A model wrapped by one algorithm, then taken over by another: a
# replacement's script would build the first one, which no survivor repeats.
# Said at set-up too, in the takeover's warning.
net = mpidp.DataParallel(model())
with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always")
    slow = mpidp.SlowMoDistributedDataParallel(net.module, localsgd_frequency=2)
assert any("recover(replace=True) will refuse to grow the job back, as a replacement's script "
           "would build a DataParallel first" in str(w.message) for w in said), \
    [str(w.message) for w in said]
print("refused at set-up: a model taken over by another algorithm (warned)", flush=True)
refused("recover(replace=True) after another algorithm took the model over",
        lambda: mpidp.recover(replace=True),
        "SlowMoDistributedDataParallel took its model over from a DataParallel: a replacement "
        "runs the script from the top and builds that one first")
slow.detach()
print("ALL REFUSED", flush=True)
