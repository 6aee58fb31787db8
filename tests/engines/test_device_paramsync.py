"""DASO's global sync where the parameters live (_device_paramsync.py) gives
the host engine's (_C.ParamSync) results bit for bit: the same kernels pack
and merge, the same collective sums. Run on CPU tensors here, and on CUDA
tensors under MPIDP_TEST_DEVICE=cuda (scripts/gpu_check.sh)."""

import pytest
import torch

import mpidp
from mpidp import _C
from mpidp._engines.device_paramsync import DeviceParamSync
from mpidp._runtime.mpi import resolve_comm
from dp_reference import DEVICE

RANK, SIZE = mpidp.rank(), mpidp.size()


def params_of(seed, device):
    g = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (13,), (3, 4, 2), (1,)]
    return tuple(torch.randn(s, generator=g).to(device) for s in shapes)


@pytest.mark.parametrize("wire", [_C.DTYPE_BF16, _C.DTYPE_F16, _C.DTYPE_F32],
                         ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("btw", [0, 3])
def test_the_device_sync_gives_the_host_engines_bits(wire, btw):
    comm = resolve_comm(None)
    host = params_of(1, "cpu")
    dev = params_of(1, DEVICE)
    host_sync = _C.ParamSync(comm, host, wire, 1 << 20, what="host")
    dev_sync = DeviceParamSync(comm, dev, wire, 1 << 20, what="device")
    for step in range(3):
        # Each rank moves its parameters its own way between syncs.
        g = torch.Generator().manual_seed(100 * step + RANK)
        for h, d in zip(host, dev):
            delta = torch.randn(h.shape, generator=g) * 0.01
            h.add_(delta)
            d.add_(delta.to(DEVICE))
        host_sync.send(False)
        dev_sync.send(False)
        assert dev_sync.pending or dev_sync.test()
        host_sync.merge_average(SIZE, btw)
        dev_sync.merge_average(SIZE, btw)
        for h, d in zip(host, dev):
            assert torch.equal(h.view(torch.int32), d.cpu().view(torch.int32)), (step, wire, btw)
        if btw == 0:
            host_sync.set_reference()
            dev_sync.set_reference()
    assert dev_sync.wire_bytes == host_sync.wire_bytes


def test_zeros_restore_and_misuse():
    comm = resolve_comm(None)
    dev = params_of(2, DEVICE)
    before = [p.clone() for p in dev]
    sync = DeviceParamSync(comm, dev, _C.DTYPE_BF16, 1 << 20, what="device")
    with torch.no_grad():
        for p in dev:
            p.add_(1.0)
    sync.send(zero=True)                     # this rank sends nothing
    with pytest.raises(RuntimeError, match="while a sync is in flight"):
        sync.set_reference()
    sync.wait()
    sync.restore()
    for p, b in zip(dev, before):
        assert torch.equal(p, b)
    with pytest.raises(ValueError, match="n_senders >= 1"):
        sync.merge_average(0, 0)
