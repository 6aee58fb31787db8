"""The training state beside the model, for the loop around recover(): a
checkpoint written from memory, rank 0's state shared with replacements,
a GradScaler set back to before the step cut short."""

from __future__ import annotations

import os
from typing import Any, Dict, Optional

import torch

from .._runtime import fault_tolerant_mode
from .._runtime import mpi as _mpi
from .._runtime.fault_tolerant_mode import RanksLost
from .._runtime.mpi import MPI

_state = fault_tolerant_mode._state


def share_state(state: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """After recover(replace=True), on every rank of the new world: rank 0's
    `state` (whatever the loop needs to go on: optimizer state_dicts, the
    step, the epoch) for everyone; a replacement passes None. Model
    parameters and buffers need not be in it: the algorithms' set-up made
    them rank 0's. Also brings a replacement's steps_committed() level, and
    a replacement's call completes the recovery: it joins the survivors'
    agreement that the rebuild is complete (RanksLost where a rank failed
    meanwhile)."""
    comm = _mpi.world_mpi()
    if _state.owes_rebuild_agreement:
        _state.owes_rebuild_agreement = False
        try:
            complete = _state.agree_comm.Agree(1)
        except MPI.Exception:
            complete = False
        if not complete:     # a rank failed as this one joined: recover() with the others
            _state.agreed = True
            raise RanksLost(f"share_state on rank {comm.Get_rank()}: a rank failed while this "
                            "replacement joined; call mpidp.recover() to go on with the survivors")
    mine = (state, _state.committed, _state.generation) if comm.Get_rank() == 0 else None
    state, _state.committed, _state.generation = comm.bcast(mine, root=0)
    return state


def reset_grad_scaler(scaler) -> None:
    """After RanksLost: a torch.amp.GradScaler whose step was cut short still
    holds that step's unscale and inf checks, so its next unscale_() or
    step() would raise (or skip a step); this drops them, keeping the scale
    and its growth tracker as they were -- as if the step never began. Call
    it in the except clause, beside recover()."""
    states = getattr(scaler, "_per_optimizer_states", None)
    if not isinstance(states, dict):
        raise TypeError(f"scaler: expected a torch.amp.GradScaler, got {type(scaler).__name__}")
    states.clear()


def save_checkpoint(path: str, state: Dict[str, Any]) -> None:
    """Write `state` (state_dicts) from memory to `path`, by the survivors'
    rank 0 only (every survivor holds the same replica), atomically (a
    temporary file renamed), then wait for every rank; a relaunch at any size
    loads it with the usual load_state_dict calls."""
    comm = _mpi.world_mpi()
    if comm.Get_rank() == 0:
        tmp = f"{path}.tmp{os.getpid()}"
        torch.save(state, tmp)
        os.replace(tmp, path)
    try:
        comm.Barrier()
    except MPI.Exception as error:
        raise fault_tolerant_mode.lost(f"save_checkpoint on rank {comm.Get_rank()}", error) from None
