"""DataParallel's device-resident reduction: gradient buckets summed where
they live (NCCL on a side stream), never copied to the host.

Chosen by `device_comm_for` when every rank of the communicator has a GPU of
its own and NCCL is loaded (torch's); where NCCL cannot serve (ranks sharing
a GPU) but the MPI library takes device pointers (CUDA-aware), MPI sums the
buckets where they live instead; otherwise GPU gradients take the host
staging path (_reducer._Staging). MPIDP_DP_DEVICE_COMM picks by hand:
'staging', 'nccl', 'mpi', or 'standin' -- the MPI stand-in that runs this
module's ordering logic on CPU tensors in the tests.

The order of one bucket, b:
  hook (bucket full)   on the current stream: scale by 1/divisor (blocking,
                       in place) or copy-and-scale into b's communication
                       buffer and zero the bucket (non-blocking); the side
                       stream waits for that, runs the allreduce and records
                       b's "done" event; the core is told (staged) and sums
                       b's flags on the host (which parameters any rank had).
  completion           the current stream waits for "done" (no host wait):
                       blocking, before .grad is read; non-blocking, before
                       the mean is copied or added into .grad (the core
                       records which, per parameter).
  next pass            every "done" is waited for by the current stream
                       before the buckets are written again.
The stand-in runs the same calls with CPU tensors: a "stream" is the calling
thread, the allreduce an MPI_Iallreduce in place, and waiting for "done"
waits for that request, so a missing wait reads an unreduced bucket. MPI on
device pointers runs the stand-in's order: it knows no streams, so a bucket
is posted once the current stream has written it (a host wait) and read
after the request's wait.
"""

from __future__ import annotations

import atexit
import glob
import os
import socket
from typing import List, Optional, Sequence, Tuple

import torch

from .. import _C
from .._runtime import config
from .._runtime import mpi as _mpi  # noqa: F401 -- its exit handler registers first
from .._runtime.dtypes import code_of
from .._runtime.flat_buffers import pack_bytes, unpack_bytes
# Per member parameter of a bucket: its offset and length in the bucket.
Members = Sequence[Tuple[int, int]]

_DELIVER_COPY, _DELIVER_ADD = 1, 2   # as Reducer.device_deliveries reports them


def device_comm_for(mpi_comm, c_comm, device: torch.device, *, wire: bool, hierarchical: bool,
                    fault_tolerant: bool,
                    setting: str = "MPIDP_DP_DEVICE_COMM") -> Optional[_C.DevComm]:
    """The device communicator DataParallel reduces `device`'s gradients with,
    or None for the host path (staging on a GPU). Collective (the setting
    itself is compared across ranks with DataParallel's others): every rank
    learns every rank's view, so all take the same path, also where some
    ranks train on CPUs."""
    return choose_device_comm(mpi_comm, c_comm, device, by_arguments=bool(
        wire or hierarchical or fault_tolerant), setting=setting)[0]


def choose_device_comm(mpi_comm, c_comm, device: torch.device, *, by_arguments: bool,
                       setting: str) -> Tuple[Optional[_C.DevComm], Optional[str]]:
    """device_comm_for's choice and, where it is the host path for a GPU
    tensor, why (the "mpidp" backend warns with it). `setting` names the
    variable that picks by hand (MPIDP_DP_DEVICE_COMM, MPIDP_C10D_DEVICE_COMM);
    by_arguments: the caller's own arguments take the host path."""
    asked = config.get(setting)
    held = "parameters" if setting == "MPIDP_DP_DEVICE_COMM" else "tensors"
    if asked == "staging":
        return None, f"{setting}=staging"
    if asked == "standin" and device.type != "cpu":
        raise ValueError(f"{setting}=standin runs the device path's logic on CPU "
                         f"tensors (tests); the {held} are on {device}")
    aware = device.type != "cuda" or _C.mpi_cuda_aware()
    reason = None
    if asked not in ("standin", "mpi") and device.type != "cuda":
        reason = f"the {held} are on {device}"
    gpu_id = _gpu_identity(device) if reason is None and asked not in ("standin", "mpi") else None
    libs = _nccl_libraries() if gpu_id is not None and not by_arguments else None
    if gpu_id is not None and not by_arguments and libs is None:
        reason = "NCCL is not loaded in this process (torch's libnccl)"
    views = mpi_comm.allgather((reason, gpu_id, by_arguments, aware))
    if any(v[2] for v in views):
        return None, "fault-tolerant mode (or the caller's settings) goes through the host"
    if asked == "standin":
        return _shared(c_comm, "standin", lambda: _C.DevComm(c_comm, "standin")), None
    all_aware = all(v[3] for v in views)
    if asked == "mpi":
        if not all_aware:
            rank = next(r for r, v in enumerate(views) if not v[3])
            raise ValueError(f"{setting}=mpi: rank {rank}'s MPI does not take device "
                             "pointers (MPIX_Query_cuda_support)")
        return _shared(c_comm, "mpi", lambda: _C.DevComm(c_comm, "mpi")), None
    problem = next((f"rank {r}: {v[0]}" for r, v in enumerate(views) if v[0]), None)
    ids = [v[1] for v in views]
    shared_gpu = problem is None and len(set(ids)) < len(ids)
    if shared_gpu:
        problem = "two ranks share a GPU (NCCL needs one GPU per rank)"
    if problem is not None:
        if asked == "nccl":
            raise ValueError(f"{setting}=nccl: {problem}")
        if shared_gpu and all_aware:  # NCCL cannot serve, a CUDA-aware MPI can
            return _shared(c_comm, "mpi", lambda: _C.DevComm(c_comm, "mpi")), None
        return None, problem + (" and MPI does not take device pointers" if shared_gpu else "")
    nccl, cudart = libs
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _shared(c_comm, f"nccl:{index}", lambda: _nccl_comm(c_comm, nccl, cudart, index)), None


