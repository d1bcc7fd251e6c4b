"""A clip's scaling of the host gradients, run on the update worker just before each slice's update
(``OffloadOptimizer(..., scale_in_update=True)``).

Note: [Scaling in the update]
    ``clip_grad_norm_`` is two passes over the host gradients: their norms, then a multiplication of
    each by the clip coefficient. The norms can be taken in backward (Note: [Norms from backward]
    in ``backward_norms.py``); the multiplication needs the total norm, so it ran on the calling
    thread between backward and ``step()``, with the device idle (65-72 ms for the 0.9 B Llama's
    3.54 GB of float32 gradients on the H200's host). Here ``clip_grad_norm_`` computes the norm and
    the coefficient and returns; each streamed slice's multiplication is handed to the update
    worker, where ``step()`` queues that slice's update after it. The worker runs them in the next
    forward's order (Note: [Updates in the next forward's order] in ``stepping.py``): slice 0's
    scaling and update first, the rest beside the forward, as the updates already were.

    The same result bit for bit: each gradient is multiplied by the same 0-d coefficient that
    ``torch.nn.utils.clip_grads_with_norm_`` computes, with the same operation (an elementwise
    product does not depend on which thread, or how many, computes it); only the time moves.

    The scaling is pending work on its slice, as an update is (``offload/streams/updates.py``), so
    whatever waits for a slice's update waits for it: the slice's load in the next forward, reads
    through the model (``parameters()``, ``named_parameters()``, ``state_dict()``...), the
    optimizer's ``state``, ``synchronize()``, ``zero_grad(set_to_none=False)``. A ``step()`` that
    never comes (a ``GradScaler`` that found infinities) leaves it to complete before the next
    forward loads the slice; the shadow is not taken as written by it (it writes none). What does
    not wait, as for an update: a reference to a gradient taken before the clip (through the
    optimizer's ``param_groups``, say) read before ``step()`` returns; call ``synchronize()`` first.
    A second ``clip_grad_norm_`` waits for the first one's scaling before it reads the gradients.

    Scaled at once, on the calling thread, as before: gradients on the device (resident slices),
    of parameters outside the model, in files (masters on disk), of a sharded optimizer's
    model (its exchange orders the updates) and of an optimizer that is not the model's newest;
    gradients that are not contiguous (an expanded one, on which the product raises, raises at the
    clip); every gradient when a parameter is listed twice (PyTorch scales it twice) or with
    ``foreach=True``. The coefficient is PyTorch's, on the total norm's device (a resident slice's
    when its gradients come first), copied to the host as PyTorch copies it for host gradients.
    A scaling that raises anyway says so, and that the step's later updates did not run.

    Orderings: a slice's scaling runs on the update worker after what the calling thread did (the
    norms it read) and after the work pending on the slice; the slice's update waits for its event
    (``SliceUpdates._submit_update``: the slice's pending event), as does every wait for the
    slice's update; a clip waits for the scaling an earlier clip handed over (``settle``).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..clipping import add_scaler
from ..streams import Event
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
        self._events: list[tuple[Engine, Event]] = []
        self._handed: set[int] = set()  # the ids of the parameters whose scaling those events run
        add_scaler(self)

    @classmethod
    def attach(cls, optimizer: Any, planned: Planned, enabled: bool) -> DeferredScaling | None:
        """One for ``optimizer`` when ``enabled``, else ``None``."""
        return cls(optimizer, planned) if enabled else None

    def settle(self, params: Sequence[torch.Tensor]) -> None:
        """Wait until every scaling handed over so far has run, if it scales a gradient of ``params``
        (a clip is about to read them); another model's clip does not wait for it, nor meet its errors."""
        if not self._events or not any(id(p) in self._handed for p in params):
            return
        events, self._events, self._handed = self._events, [], set()
        for engine, event in events:
            engine.copies.wait_host(event)

    def forget(self) -> None:
        """Drop the events of scaling that has run (the model moved, after every pending update)."""
        self._events, self._handed = [], set()

    def take(self, params: Sequence[torch.Tensor], coefficient: torch.Tensor) -> set[int]:
        """Hand over the scaling of the gradients of ``params`` that a streamed slice's update on the
        worker steps, by ``coefficient`` (0-d, on the CPU); returns the ids of those parameters."""
        optimizer = self._optimizer()
        if optimizer is None:
            return set()
        updates, steps = self._planned(optimizer)
        engine = updates.engine
        wanted = {id(p) for p in params}
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
            work = functools.partial(_scale, [p.grad for p in chosen], coefficient, step.index)
            # After what is pending on the slice (an update a clip after step() would race with).
            event = engine.copies.submit(updates.start_worker(), work, after=[engine.updates.event(step.index)],
                                         key=step.index)
            engine.updates.submitted(step.index, event, writes_shadow=False)
            self._events.append((engine, event))
        return taken


def _scalable(grad: torch.Tensor | None) -> bool:
    """A host gradient the worker can scale: contiguous, so no element is another's memory (an
    expanded tensor, on which PyTorch's product raises, is scaled at the clip and raises there)."""
    return grad is not None and grad.device.type == "cpu" and grad.layout == torch.strided and grad.is_contiguous()


def _scale(grads: list[torch.Tensor], coefficient: torch.Tensor, index: int) -> None:
    """On the update worker: ``clip_grads_with_norm_``'s product, one CPU gradient at a time."""
    try:
        with torch.no_grad():
            for grad in grads:
                grad.mul_(coefficient)
    except Exception as error:
        error.add_note(f"While scaling slice {index}'s gradients for clip_grad_norm_ (scale_in_update=True): the "
                       "updates of this step after it did not run.")
        raise
