"""Running the user's own modules on device copies of their tensors.

A slice runs its layers unchanged; for the duration of the call each registration site of a
parameter or buffer (``module._parameters[name]`` / ``module._buffers[name]``) holds the device copy
instead of the host copy, and gets the host copy back afterwards, also when the layer raises. The
same mechanism as :func:`torch.func.functional_call`, without its per-call name resolution.

Note: [Parametrizations cached around a run]
    Inside ``torch.nn.utils.parametrize.cached()`` a parametrized tensor is computed once per
    module and reused, keyed by the module alone. A run binds new device copies each time, so an
    entry cached by an earlier run (or outside the model, from the host copies) is a tensor of
    other leaves: a recompute that took it would differentiate the forward's discarded graph,
    not its own, and the parametrization's ``original`` would get no gradient. So while the
    caller's cache is on, each binding gets a cache of its own for its duration: the layers still
    cache (a weight used twice in one run is computed once, as in the plain model), and the
    caller's entries are back untouched afterwards. Each run computes the parametrization again,
    which the caller's cache would have shared between runs: the forward refuses the cases where
    that sharing changes a gradient (rule 4 of Note: [Transforms the walk refuses] in
    ``offload/autograd/refusals.py``).

Note: [Interrupts while binding]
    Ctrl-C's ``KeyboardInterrupt`` (or any signal handler's exception) is raised between two
    bytecodes of the main thread: at the start of any Python function (``Site.table``,
    ``__exit__`` itself) or a loop's next turn. A binding half made or half given back would leave
    the user's layers holding a slot's device copy, reused by the next slice: every later run
    would compute with stale weights. So giving back never depends on one call running to its end:

    1. Every change is recorded before it is made (a site's host copy before the device copy goes
       in, an 8-bit layer's state before it is swapped, the caller's parametrization cache beside
       the binding's own), so a binding stopped anywhere can be undone from its record.
    2. Giving back is idempotent: each site gets its recorded host copy again, each state its
       recorded one, the caller's cache only where the binding's own is still in place. A
       binding is listed (per thread) from its first change until one giving back has run to its
       end.
    3. An interrupt that lands while a binding is made or given back is caught, the whole giving
       back is done (again, from the start), and the interrupt is raised after it.
    4. What a second interrupt stops, or one that lands as ``__exit__`` starts (before any of its
       code runs: no code can guard that), stays listed. :func:`give_back_unheld` gives it back;
       every binding calls it before it binds and as it leaves, and code that reads the layers'
       registrations before a run binds (the engine's check for parameters the user replaced)
       must call it first, or it takes the stale device copy for a new parameter. Listed
       bindings still held are left alone: those whose ``with`` statement is running (entered,
       not yet leaving, and the frame that entered it still on the stack), so a binding made
       inside another's run (a backward inside a forward) keeps the outer one's device copies in
       place. Enter a binding with a ``with`` statement in the function that runs the layers:
       that frame's life is the binding's.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import FrameType, TracebackType

import torch
from torch import nn
from torch.nn.utils import parametrize

from ..streams.quantized import RUN_STATE, restore_run_states, swap_run_states
from ..streams.sites import Site
from ..streams.slice_entries import Entry


@dataclass(eq=False)
class Binding:
    """Context manager that puts ``tensors[i]`` at every site in ``sites[i]``, and swaps in the
    run state of each 8-bit layer at ``run_state_positions`` (the slice's
    ``SliceStorage.run_state_positions``; Note: [Quantized weights], rule 6).

    After the call, :attr:`reassigned` lists ``(i, new_tensor)`` for buffers a module replaced
    during the call (``self.count = self.count + 1``), also where a later layer raised: the layers
    that ran before it made them, as the plain model's would have. The caller decides what to keep
    of them.

    Leaving always gives every site its host copy back, registered as it was (a parameter in
    ``_parameters``, never left behind as a buffer), also when the call raised or moved a tensor
    between the tables: the user's modules are never left changed by a failed run. An interrupt
    while binding or leaving is raised once all is given back; one that stops the giving back
    itself leaves it to the next binding (Note: [Interrupts while binding]). Enter it with a
    ``with`` statement in the function that runs the layers.

    Raises:
        RuntimeError: a layer left a parametrization registered on one of its parameters
            (``register_parametrization`` in forward without ``remove_parametrizations``); the
            parametrization is removed first.
    """

    sites: Sequence[Sequence[Site]]
    tensors: Sequence[torch.Tensor]
    run_state_positions: Sequence[int]
    reassigned: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    # - What giving back undoes, recorded before each change (Note: [Interrupts while binding], rule 1)
    _originals: list[tuple[Site, torch.Tensor | None]] = field(default_factory=list)
    _run_states: list[tuple[nn.Module, object]] = field(default_factory=list)
    _caller_cache: dict[object, torch.Tensor] | None = None
    _own_cache: dict[object, torch.Tensor] | None = None
    # - Whether it is still to be given back, and whether its run still holds it (rules 2 and 4)
    _listed_in: list[Binding] | None = None
    _held_by: FrameType | None = None
    _left_parametrized: list[Site] = field(default_factory=list)

    def __enter__(self) -> Binding:
        give_back_unheld()  # rule 4: what an interrupt left bound on this thread
        try:
            self._listed_in = _listed()
            self._listed_in.append(self)
            # Note: [Parametrizations cached around a run]
            if parametrize._cache_enabled:
                self._caller_cache, self._own_cache = parametrize._cache, {}
                parametrize._cache = self._own_cache
            for entry_sites, tensor in zip(self.sites, self.tensors):
                for site in entry_sites:
                    table = site.table()
                    self._originals.append((site, table[site.name]))
                    table[site.name] = tensor
            _refresh_flat_weights(self.sites)
            # An 8-bit layer reads its codes from its own state: Note: [Quantized weights], rule 6.
            # Which entries are 8-bit weights is known from the slice's layout, so a slice without
            # one binds without looking at any entry for a state: every load, forward and backward.
            if self.run_state_positions:
                self._run_states = _run_states_now(self.sites, self.tensors, self.run_state_positions)
                swap_run_states(self.sites, self.tensors, self.run_state_positions)
            self._held_by = sys._getframe(1)  # the frame running the ``with`` statement
            return self
        except BaseException:
            self._held_by = None
            try:
                give_back_unheld()
            except BaseException:
                give_back_unheld()  # rule 3: an interrupt as it started gave nothing back
                raise
            raise

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._held_by = None
        try:
            for index, (entry_sites, tensor) in enumerate(zip(self.sites, self.tensors)):
                if not entry_sites:
                    continue  # a quantisation state's tensor, registered nowhere
                current = entry_sites[0].table().get(entry_sites[0].name)
                if current is not tensor and current is not None and not entry_sites[0].is_parameter:
                    self.reassigned.append((index, current))
            give_back_unheld()
        except BaseException:
            give_back_unheld()  # rule 3: from the start, whether the error came before it or inside it
            raise
        if self._left_parametrized and exc_type is None:
            names = ", ".join(f"{type(site.module).__name__}.{site.name}" for site in self._left_parametrized)
            raise RuntimeError(
                f"a layer registered a parametrization on {names} during forward and left it there. OffloadModel "
                "runs layers on device copies of their parameters and gives the host copies back after each run, "
                "so a parametrization must be gone when forward returns (remove_parametrizations in the same "
                "forward, as PEFT does), or registered before the model is wrapped in OffloadModel, where it is "
                "offloaded like any layer."
            )

    def keep_reassigned(self, check: Callable[[str, torch.Tensor, torch.Tensor], None], refuse: bool = True) -> None:
        """Copy each buffer in :attr:`reassigned` into its device copy, once ``check(name, new_tensor,
        device_copy)`` let every one through; it raises to refuse one.

        Args:
            refuse: let ``check``'s error propagate; else (after a failed run, whose own error goes
                on) copy only the ones it lets through, leaving the others as they were.
        """
        kept = []
        for index, new_value in self.reassigned:  # all checked before any is kept
            try:
                check(self.sites[index][0].name, new_value, self.tensors[index])
            except RuntimeError:
                if refuse:
                    raise
                continue
            kept.append((index, new_value))
        with torch.no_grad():
            for index, new_value in kept:
                self.tensors[index].copy_(new_value)

    def give_back(self) -> None:
        """Undo what :meth:`__enter__` did, as far as it got; idempotent, and unlists the binding
        once it has run to its end (Note: [Interrupts while binding], rule 2)."""
        if self._own_cache is not None and parametrize._cache is self._own_cache:
            parametrize._cache = self._caller_cache
        restore_run_states(self._run_states)
        for site, original in reversed(self._originals):
            if _restore(site, original):
                self._left_parametrized.append(site)
        _refresh_flat_weights(self.sites)
        self._originals.clear()
        self._run_states = []
        if self._listed_in is not None and self in self._listed_in:
            self._listed_in.remove(self)


class BufferMovedError(RuntimeError):
    """A layer resized a buffer's device copy in place (``buf.resize_(...)``) or pointed it at other
    memory (``buf.set_(...)``, ``buf.data = ...``) during a run: rule 5 of Note: [Buffers] in
    ``offload/walk/slice_walk.py``. Its slice's buffers are not written back."""


