"""Removing the hooks a wrapper installed."""

__all__ = ["remove_handles"]


def remove_handles(handles: list) -> None:
    """Removes hook handles, emptying the list in place (a wrapper's
    weakref.finalize and its explicit detach share one list)."""
    for h in handles:
        h.remove()
    handles.clear()
