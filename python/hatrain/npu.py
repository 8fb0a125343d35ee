"""Ascend NPU faults in a PyTorch worker.

torch_npu raises a ``RuntimeError`` whose text names the fault (``UCE
ERROR``, ``HBM MULTI BIT ECC ERROR``, ``HCCS LINK ERROR``, ...). ``classify``
reads it with hatrain's fault table: ``uce`` (an uncorrectable memory error:
the step is repaired from the snapshot), ``crash``, ``hang``, ``ignore``
(``FORCE STOP``: a deliberate stop), or ``None`` (not an NPU fault).

The device hooks call torch_npu's recovery API when torch_npu is present
(``torch_npu.npu.stop_device``, ``check_uce_in_memory``,
``restart_device``) and do nothing without it, so a CPU job runs the same
code.
"""

from __future__ import annotations

from ._native import classify_npu_text

# What ``check_uce_in_memory`` answers (torch_npu's ``_recovery.py``).
NO_ADDRESS, NOT_IN_ALLOCATOR, TEMPORARY, RESIDENT = 0, 1, 2, 3


def classify(text: str) -> tuple[str, str] | None:
    """``(action, the words that decided)`` for a torch_npu error text."""
    return classify_npu_text(text)


def _npu():
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        return None
    return torch_npu.npu


def present() -> bool:
    """Whether torch_npu can be imported."""
    return _npu() is not None


def stop_device(device: int) -> None:
    """Stops the device's running tasks (its collectives return)."""
    npu = _npu()
    if npu is not None:
        npu.stop_device(device)


def check_uce_in_memory(device: int) -> int | None:
    """Where the device's bad address is: ``NO_ADDRESS``,
    ``NOT_IN_ALLOCATOR`` (not repairable in place), ``TEMPORARY`` (recompute
    the step) or ``RESIDENT`` (restore the state); ``None`` without
    torch_npu."""
    npu = _npu()
    return None if npu is None else int(npu.check_uce_in_memory(device))


def restart_device(device: int) -> None:
    """Brings a stopped device back."""
    npu = _npu()
    if npu is not None:
        npu.restart_device(device)


def repairable_uce(device: int) -> bool:
    """Stops the device and asks torch_npu where its bad address is: a UCE
    in temporary or resident memory is repaired by restoring the snapshot
    and recomputing the step (the device is restarted); one outside the
    allocator, or with no address, is not (the process must go). Without
    torch_npu (a CPU job, a drill) it is repairable."""
    if not present():
        return True
    stop_device(device)
    where = check_uce_in_memory(device)
    if where in (TEMPORARY, RESIDENT):
        restart_device(device)
        return True
    return False