class BufferPlaces:
    """Which of a slice's buffers each of its layers holds (as a module of the layer registers
    them), made once a layout: :meth:`watch` checks after each layer only the buffers that layer
    may have moved (rule 5 of Note: [Buffers] in ``offload/walk/slice_walk.py``).

    Args:
        layers: the slice's layers.
        buffers: the slice's buffer entries as laid out now (the last of its entries): a new layout
            needs new places.
    """

    def __init__(self, layers: Sequence[nn.Module], buffers: Sequence[Entry]) -> None:
        self._buffers = buffers
        self._by_layer: list[list[int]] = []
        for layer in layers:
            held = {id(module) for module in layer.modules()}
            self._by_layer.append([k for k, entry in enumerate(buffers)
                                   if any(id(site.module) in held for site in entry.sites)])

    def watch(self, tensors: Sequence[torch.Tensor], name_of: Callable[[Site], str], index: int) -> BufferWatch:
        """Where the buffers' device copies lie as a run of slice ``index`` starts: the last of
        ``tensors`` (one per storage entry, the buffers last); ``name_of`` names a site in messages."""
        buffers = tensors[len(tensors) - len(self._buffers):]
        return BufferWatch(self._buffers, self._by_layer, buffers, [t.shape for t in buffers],
                           [t.data_ptr() for t in buffers], name_of, index)