def _nccl_comm(c_comm, nccl: str, cudart: str, index: int) -> _C.DevComm:
    # NCCL's set-up makes the communicator's GPU current; the caller's stays so.
    with torch.cuda.device(index):
        return _C.DevComm(c_comm, "nccl", nccl, cudart, index)


# One device communicator per (communicator, device), shared by every
# DataParallel over it: an NCCL communicator costs a collective set-up and
# device memory, and the wrappers' sums must reach the GPU in one program
# order, so they share one side stream too. Kept (with the Comm, whose id is
# the key) until exit, where they are closed while CUDA and MPI still run.
_SHARED: dict = {}


def _shared(c_comm, key: str, make):
    entry = _SHARED.get((id(c_comm), key))
    if entry is None or entry[1].aborted:
        entry = (c_comm, make())
        _SHARED[(id(c_comm), key)] = entry
    return entry[1]


def side_stream(devcomm, device: torch.device):
    """The stream devcomm's sums run on (one per device communicator)."""
    stream = _STREAMS.get(id(devcomm))
    if stream is None:
        stream = _STREAMS[id(devcomm)] = torch.cuda.Stream(device)
    return stream


_STREAMS: dict = {}


@atexit.register
def _close_at_exit() -> None:
    # Registered after mpidp._runtime.mpi's exit handler, so it runs before it (and
    # before MPI_Finalize): what is in flight lands, then NCCL is torn down.
    for _, devcomm in _SHARED.values():
        devcomm.close()
    _SHARED.clear()


def _gpu_identity(device: torch.device) -> str:
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    return f"{socket.gethostname()}/{uuid if uuid is not None else index}"


def _nccl_libraries() -> Optional[Tuple[str, str]]:
    """Paths of the libnccl and CUDA runtime this process loaded (torch's), or None."""
    torch.cuda.init()
    found = {}
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1] if "/" in line else ""
                base = os.path.basename(path)
                for key in ("libnccl.so", "libcudart.so"):
                    # torch may carry a renamed copy (libcudart-<hash>.so.N)
                    if base.startswith(key.split(".")[0]) and ".so" in base and key not in found:
                        found[key] = path
    except OSError:
        pass
    if "libnccl.so" not in found:  # loaded lazily by some builds: torch's own copy
        site = os.path.dirname(os.path.dirname(torch.__file__))
        hits = glob.glob(os.path.join(site, "nvidia", "*", "lib", "libnccl.so*"))
        if hits:
            found["libnccl.so"] = hits[0]
    if "libnccl.so" not in found or "libcudart.so" not in found:
        return None
    return found["libnccl.so"], found["libcudart.so"]


def _written(t: torch.Tensor) -> None:
    """MPI reads `t` next, outside any stream: the current stream's writes to
    it must have happened (a host wait for a GPU tensor)."""
    if t.is_cuda:
        torch.cuda.current_stream(t.device).synchronize()


def deliver(r, b: int, data: torch.Tensor, comm: torch.Tensor, members: Members) -> None:
    """Non-blocking mode: the deliveries the core recorded for bucket b (r:
    its reducer), from `comm`, the mean, into `data`, the bucket."""
    modes = r.device_deliveries(b)
    if not any(modes):
        return
    if modes.count(modes[0]) == len(modes):   # the usual case: one kernel
        _deliver_into(data, comm, modes[0])
        return
    for (offset, numel), mode in zip(members, modes):
        if mode:
            _deliver_into(data[offset:offset + numel], comm[offset:offset + numel], mode)


def _deliver_into(grads: torch.Tensor, mean: torch.Tensor, mode: int) -> None:
    if mode == _DELIVER_COPY:
        grads.copy_(mean)
    else:
        grads.add_(mean)


