"""A clip's scaling of the host gradients, done by each slice's update as it reads them
(``OffloadOptimizer(..., scale_in_update=True)``).

Note: [Scaling in the update]
    ``clip_grad_norm_`` is two passes over the host gradients: their norms, then a multiplication of
    each by the clip coefficient. The norms can be taken in backward (Note: [Norms from backward]
    in ``backward_norms.py``); the multiplication needs the total norm, so it ran on the calling
    thread between backward and ``step()``, with the device idle (65-72 ms for the 0.9 B Llama's
    3.54 GB of float32 gradients on the H200's host). Here ``clip_grad_norm_`` computes the norm and
    the coefficient and returns; each streamed slice's multiplication is *owed* on the slice
    (``SliceUpdates.owe`` in ``offload/streams/updates.py``) and ``step()`` hands it to the slice's
    update (``claim``). The update multiplies the gradients as it reads them: the one-pass kernel
    (Note: [One-pass update] in ``offload/kernels/one_pass.py``), with a shadow to write or not, in
    registers, storing each back as the clip leaves it (4 bytes a float32 parameter written, where a
    pass of its own reads and writes 8); other optimizers, or a machine without the kernel,
    multiply them first, on the worker. The worker runs the updates in the next forward's order
    (Note: [Updates in the next forward's order] in ``stepping.py``): slice 0's first, the rest
    beside the forward.

    The same result bit for bit: each gradient is multiplied by the same 0-d coefficient that
    ``torch.nn.utils.clip_grads_with_norm_`` computes, in float32, before anything else reads it
    (an elementwise product does not depend on which thread, or how many, computes it, nor on
    whether it is stored before it is used); only the time moves. In the kernel's pass, any other
    operation of the step that reads an owed gradient (PyTorch's fused kernel for what the one pass
    does not take, a step a ``GradScaler`` skips, an optimizer's own reads) gets it multiplied
    first; a gradient the step does not read (one replaced after the clip) is multiplied after it.

    Until the update takes it, anything that needs the slice has the scaling submitted alone to
    the worker and waits for it as for an update: the slice's load in the next forward (a
    ``step()`` that never came), reads through the model (``parameters()``, ``named_parameters()``,
    ``state_dict()``...), the optimizer's ``state``, ``synchronize()``,
    ``zero_grad(set_to_none=False)``, a second ``clip_grad_norm_`` of the same gradients. It writes
    no shadow, and the shadow is not taken as written by it. What does not wait, as for an update:
    a reference to a gradient taken before the clip (through the optimizer's ``param_groups``, say)
    read before ``step()`` returns; call ``synchronize()`` first.

    Scaled at once, on the calling thread, as before: gradients on the device (resident slices),
    of parameters outside the model, in files (masters on disk), of a sharded optimizer's
    model (its exchange orders the updates) and of an optimizer that is not the model's newest;
    gradients that are not contiguous (an expanded one, on which the product raises, raises at the
    clip); every gradient when a parameter is listed twice (PyTorch scales it twice), a gradient
    tensor two parameters share (scaled once for each), and every one with ``foreach=True``. The
    coefficient is PyTorch's, on the total norm's device (a resident slice's when its gradients
    come first), copied to the host as PyTorch copies it for host gradients.
    A scaling run alone that raises says so, and that the step's later updates did not run.

    Orderings: owed work is submitted after the work pending on its slice, and every wait for the
    slice, or request of its event, submits it first (``SliceUpdates``); an update that claims it
    runs after what the calling thread did (the norms it read); a clip waits for the slice's
    event, the scaling alone or the update that took it over, before it reads gradients an
    earlier clip scaled (``settle``).
"""

from __future__ import annotations

import functools
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..clipping import add_scaler
from ..kernels.scaling import OwedScaling
from ..streams.workers import mark_of, queued_since
from ..tiers.slice_update import SliceStep
from ..walk.engine import Engine
from .stepping import SliceUpdates

#: Given the optimizer: its hand-off of updates, and the slice steps whose gradients may be scaled on the worker.
Planned = Callable[[Any], tuple[SliceUpdates, Sequence[SliceStep]]]