@dataclass
class BufferWatch:
    """One run's record of where its slice's buffers lie: each device copy's shape and address as
    the run started (rule 5 of Note: [Buffers] in ``offload/walk/slice_walk.py``). Checking is a
    comparison of both per buffer: no tensor operation, nothing that waits for the device."""

    buffers: Sequence[Entry]
    by_layer: Sequence[Sequence[int]]
    tensors: Sequence[torch.Tensor]
    shapes: Sequence[torch.Size]
    addresses: Sequence[int]
    name_of: Callable[[Site], str]
    index: int

    def refuse_moved(self, layer: int | None = None) -> None:
        """Raise if a buffer that the slice's layer ``layer`` holds (every buffer for ``None``) was
        moved since the run started.

        Raises:
            BufferMovedError: naming the first buffer moved, and what to do.
        """
        for k in range(len(self.tensors)) if layer is None else self.by_layer[layer]:
            tensor = self.tensors[k]
            if tensor.shape == self.shapes[k] and tensor.data_ptr() == self.addresses[k]:
                continue
            site = self.buffers[k].sites[0]
            change = (f"resized in place to shape {tuple(tensor.shape)} (laid out as {tuple(self.shapes[k])})"
                      if tensor.shape != self.shapes[k] else "pointed at other memory")
            raise BufferMovedError(
                f"OffloadModel: {self.name_of(site)} was {change} during forward, in slice "
                f"{self.index}. OffloadModel lays each buffer out in its slice's device memory with the shape it has "
                "when the slice is laid out (when wrapping, and after layers register other tensors between "
                "forwards), beside the slice's other buffers: one grown in place would overwrite them, and be cut "
                "back on the host. Nothing of the slice's buffers was written back: they are as they were before "
                "this forward. Give the buffer its final shape before wrapping: run one forward of the plain model "
                "first (torch.ao.quantization's observers and FakeQuantize, as prepare_qat inserts them, size their "
                f"buffers on their first call), or register it with the shape it takes (layer.{site.name} "
                "= torch.zeros(...)), between forwards too, which lays its slice out again")

    def put_back(self, views: Sequence[torch.Tensor]) -> None:
        """Lay each buffer's device copy out again as ``views`` (the slice's fresh device views, one
        per storage entry) has it: the slot keeps these tensors for the slice's next load."""
        first = len(views) - len(self.tensors)
        with torch.no_grad():
            for tensor, view in zip(self.tensors, views[first:]):
                tensor.set_(view)