class DeviceReduction:
    """The device path's half of GradientReducer: the same calls as
    _reducer._Staging (stage_full, copy, new_pass), with the buckets reduced
    where they live (module docstring)."""

    def __init__(self, devcomm: _C.DevComm, dev: Tuple[torch.Tensor, ...], infos,
                 members: List[Members], separate: bool, name: str, rank: int):
        self._dc = devcomm
        # NCCL orders its sums on a stream; MPI (and its stand-in) on the host.
        self._host_ordered = devcomm.kind != "nccl"
        self._rank = rank
        self._data = tuple(d[:n] for d, (n, _, _) in zip(dev, infos))
        self._dtype = [code_of(d.dtype, "bucket") for d in dev]
        # Non-blocking: the mean waits in a buffer of its own until delivered.
        self._comm = tuple(torch.empty_like(d) for d in self._data) if separate else None
        self._members = members
        self._name = name
        self._what = [f"{name}: allreduce of gradient bucket {b + 1}/{len(dev)} on the device"
                      for b in range(len(dev))]
        self._done: list = [None] * len(dev)      # per bucket: the sum in flight
        self._side = None if self._host_ordered or not dev else side_stream(devcomm, dev[0].device)

    # -- the hook side -----------------------------------------------------------

    def stage_full(self, r, flush: bool) -> None:
        """Start the sum of every bucket the core says is full, and tell it."""
        del flush  # nothing travels to the host: nothing to wait for
        start = 0
        while (b := r.next_to_stage(start)) is not None:
            start = b + 1
            self._post(b, r.divisor)
            r.staged(b)

    def _post(self, b: int, divisor: int) -> None:
        data = self._data[b]
        if self._comm is not None:
            target = self._comm[b]
            if divisor != 1:
                torch.mul(data, 1.0 / divisor, out=target)
            else:
                target.copy_(data)
            data.zero_()   # the .grad views start from zero, as in the host path
        else:
            target = data
            if divisor != 1:
                target.mul_(1.0 / divisor)
        what = self._what[b]
        if self._host_ordered:
            _written(target)
            self._done[b] = self._dc.allreduce_(target.data_ptr(), target.numel(), self._dtype[b], 0, what)
        else:
            # The allocator must not hand the memory out again while the sum runs.
            target.record_stream(self._side)
            current = torch.cuda.current_stream(target.device)
            self._side.wait_stream(current)
            with torch.cuda.stream(self._side):
                self._dc.allreduce_(target.data_ptr(), target.numel(), self._dtype[b],
                                    self._side.cuda_stream, what)
                event = torch.cuda.Event()
                event.record(self._side)
            self._done[b] = event

    # -- completion ----------------------------------------------------------------

    def copy(self, r, b: int, to_device: bool) -> None:
        """Where staging copies bucket b between host and device: nothing
        travels; before the mean is read (to_device) the reading stream waits
        for its sum, and non-blocking mode's recorded deliveries are made."""
        if not to_device:
            return
        # A sum the watchdog aborted (deadline, NCCL's error) must raise, not
        # hand out what it left in the bucket.
        self._dc.check()
        self._wait(b)
        if self._comm is not None:
            deliver(r, b, self._data[b], self._comm[b], self._members[b])

    def _wait(self, b: int) -> None:
        done = self._done[b]
        if done is None:
            return
        if self._host_ordered:
            self._dc.wait(done)
        else:
            torch.cuda.current_stream(self._data[b].device).wait_event(done)
        self._done[b] = None

    def broadcast_(self, tensors) -> None:
        """`tensors` become rank 0's: their bytes, packed into one buffer
        (rank 0's values, zeros elsewhere) and summed as bytes -- a sum with
        zeros is exact -- on the side stream, in order with the gradient sums
        (one NCCL communicator serves both), then unpacked in stream order."""
        if not tensors:
            return
        device = tensors[0].device
        rank0 = self._rank == 0
        flat, offsets = pack_bytes(tensors, fill=rank0)   # zeros elsewhere
        what = f"{self._name}: broadcast of {len(tensors)} buffers on the device"
        code = _C.DTYPE_U8
        if self._host_ordered:
            _written(flat)
            self._dc.wait(self._dc.allreduce_(flat.data_ptr(), flat.numel(), code, 0, what))
        else:
            current = torch.cuda.current_stream(device)
            self._side.wait_stream(current)
            flat.record_stream(self._side)
            with torch.cuda.stream(self._side):
                self._dc.allreduce_(flat.data_ptr(), flat.numel(), code, self._side.cuda_stream, what)
            current.wait_stream(self._side)
        if not rank0:
            unpack_bytes(flat, offsets, tensors)

    def new_pass(self) -> None:
        """The pass ended: later writes to the buckets come after every sum."""
        for b in range(len(self._done)):
            self._wait(b)