class DeferredScaling:
    """Hands ``clip_grad_norm_``'s scaling of the streamed slices' host gradients to the update worker
    (Note: [Scaling in the update]).

    Args:
        optimizer: the ``OffloadOptimizer`` (held weakly).
        planned: given the optimizer, its hand-off of updates to the worker now (a move of the
            model builds another) and the slice steps whose gradients may be scaled on the worker
            (none where the Note says they are scaled at once).
    """

    def __init__(self, optimizer: Any, planned: Planned) -> None:
        self._optimizer = weakref.ref(optimizer)
        self._planned = planned
        self._slices: list[tuple[Engine, int]] = []  # the slices a scaling was handed to
        self._handed: set[int] = set()  # the ids of the parameters whose scaling those are
        add_scaler(self)

    @classmethod
    def attach(cls, optimizer: Any, planned: Planned, enabled: bool) -> DeferredScaling | None:
        """One for ``optimizer`` when ``enabled``, else ``None``."""
        return cls(optimizer, planned) if enabled else None

    def settle(self, params: Sequence[torch.Tensor]) -> None:
        """Wait until every scaling handed over so far has run, if it scales a gradient of ``params``
        (a clip is about to read them); another model's clip does not wait for it, nor meet its errors."""
        if not self._slices or not any(id(p) in self._handed for p in params):
            return
        slices, self._slices, self._handed = self._slices, [], set()
        for engine, index in slices:
            # The slice's event: its scaling's, submitted now if it was still owed, or the event of
            # the update that took it over (which stands for it).
            engine.copies.wait_host(engine.updates.event(index))

    def forget(self) -> None:
        """Drop the record of scaling that has run (the model moved, after every pending update)."""
        self._slices, self._handed = [], set()

    def take(self, params: Sequence[torch.Tensor], coefficient: torch.Tensor) -> set[int]:
        """Hand over the scaling of the gradients of ``params`` that a streamed slice's update on the
        worker steps, by ``coefficient`` (0-d, on the CPU), owed on the slice until its update or
        anything else needs it; returns the ids of those parameters."""
        optimizer = self._optimizer()
        if optimizer is None:
            return set()
        updates, steps = self._planned(optimizer)
        # A gradient tensor two parameters share is scaled once per parameter by PyTorch's clip:
        # the clip scales it, as many times, at once.
        shared = Counter(p.grad.data_ptr() for p in params if p.grad is not None)
        wanted = {id(p) for p in params if shared[p.grad.data_ptr()] == 1}  # type: ignore[union-attr]
        taken: set[int] = set()
        for step in steps:
            storage = step.storage
            if step.whole is None or storage is None or storage.masters_file is not None:
                continue
            chosen = [p for p in step.whole.params if id(p) in wanted and id(p) not in taken and _scalable(p.grad)]
            if not chosen:
                continue
            taken.update(id(p) for p in chosen)
            self._handed.update(id(p) for p in chosen)
            owed = OwedSlice(updates, step.index, [p.grad for p in chosen], coefficient)
            updates.engine.updates.owe(step.index, owed)
            self._slices.append((updates.engine, step.index))
        return taken


class OwedSlice:
    """A slice's owed scaling: its update takes ``scaling`` into its own pass, or, when something
    else needs the slice first, :meth:`submit` runs it on the update worker alone."""

    def __init__(self, updates: SliceUpdates, index: int, grads: list[torch.Tensor], coefficient: torch.Tensor) -> None:
        self.updates = updates
        self.index = index
        self.scaling = OwedScaling(grads, coefficient)

    def submit(self) -> None:
        engine = self.updates.engine
        worker = self.updates.start_worker()
        work = functools.partial(_scale, self.scaling, self.index)
        mark = mark_of(worker)
        event = None
        try:
            # After what is pending on the slice (an update a clip after step() would race with).
            event = engine.copies.submit(worker, work, after=[engine.updates.event(self.index, self)], key=self.index)
        finally:
            # Owed until registered: asked of the worker if an interrupt came once it was queued
            # (Note: [A worker under interrupts and forks] in offload/streams/workers.py).
            if event is None:
                event = queued_since(worker, mark)
            if event is not None:
                engine.updates.submitted(self.index, event, writes_shadow=False, claimed=self)


def _scalable(grad: torch.Tensor | None) -> bool:
    """A host gradient the worker can scale: contiguous, so no element is another's memory (an
    expanded tensor, on which PyTorch's product raises, is scaled at the clip and raises there)."""
    return grad is not None and grad.device.type == "cpu" and grad.layout == torch.strided and grad.is_contiguous()


def _scale(scaling: OwedScaling, index: int) -> None:
    """On the update worker: ``clip_grads_with_norm_``'s product, one CPU gradient at a time."""
    try:
        scaling.apply_rest()
    except Exception as error:
        error.add_note(f"While scaling slice {index}'s gradients for clip_grad_norm_ (scale_in_update=True): the "
                       "updates of this step after it did not run.")
        raise
