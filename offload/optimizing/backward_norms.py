"""The host gradients' norms computed in backward, as each slice's gradients land, for
``offload.clip_grad_norm_`` (``OffloadOptimizer(..., norms_in_backward=True)``).

Note: [Norms from backward]
    Clipping by norm reads every host gradient once more between backward and ``step()``: a pass
    over 4 bytes per float32 parameter that nothing overlaps, since the update needs its
    coefficient (Note: [Norms on several threads] in ``offload/clipping.py``). In the update
    behind the next forward, the host idles through backward; so here each slice's gradients have
    their 2-norms taken there, on a host worker, as soon as they are final on the host (the
    ``gradients_final`` milestone: after the copy that brings them, and after backward added them
    into ``.grad``), while the device goes on with the slices before. ``clip_grad_norm_`` then
    takes those norms and computes only the others (parameters outside the model, slices on the
    device, gradients that changed).

    It is the same result bit for bit: each norm is the same PyTorch call on the same memory, under
    the same intra-op thread count, that ``clip_grad_norm_`` would make. A norm is taken only
    while the gradient is the same memory holding the same values, which is checked, not assumed:

    - the norm is kept by where the gradient lies (its storage, held weakly, offset, dtype, shape,
      strides), with the gradient's version counter read before the norm was; ``clip_grad_norm_``
      takes it only for a tensor in the same place with the same version. A write through
      PyTorch's in-place operations (``.grad.mul_``, autograd adding a gradient from outside the
      model into ``.grad``, ``zero_grad``) changes the version; a ``.grad`` autograd made anew (a
      sum with such a gradient, a copy) is other memory;
    - every backward of the model forgets the norms of the one before, before its copies write
      host memory again, and so does ``step()``; a norm still being computed for a forgotten
      backward is dropped;
    - ``offload.GradScaler.unscale_`` forgets the norms computed so far, without waiting for those
      still running (its kernel leaves the version counters as they were): the clip computes them
      anew; and the optimizer's backwards compute none from then on (they would all be of scaled
      values, thrown away, and a backward would wait for them: under a scaler the option saves
      nothing and costs nothing);
    - what a version counter cannot see otherwise (a write through ``.grad.data``,
      ``torch.amp.GradScaler.unscale_``, a collective such as ``dist.all_reduce``) is found by
      the first ``clip_grad_norm_`` that meets a parameter's norm from here: it computes that norm
      anew and compares, bit for bit, and raises if one differs (nothing is clipped); later calls
      trust that parameter's norms. A comparison of a non-finite or zero norm checks nothing (a
      scaler's unscaling, an average, leaves it as it was: a first step that overflowed would
      otherwise have every later clip trust still-scaled norms), so that parameter is compared
      again at the next clip. So that the comparison sees such a write, a
      backward waits at its end for its norms until a call has compared some (the first step's,
      mostly): a worker that ran late, after the write, would take the written values and pass
      the comparison, and later steps would then trust norms taken before the write. A parameter
      whose norms backward computes only later (unfrozen then) is compared without that wait. A training loop that does such a write only from
      some step on is not caught: the option is for loops that do none (``docs/optimizer.md``);
    - the registry holds each norm's maker weakly, and no gradient memory; an optimizer's
      finalizer only marks its maker closed (a finalizer can run inside any allocation, under the
      registry's lock too), and the next lookup drops what a closed one left.

    Left to ``clip_grad_norm_``: gradients that go through autograd onto an earlier ``.grad``
    (accumulation onto a ``.grad`` backward does not add into itself: Note: [Adding onto earlier
    gradients]), weights tied across slices (their slices' gradients are summed after they land), gradients
    in files (``masters=DiskTier``: the file is their home) or averaged across processes, and
    sparse ones. The norms of a backward followed by another before ``clip_grad_norm_``
    (accumulation) are forgotten unread; with ``accumulation_steps`` only the backward that ends
    the accumulation computes them (one backward is one run of autograd's engine, through however
    many calls of the model: a second call's gradients are summed anew by autograd, and not taken).

    Orderings: the norms of slice ``k`` run on the worker after the copy of its gradients to the
    host (``ready``) and after what the calling thread did so far (its additions into ``.grad``);
    ``clip_grad_norm_`` waits for the worker before it looks.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any

import torch

from ..clipping import POOLED_DTYPES, add_source, forget_norms, pooled_norms, remember_norms
from ..streams import Event
from ..walk.engine import Engine
from ..walk.milestones import Subscriber


class BackwardNorms(Subscriber):
    """Computes the host gradients' 2-norms in backward (Note: [Norms from backward]).

    Args:
        engine: the engine of the optimizer's model.
        accumulation_steps: backwards per ``step()``; the last one computes the norms.
    """

    def __init__(self, engine: Engine, accumulation_steps: int) -> None:
        self._engine = engine
        self.accumulation_steps = accumulation_steps
        #: Backwards that added into .grad since the last step() (one per run of autograd's engine).
        self.backwards = 0
        #: Ids of the parameters whose norm from here a clip_grad_norm_ compared with its own, bit for
        #: bit: later calls take theirs.
        self.checked: set[int] = set()
        #: Its optimizer is gone, or a newer one's replaced it: it computes and offers nothing more.
        self.closed = False
        #: The intra-op threads of the worker, and the size of its pool: the caller's at construction,
        #: as clip_grad_norm_ computes them (a norm computed under another count is not taken).
        self.threads = torch.get_num_threads()
        self._token: Any = None  # the forward whose backward computes norms, while it runs
        self._task_open = False  # a backward is running (counted, its end's callback queued)
        self._generation = 0  # bumped when the norms are forgotten: a job of an older one keeps none
        self._lock = threading.Lock()
        self._worker: Any = None
        self._events: list[Event] = []
        self._names: dict[int, str] = {}
        self._tied: set[int] = set()
        self._unchecked = False  # this backward computes norms before any clip_grad_norm_ compared one
        #: offload.GradScaler unscaled the gradients after a backward: norms of the scaled values are
        #: never taken, so none is computed from then on.
        self.unscaled = False
        add_source(self)

    @classmethod
    def attach(cls, optimizer: Any, engine: Engine, accumulation_steps: int, enabled: bool) -> BackwardNorms | None:
        """Subscribe a new one to the walks of the optimizer's model (``engine``), in place of an
        older optimizer's; ``None`` when not ``enabled``. It leaves the walks with the optimizer."""
        milestones = engine.milestones
        for old in [s for s in milestones.subscribers if isinstance(s, cls)]:
            old.close()
        if not enabled:
            return None
        subscriber = cls(engine, accumulation_steps)
        milestones.subscribe(subscriber)
        # Without locks: a finalizer may run inside any allocation, one under the registry's lock included.
        weakref.finalize(optimizer, subscriber._optimizer_gone)
        return subscriber

    def follow(self, engine: Engine) -> None:
        """Watch the walks of ``engine``, the model's engine built anew for another compute device, if
        it watched the old engine's (only the newest optimizer's does)."""
        subscribed = any(s is self for s in self._engine.milestones.subscribers)
        self._leave()
        self._engine = engine
        if subscribed:
            engine.milestones.subscribe(self)

    def close(self) -> None:
        """Leave the model's walks for good, forgetting every norm."""
        self.closed = True
        self.checked.clear()
        self._leave()

    def _leave(self) -> None:
        self._engine.milestones.unsubscribe(self)
        self.forget()
        if self._worker is not None:
            self._worker.close()
            self._worker = None

    def _optimizer_gone(self) -> None:
        self.closed = True  # its norms are ignored, and dropped by the next lookup
        self._engine.milestones.unsubscribe(self)

    # -- milestones ---------------------------------------------------------------------------------

    def forward_started(self, token: Any) -> None:
        self._task_open = False  # a backward that failed never reached its end's callback

    def backward_started(self, token: Any, accumulates: bool) -> None:
        self.forget()  # before this backward's copies write host memory
        if not accumulates or self._task_open:
            return  # a second call's backward in one run: autograd sums the calls' gradients anew
        self._task_open = True
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        self.backwards += 1
        if self.backwards < self.accumulation_steps or self._engine.milestones.rewrite_gradients:
            return
        self._token = token
        self._names = self._engine.parameter_names()
        self._tied = self._engine.tied_parameter_ids()

    def _backward_done(self) -> None:
        self._task_open = False
        if self._unchecked:  # the first comparison must see what the caller writes after backward
            self._unchecked = False
            self.settle()

    def wants_final_gradients(self, token: Any) -> bool:
        return token is not None and token is self._token

    def gradients_final(self, token: Any, index: int, grads: list[torch.Tensor | None], ready: Event | None) -> None:
        if token is None or token is not self._token or self.unscaled:
            return
        storage = self._engine.slices[index].storage
        if storage.gradient_home is not None:
            return  # the gradients' home is their file
        chosen: list[tuple[torch.Tensor, str, int]] = []
        for entry, grad in zip(storage.params, grads):
            p = entry.tensor
            if (grad is None or id(p) in self._tied or grad.device.type != "cpu" or grad.layout != torch.strided
                    or grad.dtype not in POOLED_DTYPES):
                continue
            if not p.is_leaf:
                continue  # a tensor functional_call put in a parameter's place: it has no .grad to clip
            if p.grad is not None and p.grad is not grad:
                continue  # autograd adds it onto another .grad after backward
            # An alias: autograd adopts a returned gradient as .grad only if nothing else holds it.
            chosen.append((grad.detach(), self._names.get(id(p), "a parameter"), id(p)))
        if not chosen:
            return
        # Until a clip has compared some: a parameter no clip compares then (a clip of some parameters
        # only) would have every backward wait.
        self._unchecked = self._unchecked or not self.checked
        if self._worker is None:
            self._worker = self._engine.copies.new_worker("gradient norms", self.threads)
            weakref.finalize(self, self._worker.close)  # its thread ends with this subscriber
        work = functools.partial(self._compute, chosen, self._generation)
        self._events.append(self._engine.copies.submit(self._worker, work, after=[ready]))

    def _compute(self, chosen: list[tuple[torch.Tensor, str, int]], generation: int) -> None:
        """On the worker: the norms of one slice's gradients, kept unless forgotten meanwhile."""
        if generation != self._generation or self.closed:
            return
        tensors = [t for t, _, _ in chosen]
        versions = [t._version for t in tensors]  # before the values are read: a later write is seen
        with torch.no_grad():
            norms = pooled_norms(tensors, 2.0, self.threads)
        with self._lock:
            if generation == self._generation and not self.closed:
                remember_norms(self, tensors, norms, versions, [(name, param) for _, name, param in chosen])

    # -- what clip_grad_norm_ and step() call -------------------------------------------------------

    def settle(self) -> None:
        events, self._events = self._events, []
        self._engine.copies.wait_host_all(events)

    def forget(self) -> None:
        with self._lock:
            self._generation += 1
            self._token = None
            self._events = []  # a forgotten job keeps nothing: nothing waits for it
            forget_norms(self)

    def stepped(self) -> None:
        """``step()`` read the gradients: the next accumulation starts."""
        self.backwards = 0
        self.forget()