_bindings = threading.local()


def _listed() -> list[Binding]:
    """This thread's bindings still to be given back, in the order they were entered."""
    listed = getattr(_bindings, "listed", None)
    if listed is None:
        listed = _bindings.listed = []
    return listed


def give_back_unheld() -> None:
    """Give back every binding of this thread that no run holds any more, newest first (rule 4 of
    Note: [Interrupts while binding]). Idempotent: a caller that an interrupt stopped in it calls
    it once more (rule 3), in its own frame, since an interrupt can land as any call starts."""
    on_stack: set[int] | None = None
    for binding in reversed(list(_listed())):
        if binding._held_by is not None:
            if on_stack is None:
                on_stack = _frames_on_stack()
            if id(binding._held_by) in on_stack:
                continue
        binding._held_by = None  # its run is gone: frame and binding need not keep each other
        binding.give_back()


def _frames_on_stack() -> set[int]:
    frames: set[int] = set()
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        frames.add(id(frame))
        frame = frame.f_back
    return frames


def _run_states_now(sites: Sequence[Sequence[Site]], tensors: Sequence[torch.Tensor],
                    positions: Sequence[int]) -> list[tuple[nn.Module, object]]:
    """The states :func:`swap_run_states` is about to replace, recorded before it replaces any
    (rule 1 of Note: [Interrupts while binding]): what it returns is lost if it is interrupted."""
    return [(site.module, site.module.state) for i in positions if getattr(tensors[i], RUN_STATE, None) is not None
            for site in sites[i]]


def _restore(site: Site, original: torch.Tensor | None) -> bool:
    """Register ``original`` at ``site`` again, exactly as it was registered before the call.

    Returns whether a parametrization the call registered there had to be removed first.
    """
    module = site.module
    removed = False
    if site.name not in site.table() and parametrize.is_parametrized(module, site.name):
        # The device copy becomes the plain tensor again, and is then replaced by the host copy.
        parametrize.remove_parametrizations(module, site.name, leave_parametrized=False)
        removed = True
    # A tensor re-registered in the other table (a parameter put back as a buffer) leaves it.
    other = module._buffers if site.is_parameter else module._parameters
    if site.name in other:
        del other[site.name]
        if site.is_parameter:
            module._non_persistent_buffers_set.discard(site.name)
    site.table()[site.name] = original
    return removed


def _refresh_flat_weights(sites: Sequence[Sequence[Site]]) -> None:
    # Recurrent layers (nn.LSTM, nn.GRU, nn.RNN) keep a list of their weights next to _parameters
    # and read that list in forward; rebuild it so it follows the swap.
    refreshed: set[int] = set()
    for entry_sites in sites:
        for site in entry_sites:
            module = site.module
            if isinstance(module, nn.RNNBase) and id(module) not in refreshed:
                refreshed.add(id(module))
                module._flat_weights = [
                    getattr(module, name) if hasattr(module, name) else None
                    for name in module._flat_weights_names
                ]
