"""flatten / write_back: the flat form the averaging algorithms send and the
fault-tolerant mode keeps (flatten into a kept buffer must equal a fresh one)."""

import torch

from mpidp._runtime.flat_buffers import flatten, write_back


def _tensors():
    g = torch.Generator().manual_seed(3)
    return [torch.randn(3, 4, generator=g), torch.randn(5, generator=g).double(),
            torch.randn(2, 3, generator=g).t()]    # a non-contiguous one


def test_flatten_into_a_kept_buffer_equals_a_fresh_flatten_each_time():
    tensors = _tensors()
    out = torch.full((sum(t.numel() for t in tensors),), float("nan"))
    for round_ in range(2):          # the buffer reused: nothing of the last round left
        for t in tensors:
            t.add_(round_)
        kept = flatten(tensors, out=out)
        assert kept.data_ptr() == out.data_ptr()
        assert torch.equal(kept, flatten(tensors, torch.float32))


def test_write_back_undoes_flatten():
    tensors = _tensors()
    before = [t.clone() for t in tensors]
    flat = flatten(tensors, out=torch.empty(sum(t.numel() for t in tensors)))
    for t in tensors:
        t.zero_()
    write_back(flat, tensors)
    for t, b in zip(tensors, before):
        assert torch.equal(t, b.to(t.dtype))
