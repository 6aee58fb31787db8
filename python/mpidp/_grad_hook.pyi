"""mpidp._grad_hook: DataParallel's gradient hook in C++ (csrc/torch/grad_hook.cpp),
built against libtorch where torch was importable at build time."""

import torch

from ._C import Reducer

class Hooks:
    def remove(self) -> None: ...

def install(reducer: Reducer) -> Hooks: ...
def count(param: torch.Tensor) -> int: ...
