"""Where an ``OffloadModel`` computes: device arguments checked against this machine, and what
``.to()``, ``.cuda()``, ``.cpu()``, ``.double()`` ask of the model (Note: [Moving an OffloadModel]).
What it does not hold: building the engine for a device (``offload/walk/engine.py``), which
``OffloadModel`` does once these functions have decided."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from ..walk.engine import Engine

# Note: [Moving an OffloadModel]
#     1. ``.to(device)``, ``.cuda()``, ``.cpu()`` move the *compute* device, what ``device=`` names;
#        the host copies stay on ``offload_device``. Trainers call ``model.to(device)`` on whatever
#        they are given (``transformers.Trainer``, Accelerate's ``prepare``, Lightning), so this is
#        what they must find: "the model computes there".
#     2. The compute device after the call is where ``fn`` sends a tensor that is on the compute
#        device now; equal to it (``.to(dtype)``, ``.to("cpu")`` on a CPU model), nothing moves.
#     3. A move builds the engine anew for the new device (slots, streams, pinned host buffers): the
#        parameters stay the same objects, their values are copied into the new host storage, so
#        for a moment the host holds them twice. Build a large model on its device instead.
#        An OffloadOptimizer follows the move: it steps the new engine from then on (its update
#        worker, plan and backward hooks built anew; its state, keyed by the same parameters, kept
#        as it is: on the host, or moved beside a resident slice's parameters), so one built before
#        Accelerate's prepare() trains as the plain optimizer does. A process group, masters on
#        disk, or an optimizer's disk tier or sharded update are tied to the old engine, so such a
#        move is refused (build the model, or the optimizer, on that device). Once an optimizer
#        has stepped the model, a move to the host (a training loop's teardown, Lightning's .cpu())
#        warns and leaves the compute where it is: the parameters are there already, and the
#        rebuild would hold them twice for nothing.
#     4. A dtype change converts the host copies, as before; ``.to(device, dtype)`` converts
#        floating-point host copies to ``dtype`` and moves the compute device.

Convert = Callable[[torch.Tensor], torch.Tensor]


def compute_target(fn: Convert, device: torch.device, offload_device: torch.device) -> torch.device:
    """Where ``fn`` sends a tensor that is on the compute ``device``: the compute device after the
    call (Note: [Moving an OffloadModel], rule 2)."""
    try:
        try:
            moved = fn(torch.empty(0, device=device))
        except NotImplementedError:
            if device.type != "meta":
                raise
            # A meta tensor has no data to copy out: fn leaves meta, to where it sends a host tensor.
            moved = fn(torch.empty(0, device=offload_device))
    except (RuntimeError, AssertionError, NotImplementedError) as error:
        raise RuntimeError(
            f"OffloadModel could not move its compute device from {device}: {error}. "
            "Pass a device that exists on this machine (see torch.cuda.device_count())"
        ) from error
    return existing_device(moved.device, "device")


def may_move_compute(engine: Engine, device: torch.device, offload_device: torch.device, target: torch.device,
                     data_parallel: bool) -> bool:
    """Whether the model computing on ``device`` may compute on ``target`` from now on (rule 3 of
    Note: [Moving an OffloadModel]): ``False``, with a warning, for a move to the host once an
    optimizer has stepped it.

    Raises:
        RuntimeError: something tied to ``engine`` forbids the move; the message says what.
    """
    optimizers = list(engine.optimizers)
    if target == offload_device and any(optimizer._stepped_engine for optimizer in optimizers):
        # A training loop's teardown (Lightning's .cpu()) frees the accelerator this way: the
        # parameters are on the host already.
        warnings.warn(
            f"OffloadModel keeps computing on {device}: an OffloadOptimizer is stepping it, and its "
            f"parameters are on {offload_device} already. To compute there, build the model with "
            f"device={str(target)!r}", stacklevel=4)
        return False
    reasons = [reason for optimizer in optimizers for reason in optimizer._tied_to_engine()]
    if data_parallel:
        reasons.append("it trains data-parallel over a process group (each rank's device is fixed)")
    if engine.master_files is not None:
        reasons.append("its masters are on disk (their files belong to this engine)")
    if reasons:
        raise RuntimeError(
            f"OffloadModel cannot move its compute from {device} to {target}: {'; '.join(reasons)}. "
            f"Build the OffloadModel with device={str(target)!r} instead"
        )
    return True


def host_conversion(fn: Convert, offload_device: torch.device) -> Convert | None:
    """What ``fn`` does to the host copies (rule 4 of Note: [Moving an OffloadModel]): ``fn`` itself
    when it keeps them on ``offload_device`` (``.to(dtype)``, ``.double()``,
    ``.to(memory_format=...)``); its floating-point cast alone when it moves them too; ``None`` when
    a move leaves them as they are (``.cuda()``, ``.to(device)``)."""
    try:
        keeps_host = fn(torch.empty(0, device=offload_device)).device == offload_device
    except (RuntimeError, AssertionError) as error:
        raise RuntimeError(f"OffloadModel could not apply this conversion to its host copies: {error}") from error
    if keeps_host:
        return fn
    single = fn(torch.empty(0, device=offload_device)).dtype
    double = fn(torch.empty(0, dtype=torch.float64, device=offload_device)).dtype
    if (single, double) == (torch.float32, torch.float64):
        return None
    return lambda t: t.to(dtype=single) if t.is_floating_point() else t


def stays_on_compute(convert: Convert, offload_device: torch.device, resident_slices: int) -> Convert:
    """``convert`` (from :func:`host_conversion`), for a model with ``resident_slices``: their
    tensors and gradients, on the compute device, take its dtype change and stay there (a ``.cpu()``
    that leaves the compute where it is, rule 3 of Note: [Moving an OffloadModel], must not move them)."""
    if not resident_slices:
        return convert

    def apply(tensor: torch.Tensor) -> torch.Tensor:
        converted = convert(tensor)
        if tensor.device == offload_device or converted.device == tensor.device:
            return converted
        return converted.to(tensor.device)
    return apply


def existing_device(value: Any, name: str) -> torch.device:
    """``value`` as a device of this machine (``cuda`` with its index).

    Raises:
        TypeError: ``value`` names no device.
        ValueError: the device does not exist here; the message says what to pass instead.
    """
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0 and not torch.accelerator.is_available():
        # torch reads an index as the accelerator's and, with none, says only that it cannot reach one.
        raise ValueError(f"{name}={value!r} (an accelerator's index) was requested, but this machine has no "
                         f"accelerator; pass {name}='cpu' to run on the CPU")
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError) as error:
        raise TypeError(f"{name} must be a torch.device, a string like 'cuda:0', or an int, got {value!r}") from error
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"{name}={str(device)!r} was requested, but CUDA is not available on this machine; "
                f"pass {name}='cpu' to run on the CPU"
            )
        index = torch.cuda.current_device() if device.index is None else device.index
        if index >= torch.cuda.device_count():
            raise ValueError(
                f"{name}={str(device)!r} was requested, but this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
        return torch.device("cuda", index)
    if device.type not in ("cpu", "meta") and not _backend_available(device.type):
        raise ValueError(f"{name}={str(device)!r} was requested, but that backend is not available on this machine")
    return device


def _backend_available(device_type: str) -> bool:
    module = getattr(torch, device_type, None)
    is_available = getattr(module, "is_available", None)
    return bool(is_available()) if callable(is_available) else False
