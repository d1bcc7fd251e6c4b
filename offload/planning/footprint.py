"""``MemoryFootprint``: every byte an OffloadModel (and the OffloadOptimizers stepping it) holds,
by category and per parameter.

What it does not count: the user's own tensors (inputs, the loss, the parameters themselves of a
head outside the model, whose ``.grad`` and optimizer state count), PyTorch's and Python's own
memory, temporaries that live inside one call (an optimizer's scratch), and the state of a plain
``torch.optim`` optimizer built on the model's parameters (only an
:class:`~offload.OffloadOptimizer` is known to the model). Device bytes are what the model
allocated itself, not the caching allocator's reserve. See ``docs/memory.md`` for what each
category is and how many bytes per parameter it takes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch

from ..tiers.state_window import most_at_once

if TYPE_CHECKING:
    from ..walk.engine import Engine

_HOST = ("host_masters", "host_shadows", "host_gradients", "host_optimizer_state", "host_disk_window",
         "host_activations", "host_pool_idle")
_DEVICE = ("device_slots", "device_gradients", "device_activations", "device_resident", "device_resident_gradients",
           "device_resident_optimizer_state")


@dataclass(frozen=True)
class MemoryFootprint:
    """Memory OffloadModel holds besides the user's own tensors, in bytes, by category.

    The host categories are disjoint and together are every host byte the model and its
    OffloadOptimizers hold; likewise the device ones. That includes the ``.grad`` and state of
    parameters the optimizers step outside the model (a head applied after it, a weight replaced
    by hand that they go on stepping, as ``torch.optim`` does): in the gradients and optimizer
    state, where each storage lies (in CPU memory: the host's; elsewhere: the resident
    categories'). :func:`~offload.estimate_memory` knows the model only: their bytes are extra.

    Attributes:
        parameters: elements of the parameters the model holds (for bytes per parameter; those
            outside the model are not counted, their ``.grad`` and state are).
        host_masters: host buffers holding the parameters and buffers (the host copies); with
            masters on disk (``OffloadModel(..., masters=DiskTier(...))``), the pages of their
            files in RAM now.
        host_shadows: their copies in ``compute_dtype`` (0 without one); with ``shadows="disk"``,
            the staging window loads read instead (Note: [Shadows on disk] in
            ``offload/streams/shadow_staging.py``).
        host_gradients: the parameters' ``.grad`` on the host (each storage once), pooled or not,
            those of the optimizers' parameters outside the model included.
        host_optimizer_state: what the model's OffloadOptimizers keep per element of a parameter
            (AdamW's moments, SGD's momentum), each storage once. 0-d state (AdamW's step count,
            4 B a parameter, on the CPU wherever the parameter is) is left out, here and in
            :func:`~offload.estimate_memory`. State of parameters outside the model in CPU memory
            counts here too.
        host_disk_window: host RAM the disk tiers (:class:`~offload.DiskTier`) take while the optimizer
            steps: the optimizers' window of three consecutive slices' state being read, updated and
            written (one arena: Note: [The window's arena] in ``offload/tiers/state_window.py``), and
            state held after a failed write (not pinned; state tensors in it are counted here, not as
            optimizer state); with masters on disk, also the most three consecutive slices' masters
            and gradients take while their updates read and write them (Note: [Masters on disk]),
            less what of them is in RAM now (counted as masters and gradients). Between steps those
            pages are dropped, but every step takes them again: counted, the host total is the most
            RAM the model takes, and what :func:`~offload.estimate_memory` predicts.
        host_activations: pooled buffers in use that do not hold a ``.grad``: boundary
            activations and buffer snapshots waiting for backward, gradients on their way to
            autograd.
        host_pool_idle: pooled buffers nothing uses, kept for the next step.
        host_pool: every pooled buffer (gradients, activations and idle ones together: overlaps
            the categories above).
        device_slots: the device slots that slices take turns in.
        device_gradients: the device buffers that sum gradients over microbatches (allocated
            only with more than one microbatch).
        pinned: whether the host buffers (masters, shadows, the pool) are pinned (only with a
            CUDA device; the optimizer state is never pinned).
        pinned_bytes: host bytes pinned for them, as the allocator reserved them (whole pages,
            or the next power of two for small buffers: ``offload/streams/pinned.py``).
        disk: bytes in the files of the optimizers' disk tiers and of masters on disk (0 without
            either).
        device_activations: the peak of one step's activations on the device; only
            :func:`~offload.estimate_memory` given the model's shapes predicts it (a measured
            footprint counts what the model holds between steps, and holds none: 0).
        device_resident: the parameters and buffers of the resident slices
            (``OffloadModel(..., resident_slices=k)``, Note: [Resident slices]), on the device.
        device_resident_gradients: their ``.grad`` (each storage once), and that of the
            optimizers' parameters outside the model on the device.
        device_resident_optimizer_state: what the OffloadOptimizers keep for them, on the device,
            and for their parameters outside the model on the device.
    """

    parameters: int
    host_masters: int
    host_shadows: int
    host_gradients: int
    host_optimizer_state: int
    host_disk_window: int
    host_activations: int
    host_pool_idle: int
    host_pool: int
    device_slots: int
    device_gradients: int
    pinned: bool
    pinned_bytes: int
    disk: int = 0
    device_activations: int = 0
    device_resident: int = 0
    device_resident_gradients: int = 0
    device_resident_optimizer_state: int = 0

    @property
    def host_copies(self) -> int:
        """The host copies' bytes (:attr:`host_masters`; the name of earlier releases)."""
        return self.host_masters

    @property
    def host_total(self) -> int:
        """Every host byte counted here."""
        return sum(self.host_categories().values())

    @property
    def device_total(self) -> int:
        """Every device byte counted here."""
        return sum(self.device_categories().values())

    def host_categories(self) -> dict[str, int]:
        """The disjoint host categories, by name without the ``host_`` prefix."""
        return {name.removeprefix("host_"): getattr(self, name) for name in _HOST}

    def device_categories(self) -> dict[str, int]:
        """The disjoint device categories, by name without the ``device_`` prefix."""
        return {name.removeprefix("device_"): getattr(self, name) for name in _DEVICE}

    def per_parameter(self) -> dict[str, float]:
        """Every byte count of this footprint divided by :attr:`parameters`."""
        count = max(self.parameters, 1)
        return {f.name: getattr(self, f.name) / count for f in fields(self)
                if f.name not in ("parameters", "pinned")}

    def __str__(self) -> str:
        count = max(self.parameters, 1)
        lines = [f"{'':<32}{'bytes':>14}{'B/param':>10}"]

        def row(name: str, nbytes: int) -> None:
            lines.append(f"{name:<32}{_size(nbytes):>14}{nbytes / count:>10.2f}")

        for name in _HOST:
            row(name, getattr(self, name))
        row("host total", self.host_total)
        for name in _DEVICE:
            row(name, getattr(self, name))
        row("device total", self.device_total)
        row("disk", self.disk)
        pinned = f"pinned: {_size(self.pinned_bytes)}" if self.pinned else "not pinned"
        lines.append(f"{self.parameters:,} parameters; host buffers {pinned}")
        return "\n".join(lines)


def measure(engine: Engine, optimizers: Iterable[torch.optim.Optimizer], tiers: Iterable[Any] = ()) -> MemoryFootprint:
    """The footprint of ``engine``'s model, of ``optimizers`` (the OffloadOptimizers stepping it)
    and of ``tiers`` (their disk tiers) now."""
    tiers, optimizers = list(tiers), list(optimizers)
    windows = [window for tier in tiers for window in tier.window_ranges()]
    resident = [s.storage for s in engine.slices if s.storage.resident]
    storages = [s.storage for s in engine.slices if not s.storage.resident]
    params = [entry.tensor for storage in storages for entry in storage.held if entry.is_parameter]
    on_device = [entry.tensor for storage in resident for entry in storage.held if entry.is_parameter]
    homes = [storage.gradient_home for storage in storages if storage.gradient_home is not None]
    outside = _outside(optimizers, params + on_device)
    grad_storages, device_grads = _grad_storages(params), _grad_storages(on_device)
    _add_where_they_lie(_grad_storages(outside), grad_storages, device_grads)
    for home in homes:  # Note: [Gradients on disk]: counted by the pages in RAM now, and the file
        grad_storages.pop(home.file.tensor.untyped_storage().data_ptr(), None)
    pool_in_use = pool_idle = 0
    for buffer in engine.pool.buffers():
        if buffer.data.data_ptr() in grad_storages:
            continue  # counted as gradients
        if buffer.is_idle():
            pool_idle += buffer.data.numel()
        else:
            pool_in_use += buffer.data.numel()
    state = _state_storages(optimizers, params, windows)
    device_state = _state_storages(optimizers, on_device, [])
    _add_where_they_lie(_state_storages(optimizers, outside, windows), state, device_state)
    # Masters on disk count where they are: the pages in RAM now, and the files.
    mapped = [storage.masters_file for storage in storages if storage.masters_file is not None]
    masters = sum(storage.flat.numel() for storage in storages if storage.masters_file is None)
    masters_in_ram = masters + sum(file.resident_bytes() for file in mapped)
    gradients_in_ram = sum(home.file.resident_bytes() for home in homes)
    shadows = sum(storage.shadow.numel() for storage in storages if storage.shadow is not None)
    shadows += engine.staging.nbytes if engine.staging is not None else 0
    return MemoryFootprint(
        parameters=sum(p.numel() for p in params + on_device),
        host_masters=masters_in_ram,
        host_shadows=shadows,
        host_gradients=_nbytes(grad_storages) + gradients_in_ram,
        host_optimizer_state=_nbytes(state),
        host_disk_window=(sum(tier.window_nbytes for tier in tiers)
                          + max(0, _update_window(storages) - (masters_in_ram - masters) - gradients_in_ram)),
        host_activations=pool_in_use,
        host_pool_idle=pool_idle,
        host_pool=engine.pool.nbytes,
        device_slots=engine.slots.slot_nbytes * engine.slots.num_slots,
        device_gradients=engine.gradients.device_nbytes,
        pinned=engine.pin,
        pinned_bytes=_pinned_bytes(engine, masters + shadows + engine.pool.nbytes),
        disk=(sum(tier.disk_nbytes for tier in tiers) + sum(file.nbytes for file in mapped)
              + sum(home.file.nbytes for home in homes)),
        device_resident=sum(storage.nbytes for storage in resident),
        device_resident_gradients=_nbytes(device_grads),
        device_resident_optimizer_state=_nbytes(device_state),
    )


def _update_window(storages: list[Any]) -> int:
    """The most RAM three consecutive updated slices' mapped masters and gradient files take while
    their updates read and write them (Note: [Masters on disk]; 0 with the masters in RAM)."""
    # Only a slice with trainable parameters (a gradients' file) is read in, and the window counts
    # reads: a slice without parameters, or frozen, between two others does not narrow it.
    updated = [s for s in storages if s.masters_file is not None and s.gradient_home is not None]
    return (most_at_once([s.masters_file.nbytes for s in updated])
            + most_at_once([s.gradient_home.file.nbytes for s in updated]))


def _outside(optimizers: list[torch.optim.Optimizer], held: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors the optimizers step or keep state for that the model's slices do not hold: a
    head applied after the model, a weight replaced by hand that they go on stepping (as
    ``torch.optim`` does). Their ``.grad`` and state are the optimizers' bytes all the same."""
    model_ids = {id(p) for p in held}
    found: dict[int, torch.Tensor] = {}
    for optimizer in optimizers:
        stepped = [p for group in optimizer.param_groups for p in group["params"]]
        for p in [*stepped, *optimizer.state]:
            if isinstance(p, torch.Tensor) and id(p) not in model_ids:
                found.setdefault(id(p), p)
    return list(found.values())


def _add_where_they_lie(outside: dict[int, torch.UntypedStorage], host: dict[int, torch.UntypedStorage],
                         device: dict[int, torch.UntypedStorage]) -> None:
    """Add ``outside``'s storages (those of the tensors outside the model) to ``host`` (in CPU
    memory) or ``device``, each storage once: an old weight's ``.grad`` may still view the
    gradient buffer of the slice that held it, counted there already."""
    for address, storage in outside.items():
        if address in host or address in device or storage.device.type == "meta":
            continue  # a meta tensor holds no bytes
        (host if storage.device.type == "cpu" else device)[address] = storage


def _nbytes(storages: dict[int, torch.UntypedStorage]) -> int:
    return sum(storage.nbytes() for storage in storages.values())


def _grad_storages(params: Iterable[torch.Tensor]) -> dict[int, torch.UntypedStorage]:
    """The storages of the parameters' ``.grad``, by address (each storage once)."""
    found: dict[int, torch.UntypedStorage] = {}
    for p in params:
        if p.grad is None:
            continue
        # A sparse gradient (nn.Embedding(sparse=True)) has no storage of its own: its indices
        # and values have.
        parts = (p.grad._indices(), p.grad._values()) if p.grad.layout == torch.sparse_coo else (p.grad,)
        for part in parts:
            storage = part.untyped_storage()
            found[storage.data_ptr()] = storage
    return found


#: torch.optim's state that is one number per parameter, not one per element (NAdam's mu_product,
#: ASGD's eta and mu, every class's step): left out, as estimate_memory does.
_SCALAR_STATE = frozenset({"step", "mu_product", "eta", "mu"})


def _state_storages(optimizers: Iterable[torch.optim.Optimizer], params: Iterable[torch.Tensor],
                    windows: list[tuple[int, int]]) -> dict[int, torch.UntypedStorage]:
    """The storages of the optimizers' per-parameter state of ``params``, by address (each
    storage once), leaving out what lies in a disk tier's window (``windows``: counted there)."""
    held = {id(p) for p in params}
    found: dict[int, torch.UntypedStorage] = {}
    for optimizer in optimizers:
        for p, values in optimizer.state.items():
            if id(p) not in held:
                continue
            for key, value in values.items():
                # 0-d state is a count (AdamW's step), but for a 0-d parameter its moments are 0-d too.
                if isinstance(value, torch.Tensor) and (value.dim() > 0 or p.dim() == 0 and key not in _SCALAR_STATE):
                    for storage in state_storages(value):
                        if any(start <= storage.data_ptr() < stop for start, stop in windows):
                            continue
                        found[storage.data_ptr()] = storage
    return found


def _pinned_bytes(engine: Engine, requested: int) -> int:
    """Pinned bytes reserved for the host buffers: as the backend's allocator counts them
    (``offload/streams/pinned.py``), or as requested where it does not count."""
    if not engine.pin:
        return 0
    allocator = getattr(engine.copies.backend, "pinned", None)
    return allocator.reserved_bytes if allocator is not None else requested


def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(nbytes) < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def state_storages(value: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages an optimizer state tensor holds: its own, or a tensor subclass's inner tensors
    (torchao's low-bit moments: 8- or 4-bit codes and a scale per block), whose storage the
    subclass itself reports at the size of the float values it stands for."""
    if type(value) is not torch.Tensor and hasattr(value, "__tensor_flatten__"):
        names, _ = value.__tensor_flatten__()
        return [storage for name in names for storage in state_storages(getattr(value, name))]
    return [value.untyped_storage()]
