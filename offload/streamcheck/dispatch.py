"""Every tensor operation, seen and attributed: host-side code or compute on the simulated device.

A ``TorchDispatchMode`` sees each ATen operation with its arguments. The simulation runs
everything on the CPU, so where an operation "runs" is decided by the memory it touches:

- any argument in device memory: *compute* (the layers, the loss, the copy engine's own device
  work such as summing gradients);
- otherwise: the *host* (an optimizer step, user code between steps, the copy engine filling a
  pooled host buffer, building a model).

Memory not yet seen in a role (a tensor the caller made) joins the device the first time compute
uses it.

Compute that touches pinned host memory is itself a mistake on a real device (a kernel cannot
read a host copy), so it is reported. Outputs take the side of their operation. Reads and writes
follow the operator's schema: every tensor argument is read, arguments the schema marks as
mutated and all outputs are written. Operations that only make views, or allocate without
writing, touch no data.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .clocks import COMPUTE
from .memory import DEVICE, HOST, PINNED, UNKNOWN, Race
from .simulator import SimulatedBackend, caller_site, recording_suspended

aten = torch.ops.aten

#: Operations that allocate without writing: their output is new memory, nothing is accessed.
_ALLOCATE = {
    aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default, aten.new_empty.default,
    aten.new_empty_strided.default,
}
#: Operations that touch no tensor data (metadata only).
_NO_DATA = {
    aten.set_.source_Storage_storage_offset, aten.set_.source_Tensor, aten.set_.source_Storage,
    aten.set_.default, aten.detach.default, aten.alias.default, aten.lift_fresh.default,
    aten.is_pinned.default, aten.resize_.default, aten._has_compatible_shallow_copy_type.default,
}
#: Operations that hand a value from compute to the host, which waits for compute to get it.
_TO_HOST = {aten._local_scalar_dense.default, aten.equal.default, aten.is_nonzero.default, aten.nonzero.default}


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    leaves, _ = tree_flatten(tree)
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            if leaf.layout == torch.sparse_coo:
                # A sparse tensor has no storage of its own: what an operation reads or writes of it
                # is its indices and values.
                yield leaf._indices()
                yield leaf._values()
            else:
                yield leaf


def _is_view(func: Any) -> bool:
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def _mutated(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """Arguments the operator writes in place (``self`` of ``add_``, ``out=``)."""
    written: list[torch.Tensor] = []
    for position, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = kwargs.get(argument.name, args[position] if position < len(args) else None)
        written.extend(_tensors(value))
    return written


class AccessRecorder(TorchDispatchMode):
    """Records every operation's reads and writes with the simulated backend's clocks.

    Args:
        backend: the simulated backend (its clocks, its tracker, its reports).
    """

    def __init__(self, backend: SimulatedBackend) -> None:
        super().__init__()
        self.backend = backend
        self.tracker = backend.tracker

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if recording_suspended() or func in _NO_DATA or _is_view(func):
            return func(*args, **kwargs)
        inputs = list(_tensors((args, kwargs)))
        places = {self.tracker.where(t) for t in inputs}
        on_compute = DEVICE in places
        if on_compute and places & {PINNED, HOST} and func._schema.name.startswith("aten::_foreach_"):
            return self._per_side(func, types, args, kwargs)
        if func in _ALLOCATE:
            # New memory: remember how much compute was queued when it was handed out.
            result = func(*args, **kwargs)
            side = DEVICE if on_compute else (HOST if places & {PINNED, HOST} else UNKNOWN)
            for tensor in _tensors(result):
                self.tracker.tracked(tensor, side, self.backend.compute.clock.get(COMPUTE, 0))
            return result
        name = func.__name__ if hasattr(func, "__name__") else str(func)
        if on_compute and PINNED in places:
            self.backend.report(Race("compute touches pinned host memory", caller_site(), name,
                                     "a kernel cannot read the host copy: bind the device copy"))
        backend = self.backend
        what = f"{name} at {caller_site()}"
        if on_compute:
            epoch, clock = backend.compute_epoch(what), backend.compute.clock
        else:
            epoch, clock = backend.host_epoch(what)
        written = _mutated(func, args, kwargs)
        written_ids = {id(t) for t in written}
        for tensor in inputs:
            if on_compute:
                record = self.tracker.tracked(tensor)
                if record is not None and record.where == UNKNOWN:
                    record.where = DEVICE
            # An argument written in place is read too: the write check covers the read.
            self.tracker.access(tensor, id(tensor) in written_ids, epoch, clock)
        result = func(*args, **kwargs)
        side = DEVICE if on_compute else (HOST if places & {PINNED, HOST} else UNKNOWN)
        for tensor in _tensors(result):
            if any(tensor is t for t in inputs):
                continue
            self.tracker.tracked(tensor, side, backend.compute.clock.get(COMPUTE, 0))
            self.tracker.access(tensor, True, epoch, clock)
        if on_compute and func in _TO_HOST:
            backend.host_learns_compute()
        backend.after_operation()
        return result

    def _per_side(self, func: Any, types: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A ``_foreach_`` operation over device and host tensors at once, run once per side.

        On a GPU such lists hold tensors of two devices, and PyTorch runs the operation once per
        device: a kernel over the device tensors, host code over the host ones (``zero_grad`` of a
        model with resident slices, ``clip_grad_norm_``). Here both are one torch device, so the
        call is split the same way, by where each position's tensors live."""
        count = len(next(a for a in args if isinstance(a, (list, tuple))))
        lists = [k for k, a in enumerate(args) if isinstance(a, (list, tuple)) and len(a) == count]
        on_device = [any(isinstance(args[k][i], torch.Tensor) and self.tracker.where(args[k][i]) == DEVICE
                         for k in lists) for i in range(count)]
        results: list[Any] = [None] * count
        returned = None
        for side in (True, False):
            positions = [i for i in range(count) if on_device[i] == side]
            if not positions:
                continue
            part = tuple([a[i] for i in positions] if k in lists else a for k, a in enumerate(args))
            returned = self.__torch_dispatch__(func, types, part, kwargs)
            if isinstance(returned, (list, tuple)):
                for i, value in zip(positions, returned):
                    results[i] = value
        return results if isinstance(returned, (list, tuple)) else returned
