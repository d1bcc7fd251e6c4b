"""Updates that backward starts: each slice's update handed to the host worker as soon as its
gradients are final on the host, in the backward that ends an accumulation
(``OffloadOptimizer(..., update_in_backward=True)``).

Note: [Update in backward]
    Without it, a step's update can only hide behind the next forward (Note: [Overlapped host
    update] in ``offload/optimizer.py``): about a third of the device's work with recompute, so
    an update longer than that shows in every step while the host idles through backward. With
    it, the backward that ends an accumulation (the ``accumulation_steps``-th since the last
    ``step()``, counting the backwards that add into ``.grad``) hands slice ``k``'s update to
    the worker as soon as slice ``k``'s gradients have landed, while the device goes on with the
    slices before it; ``step()`` then starts only what backward could not (the parameters outside
    the model, and the slices listed below) and returns.

    It is the plain optimizer's result, bit for bit, because the update reads what ``step()``
    would read: each gradient as ``.grad`` will hold it when backward returns (backward adds into
    ``.grad`` itself on landing wherever ``.grad`` exists: Note: [Gradients added in place],
    whose rule 6 this backward waives), and the hyperparameters as they are when that backward
    starts. That holds only if nothing changes ``.grad`` or the hyperparameters between that
    backward and ``step()``, and so it is checked, not assumed:

    - a gradient that reaches a parameter the optimizer steps from outside the model (a penalty on
      the weights in the same loss) is seen by a pre-hook on the parameter's accumulation node,
      which receives something other than what backward returned for it (the watch of Note:
      [Adding onto earlier gradients] in ``offload/autograd/outside_gradients.py``): the backward
      raises;
    - ``clip_grad_norm_``, ``zero_grad``, or anything else that rewrites or replaces a ``.grad``
      between backward and ``step()`` through PyTorch's in-place operations changes its version
      counter or its identity: ``step()`` raises (a write through ``.grad.data`` is not seen);
      ``offload.clip_grad_norm_``, which writes nothing below ``max_norm``, tells it itself
      (``backward_reads.py``). The update itself may write into the gradients it reads, as the
      plain optimizer writes into ``.grad`` (torch's foreach ``SGD`` with ``nesterov`` adds the
      momentum into them), and the worker may run it after backward has returned, before
      ``step()``: it writes through aliases with version counters of their own
      (:func:`_own_writes`), so that its writes are never taken for a change, whenever it runs,
      while a change of the user's moves ``.grad``'s counter before the update or after it;
    - a ``GradScaler`` stepping the optimizer: ``step()`` raises. It is found by its call (the
      kernel of ``GradScaler.unscale_`` leaves the version counters as they were), and by the
      scale it hands a fused optimizer;
    - a hyperparameter set between that backward and ``step()`` (a warm-up set by hand, a
      scheduler stepped before the optimizer): ``step()`` raises; a ``torch.optim.lr_scheduler``
      step tells it itself, so that one setting the values they had is refused too;
    - ``zero_grad()`` (the optimizer's or the model's) with no ``step()`` after that backward had
      started updates (a batch skipped, or a backward through the model for another model's loss: a
      GAN's generator step through the discriminator, which counts as one of its backwards):
      ``zero_grad()`` raises, zeroing nothing (:func:`check_zero_grad`); one before it starts the
      accumulation again;
    - ``load_state_dict()`` of the optimizer between that backward and ``step()`` (the updates that
      ran stepped the state it replaced): ``step()`` raises;
    - ``step()`` after more backwards than declared: ``step()`` raises (after fewer, none started
      anything, and ``step()`` steps as without the option). A backward that raised is not counted
      unless it had started updates (one that raises at its start, before any, where it does what
      ``step()`` does first, counts none of the accumulation's: :func:`_before_updates`); if it had, the next ``step()`` raises, naming the slices
      updated (another backward since or not), unless the optimizer's state is loaded first (the
      reload of the last checkpoint that its error advises); until that load, ``state_dict()`` and
      ``save_checkpoint`` refuse the mix (Note: [An update that failed part way] in
      ``partial_failure.py``).

    Only the model's parameters and the groups holding them are compared: ``step()`` steps the
    others with what they hold then, as without the option.

    The first backward and ``step()`` of an optimizer start nothing early and only check, so
    these mistakes, made from the start, cost nothing: the error comes before any update ran.
    After that the checks still run, but a mistake that appears later (clipping turned on
    mid-training) is found after the update it spoiled: the error says which slices were updated
    with which gradients, and to reload the last checkpoint.

    A slice's update waits for ``step()`` (exact, only not early) when one of its parameters has
    a gradient hook (``register_hook`` or ``register_post_accumulate_grad_hook``: autograd applies
    it after backward returns; its accumulation node is not watched either, since the hook changes
    what the node receives), is tied to another slice (its slices' gradients are summed as
    backward ends), or has a ``.grad`` backward cannot add into (another dtype, sparse).
    ``deferred`` says which, and why.

    Behind: slice 0's gradients land last, and the next forward loads it first. When the whole
    update outlasts backward, the worker still holds the updates of the last slices to land when
    the next forward starts; it runs them lowest slice first (Note: [Updates in the next forward's
    order] in ``stepping.py``), so that forward loads each as soon as its own update is done
    instead of waiting for all of them before its first slice. With ``max_backlog``, once the
    worker is that many updates behind, the slices still to land wait for ``step()``, which
    starts them in slice order. Off by default: on one
    H100 (``benchmarks/results/h100-2026-11-26b/peers2.json``) ``max_backlog = 1`` stopped too early
    and made the step 440 ms against 373 ms without it; when to stop would have to come from the
    measured update, backward and forward times of each slice.

    Orderings: the update of slice ``k`` runs on the worker after the copy of its gradients to the
    host (``ready``), and after the main thread added them into ``.grad``; it writes slice
    ``k``'s host copies, which nothing reads again before the next forward's load of slice ``k``,
    which waits for the update (``engine.updates``).

Note: [A plan kept for its step()]
    The plan (``offload/optimizing/plan.py``) says which slice steps which parameters, from the
    slices' host copies as laid out; ``step()`` starts the slices the backward did not, by index.
    A slice laid out again between that backward and ``step()`` changes the plan's key: a
    ``torch.func.functional_call`` (an EMA evaluated) lays the slices out around the caller's
    tensors, so the model's own parameters would look outside the model, and a layer's parameter
    replaced drops it from its slice. Planned anew there, ``step()`` would update those parameters
    again, beside the slices backward updated (their state too). So the plan that backward's
    updates ran with stays until its ``step()`` (``_plan`` in ``offload/optimizer.py``): the step
    starts the slices that backward did not, against that plan, each inner optimizer pointed at
    its parameters' memory as it is then (``SliceStep.bind``), wherever the layout put them; the
    shadow it writes is the slice's as laid out now, and the next forward lays the slice out again
    where the call has ended. The next backward or ``step()`` plans anew.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ..autograd import outside_gradients
from ..grad_scaler import _calling_scaler
from ..streams import Event
from ..walk.engine import Engine
from ..walk.milestones import Subscriber
from .backward_reads import BackwardReads, listing
from .stepping import SliceUpdates


class BackwardUpdates(Subscriber):
    """Starts each slice's update from backward (Note: [Update in backward]).

    Args:
        optimizer: the ``OffloadOptimizer`` (held weakly: the model's walk holds this).
        engine: the engine of its model.
        accumulation_steps: backwards per ``step()``.
        updates: the optimizer's hand-off of each slice's update to the worker.
        before_update: what ``step()`` does before updates start (the plan; errors of the last writes),
            called with the optimizer and ``"backward"`` (what its errors say): holding a closure over
            the optimizer would keep it, and its state, alive as long as the model.
    """

    def __init__(self, optimizer: Any, engine: Engine, accumulation_steps: int,
                 updates: SliceUpdates, before_update: Callable[[Any, str], Any]) -> None:
        # Weakly, and unsubscribed with it: the model's walk holds this subscriber, and with it the
        # update worker, which must go with the optimizer.
        self._optimizer = weakref.ref(optimizer, _unsubscriber(engine, self))
        self._engine = engine
        self.accumulation_steps = accumulation_steps
        self._updates = updates
        #: With a number, a slice's update waits for step() once the worker is that many updates
        #: behind, and so do the slices after it (Note: [Update in backward], "behind"); None: never.
        self.max_backlog: int | None = None
        self._behind = False
        self._before_update = before_update
        #: Backwards that added into .grad since the last step().
        self.backwards = 0
        #: Whether a backward and step() passed the checks: later backwards start updates.
        self.checked = False
        #: Slices whose update backward started since the last step(), and before the last step().
        self.started: set[int] = set()
        self.last_started: set[int] = set()
        #: Slice -> why its update waits for step() (Note: [Update in backward]), from the last backward.
        self.deferred: dict[int, str] = {}
        self._token: Any = None  # the forward whose backward ends the accumulation, while it runs
        # What the updates that backward starts read, compared with what step() would read.
        self._reads: BackwardReads | None = None
        self._task_open = False  # a backward is running (counted, its end's callback queued)
        self._failed = False  # a backward raised after it had started updates, since the last step()
        self._names: dict[int, str] = {}
        self._tied: set[int] = set()  # the weights tied across slices, as of the backward that ends the accumulation
        self._step_of: dict[int, Any] = {}  # slice index -> its SliceStep, while that backward runs
        self._stepped: set[int] = set()  # ids of the parameters the optimizer steps, from that backward's start
        self._mismatched: list[str] = []  # parameters seen receiving a gradient from outside the model

    @classmethod
    def attach(cls, optimizer: Any, engine: Engine, accumulation_steps: int, updates: SliceUpdates,
               before_update: Callable[[Any, str], Any], enabled: bool) -> BackwardUpdates | None:
        """Subscribe a new one to the walks of the optimizer's model (``engine``), in place of an
        older optimizer's (only the newest optimizer of a model steps it); ``None`` when not
        ``enabled``."""
        milestones = engine.milestones
        for old in [s for s in milestones.subscribers if isinstance(s, cls)]:
            milestones.unsubscribe(old)
        if not enabled:
            return None
        subscriber = cls(optimizer, engine, accumulation_steps, updates, before_update)
        milestones.subscribe(subscriber)
        return subscriber

    def follow(self, engine: Engine, updates: SliceUpdates) -> None:
        """Watch the walks of ``engine``, the model's engine built anew for another compute device
        (rule 3 of Note: [Moving an OffloadModel] in ``offload/modeling/placement.py``), and hand
        updates to ``updates``; the backwards counted and the checks passed so far still hold."""
        subscribed = any(s is self for s in self._engine.milestones.subscribers)  # only the newest optimizer's is
        self._engine.milestones.unsubscribe(self)
        self._optimizer = weakref.ref(self._optimizer(), _unsubscriber(engine, self))
        self._engine, self._updates = engine, updates
        if subscribed:
            engine.milestones.subscribe(self)

    # -- milestones ---------------------------------------------------------------------------------

    def forward_started(self, token: Any) -> None:
        # A backward that failed never reached its end (_backward_done): let go of what it left. It
        # returned nothing to autograd, and the user who caught its error trains on as after any
        # failed backward, so it is not counted; unless it started updates (with gradients the
        # plain optimizer never steps): counted, it makes step() raise, saying which slices ran.
        if self._task_open and not self.started:
            self.backwards -= 1
        elif self._task_open:
            self._failed = True
            _latch_failure(self, self.started)
        self._end_task()
        self._mismatched = []

    def state_loaded(self) -> None:
        """The optimizer's state was loaded: after a backward that raised once updates had started
        (a forward since or not), that is the reload its error advised, which replaces what those
        updates wrote (the model's parameters are loaded beside it): forget them."""
        if self._failed or (self._task_open and self.started):
            self._end_task()
            self.started, self.backwards, self._reads, self._failed = set(), 0, None, False

    def backward_started(self, token: Any, accumulates: bool) -> None:
        # One backward is one run of autograd's engine, whatever number of calls of the model it
        # goes through: the first call's backward counts it, and the end of the run closes it.
        if not accumulates or self._task_open:
            return
        optimizer = self._optimizer()
        ending = optimizer is not None and self.backwards + 1 == self.accumulation_steps
        if ending and self.checked:
            _before_updates(self, optimizer)
        self._task_open = True
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        self.backwards += 1
        if not ending:
            return
        self._token = token
        self.deferred = {}
        self._behind = False
        self._reads = BackwardReads.at_start(optimizer)
        self._stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        self._names = self._engine.parameter_names()
        self._tied = self._engine.tied_parameter_ids()
        # Looked up once per backward, not once per slice: the plan is final from here to step().
        self._step_of = {s.index: s for s in optimizer._steps}

    def wants_final_gradients(self, token: Any) -> bool:
        return token is not None and token is self._token

    def final_parameters(self, token: Any) -> set[int]:
        # The parameters this optimizer steps: a gradient from outside the model into another one
        # (a penalty on a weight some other code steps) changes no update, and is not refused.
        return self._stepped if self.wants_final_gradients(token) else set()

    def gradients_final(self, token: Any, index: int, grads: list[torch.Tensor | None], ready: Event | None) -> None:
        optimizer = self._optimizer()
        if token is not self._token or optimizer is None:
            return
        engine = self._engine
        entries = engine.slices[index].storage.params
        tied = self._tied
        stepped = self.final_parameters(token)
        final: dict[int, torch.Tensor | None] = {}
        for entry, grad in zip(entries, grads):
            p = entry.tensor
            if id(p) in tied or not p.requires_grad or _hooked(p) or id(p) not in stepped:
                continue  # the slice's update waits for step() (a hook changes what its node receives)
            final[id(p)] = p.grad if grad is None else grad
        if final:
            # Each must receive at its accumulation node only what backward returns for it.
            watched = [(entry.tensor, False) for entry in entries if id(entry.tensor) in final]
            outside_gradients.watch(watched, self._name, on_outside=functools.partial(self._outside, token))
        if not self.checked:
            return
        step = self._step_of.get(index)
        if step is None or step.whole is None:
            return
        why = (_why_deferred(step.whole.params, tied, final, self._name)
               if not (step.storage and step.storage.resident) else "the slice is resident: step() updates it on the device")
        if why is None and self.max_backlog is not None and (self._behind or self._updates.backlog() > self.max_backlog):
            self._behind = True
            why = "the update worker is behind: this slice's update starts at step(), in the order the next forward loads"
        if why is not None:
            self.deferred[index] = why
            return
        assert self._reads is not None
        # A parameter this backward gives no gradient to (frozen, or unused) is stepped with the
        # .grad it has, as step() would. The update holds aliases, not the tensors backward returns:
        # autograd adopts a returned gradient as .grad only if nothing else holds it, and copies
        # it otherwise (a copy of every gradient, read while the update runs).
        grads = [final.get(id(p), p.grad) for p in step.whole.params]
        self._updates.submit_one(step, _own_writes(grads), self._reads.hyper, [ready])
        _not_known_zeros(engine, step.whole.params)
        self.started.add(index)

    # -- the checks -------------------------------------------------------------------------------

    def _outside(self, token: Any, name: str) -> None:
        """A watched parameter received a gradient from outside the model, in the backward of
        ``token``'s call: raised at that backward's end (a watch left behind by a backward that
        failed is not this one's)."""
        if token is not None and token is self._token:
            self._mismatched.append(name)

    def _end_task(self) -> bool:
        """Close the running backward; whether it was the one that ends the accumulation."""
        ending = self._token is not None
        self._token, self._task_open = None, False
        self._step_of = {}  # its steps hold the optimizer: not past the backward that needs them
        return ending

    def _backward_done(self) -> None:
        """The end of a backward; for the one that ends the accumulation: raise what a pre-hook
        saw, and remember each ``.grad`` and its version for ``step()`` to compare."""
        mismatched, self._mismatched = self._mismatched, []
        optimizer = self._optimizer()
        if not self._end_task() or optimizer is None:
            return
        if self._reads is not None:
            self._reads.at_end(optimizer, {id(p) for p in self._engine.parameters()})
        if mismatched:
            self.backwards = 0
            raise RuntimeError(
                f"update_in_backward: the gradient of {listing(mismatched)} also comes from outside this call of the "
                f"model (the loss uses the parameter itself, e.g. a penalty on the weights, or calls the model twice), "
                f"so backward cannot know it before it returns. {self._what_ran()} Build OffloadOptimizer without "
                f"update_in_backward for this loss.")

    def before_step(self, grad_scale: torch.Tensor | None) -> set[int]:
        """In ``step()``: raise if the update backward started (or would have) did not read what
        ``step()`` reads; otherwise return the slices whose update backward started, and get ready
        for the next accumulation."""
        backwards, self.backwards = self.backwards, 0
        # A backward that raised after starting updates, followed by a forward (forward_started) or not.
        failed, self._failed = self._failed or (self._task_open and bool(self.started)), False
        if self._task_open:
            self._end_task()
        started, self.started = self.started, set()
        self.last_started = started
        if backwards < self.accumulation_steps:
            # No backward since the last step, or fewer than declared (an epoch's last step when its
            # batches do not divide by the accumulation, as the Hugging Face Trainer takes it): none
            # ended the accumulation, nothing started, and step() steps what .grad holds, as before.
            self._reads = None
            return started
        if failed:
            _latch_failure(self, started)
            raise RuntimeError(
                f"update_in_backward: a backward since the last step() raised after it had started updates (its error "
                f"said so), and the other slices were not updated: the parameters mix two steps. "
                f"{self._what_ran(started)}")
        if backwards > self.accumulation_steps:
            raise RuntimeError(
                f"update_in_backward: step() after {backwards} backward(s), but the optimizer was built with "
                f"accumulation_steps={self.accumulation_steps}: the updates started in backward "
                f"{self.accumulation_steps} did not see the gradients added later. {self._what_ran(started)} Pass the "
                "number of backwards per step as accumulation_steps, and call step() after each accumulation's last "
                f"backward (a step() skipped, the next accumulation adds onto its gradients). {ANOTHER_MODELS_LOSS}")
        # A fused optimizer gets the scale itself; another finds its gradients unscaled in place by a
        # kernel that leaves their version counters as they were, so the scaler is looked for.
        scaler = _calling_scaler()
        if grad_scale is not None or (scaler is not None and scaler.is_enabled()):
            raise RuntimeError(
                "update_in_backward: a GradScaler steps this optimizer; it may skip a step or unscale the gradients "
                f"after backward started the update. {self._what_ran(started)} Build OffloadOptimizer without "
                "update_in_backward to train with a GradScaler (bfloat16 needs none).")
        reads, self._reads = self._reads, None
        difference = reads.difference(self._optimizer(), {id(p) for p in self._engine.parameters()}, self._name) \
            if reads is not None else None
        if difference is not None:
            what, advice = difference
            raise RuntimeError(f"update_in_backward: {what} {self._what_ran(started)} {advice}")
        self.checked = True
        return started

    def _what_ran(self, started: set[int] | None = None) -> str:
        started = self.started if started is None else started
        if not started:
            return "No update ran: parameters and optimizer state are as they were."
        return (f"The update of slices {sorted(started)} already ran with the gradients backward produced: reload "
                f"the last checkpoint before training on.")

    def _name(self, p: torch.Tensor) -> str:
        return self._names.get(id(p), f"a parameter of shape {tuple(p.shape)}")

    def before_zero_grad(self) -> None:  # the model's own zero_grad() (netD.zero_grad()), as the optimizer's
        check_zero_grad(self)


def check_failed_backward(backward: BackwardUpdates | None) -> None:
    """Before the state is handed out (a save, ``state_dict()``): a backward that raised after it
    had started updates, and no forward since, left a mix of two steps; have the optimizer remember
    it (Note: [An update that failed part way] in ``partial_failure.py``)."""
    if backward is not None and backward._task_open and backward.started:
        _latch_failure(backward, backward.started)


#: What the refusals of a backward counted too many say of its usual cause beside a skipped step.
ANOTHER_MODELS_LOSS = (
    "A backward through this model for another model's loss counts as one of its own: a GAN's generator step "
    "backpropagates its loss through the discriminator D while D's parameters require grad, and so starts D's "
    "update with the generator loss's gradients, which plain PyTorch never steps. For that step, switch D's "
    "parameters off (for p in D.parameters(): p.requires_grad_(False)), and on again before D's own backward "
    "(docs/optimizer.md, Several models in one loop).")


def check_zero_grad(backward: BackwardUpdates | None) -> None:
    """Before ``zero_grad()`` (the optimizer's, or the model's: :meth:`BackwardUpdates.before_zero_grad`):
    refuse one after the backward that started updates, with no ``step()`` since (a skipped batch,
    or a backward for another model's loss): those updates ran and the other slices' would not, and
    the next accumulation's ``step()`` would find too many backwards. Where no update started (the
    first step, every slice waiting for ``step()``, or an accumulation not ended yet), the batch is
    skipped as without the option: the accumulation starts again, its count and reads forgotten. A
    backward that raised is left to its error and to ``step()``, which say what ran."""
    if backward is None or backward._task_open or backward._failed:
        return
    if backward.started:
        raise RuntimeError(
            f"update_in_backward: zero_grad() without step() after the backward that started the update of slices "
            f"{sorted(backward.started)}: those updates ran with its gradients; nothing was zeroed. Call step() (it "
            "finishes the step with the same gradients) before zero_grad(), and load the last checkpoint after it "
            "to undo the step; to skip a batch, skip it before its last backward, or build "
            f"OffloadOptimizer without update_in_backward. {ANOTHER_MODELS_LOSS}")
    backward.backwards, backward._reads = 0, None


def _before_updates(backward: BackwardUpdates, optimizer: Any) -> None:
    """At the start of the backward that starts the step's updates, before it counts: what
    ``step()`` does before updates start (the plan; what the last step could not write, its held
    state written first). What that raises, it raises before any of this backward's gradients
    reach the model's parameters and before any update: this backward is not counted, and neither
    are the accumulation's earlier ones, since the error advises to run the batch (every batch of
    the accumulation) again after ``zero_grad()`` (Note: [Disk tier failures] in
    ``offload/tiers/disk_tier.py``, rule 2)."""
    try:
        backward._before_update(optimizer, "backward")
    except BaseException:
        backward.backwards = 0
        raise


def _latch_failure(backward: BackwardUpdates, started: set[int]) -> None:
    """Have the optimizer refuse to hand out the mix that the updates ``started`` by a backward that
    raised left, until a load; ``step()`` says so itself (:meth:`BackwardUpdates.before_step`)."""
    backward._updates.failure.mixed(f"a backward raised after update_in_backward had started the update of slices "
                                    f"{sorted(started)}, which ran with its gradients; the other slices were not "
                                    "updated")


def _why_deferred(params: list[torch.Tensor], tied: set[int], final: dict[int, torch.Tensor | None],
                  name: Callable[[torch.Tensor], str]) -> str | None:
    """Why a slice's update cannot start in backward, or ``None`` if it can."""
    for p in params:
        if id(p) in tied:
            return f"{name(p)} is tied to another slice"
        if _hooked(p):
            return f"{name(p)} has a gradient hook"
        grad = final.get(id(p))
        if grad is not None and grad is not p.grad and p.grad is not None:
            return f"backward cannot add {name(p)}'s gradient into its .grad ({p.grad.dtype}, {p.grad.layout})"
    return None


def _unsubscriber(engine: Engine, subscriber: BackwardUpdates) -> Callable[[Any], None]:
    """A callback that unsubscribes ``subscriber`` from ``engine``'s walks, holding neither strongly."""
    milestones, held = weakref.ref(engine.milestones), weakref.ref(subscriber)

    def unsubscribe(_: Any) -> None:
        m, s = milestones(), held()
        if m is not None and s is not None:
            m.unsubscribe(s)

    return unsubscribe


def _own_writes(grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Aliases of ``grads`` for an update that backward starts, each with a version counter of its
    own (``.data``; ``detach()`` shares the gradient's): what the inner optimizer writes into
    them in place (the update's own writes, Note: [Update in backward]) moves no counter that
    ``step()`` compares, and anything else that writes into ``.grad`` still moves ``.grad``'s."""
    return [None if g is None else g.data for g in grads]


def _not_known_zeros(engine: Engine, params: list[torch.Tensor]) -> None:
    """Forget that the ``.grad`` of ``params`` hold the zeros ``zero_grad`` left, as a write into
    them would have (rule 6 of Note: [Gradients added in place] in
    ``offload/autograd/accumulation.py``): their update, which backward just started, may write
    into them through the aliases of :func:`_own_writes`, which move no version counter."""
    for p in params:
        engine.zeroed_gradients.pop(id(p), None)


def _hooked(p: torch.Tensor) -> bool:
    """Whether autograd runs hooks of ``p``'s own once backward has produced its gradient
    (``register_hook``, ``register_post_accumulate_grad_hook``): they may change ``.grad``."""
    return bool(p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None))


def check_in_backward(model: Any, engine: Engine, enabled: Any, accumulation_steps: Any, shard: Any,
                      norms: Any = False, scaling: Any = False) -> None:
    """Raise what ``OffloadOptimizer`` says it raises for ``update_in_backward``, ``accumulation_steps``,
    ``norms_in_backward`` and ``scale_in_update``,
    and for a new optimizer of a model (``engine``) whose last backward started updates that no
    ``step()`` has ended: the new optimizer's step would update those slices again."""
    for old in engine.milestones.subscribers:
        if isinstance(old, BackwardUpdates) and old.started:
            raise RuntimeError(
                f"the model's OffloadOptimizer (update_in_backward=True) started the update of slices "
                f"{sorted(old.started)} in the last backward, and its step() has not come: a new optimizer's step() "
                "would update them again. Call that optimizer's step() first (after a failed backward it raises, "
                "and the new optimizer can then be built: reload the last checkpoint into the model and it)")
    if not isinstance(enabled, bool):
        raise TypeError(f"update_in_backward must be True or False, got {enabled!r}")
    if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int) or accumulation_steps < 1:
        raise ValueError(f"accumulation_steps must be a positive int, got {accumulation_steps!r}")
    if not isinstance(norms, bool):
        raise TypeError(f"norms_in_backward must be True or False, got {norms!r}")
    if not isinstance(scaling, bool):
        raise TypeError(f"scale_in_update must be True or False, got {scaling!r}")
    for name, wanted in (("norms_in_backward", norms), ("scale_in_update", scaling)):
        if wanted and enabled:
            raise ValueError(
                f"{name} is for clipping, which update_in_backward cannot follow (the updates start before "
                "clip_grad_norm_ runs): choose one")
    if accumulation_steps != 1 and not (enabled or norms):
        raise ValueError(
            "accumulation_steps tells update_in_backward (or norms_in_backward) which backward starts the update "
            "(or computes the norms); without either, the update starts at step(), after any number of backwards: "
            "leave it out")
    if enabled and (shard or getattr(model, "_data_parallel", None) is not None):
        raise ValueError(
            "update_in_backward is not supported with data parallelism (process_group) or a sharded optimizer: the "
            "gradients are averaged across processes on their way to the host. Leave update_in_backward out.")
