"""`horovod` for Horovod's own test suite: mpidp.horovod under Horovod's
name, so that `import horovod.torch as hvd` runs the suite unchanged on
mpidp (tests/horovod/test_horovod_suite.py). Users change their import instead."""

import sys

import mpidp.horovod as _horovod
import mpidp.horovod.torch as _torch

sys.modules["horovod"] = _horovod
sys.modules["horovod.torch"] = _torch
