"""What the updates that a backward starts read (Note: [Update in backward] in ``in_backward.py``):
the hyperparameters and the optimizer's state as that backward starts, and each ``.grad`` as it
ends; kept until ``step()``, which compares them with what it would read itself.

Two things between that backward and ``step()`` need not change a value ``step()`` could compare,
and tell the reads themselves instead: ``offload.clip_grad_norm_``, which writes nothing when the
clip coefficient is one (the norm below ``max_norm``), and a learning-rate scheduler's ``step()``,
which writes the values it had (``StepLR`` between its steps) or none (``ReduceLROnPlateau`` until
its patience runs out). Compared by value only, the first step of such a loop passed, and the
refusal came at a later one, after updates had run with what the loop then changed.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.optim import lr_scheduler
from torch.utils._pytree import tree_flatten

from ..clipping import add_clip_listener
from ..tiers.slice_update import held_state
from .plan import snapshot


@dataclass(eq=False)  # held in a WeakSet, by identity
class BackwardReads:
    """What the updates started by one backward read.

    Attributes:
        hyper: each parameter group's hyperparameters as the backward started (``snapshot``).
        state: the optimizer's state dict then: ``load_state_dict()`` replaces it, and the updates
            already started stepped the one it replaced.
        seen: each of the model's parameters with its ``.grad`` and that tensor's version as the
            backward ended.
        owner: the optimizer, weakly (a scheduler's step is told to its optimizer's reads).
        clipped: the parameters ``offload.clip_grad_norm_`` went over since the backward started.
        scheduled: the class of each scheduler stepped since then.
    """

    hyper: list[dict[str, Any]]
    state: Any
    seen: list[tuple[torch.Tensor, torch.Tensor | None, int]] = field(default_factory=list)
    owner: Callable[[], Any] = lambda: None
    clipped: list[torch.Tensor] = field(default_factory=list)
    scheduled: list[str] = field(default_factory=list)

    @classmethod
    def at_start(cls, optimizer: Any) -> BackwardReads:
        _watch_clips_and_schedulers()
        reads = cls([snapshot(group) for group in optimizer.param_groups], held_state(optimizer),
                    owner=weakref.ref(optimizer))
        _open.add(reads)  # until its step() drops it
        return reads

    def at_end(self, optimizer: Any, inside: set[int]) -> None:
        """Remember each ``.grad`` of the model's parameters (ids ``inside``): ``step()`` steps the
        others with the ``.grad`` they hold then, so changing theirs (clipping a head outside the
        model) is as without the option."""
        self.seen = [(p, p.grad, p.grad._version if p.grad is not None else 0)
                     for group in optimizer.param_groups for p in group["params"] if id(p) in inside]

    def difference(self, optimizer: Any, inside: set[int], name: Callable[[torch.Tensor], str]
                   ) -> tuple[str, str] | None:
        """What ``step()`` would read that these updates did not, and what to do instead; ``None``
        if nothing. A ``.grad`` changed in place through PyTorch's operations moves its version
        counter; one replaced is another tensor. What the updates themselves write into ``.grad``
        moves no counter (``_own_writes`` in ``in_backward.py``), whether they ran before
        :meth:`at_end` or after it."""
        changed = [name(p) for p, grad, version in self.seen
                   if p.grad is not grad or (grad is not None and grad._version != version)]
        clipped = list({id(p): name(p) for p in self.clipped if id(p) in inside}.values())
        if self.state is not None and optimizer is not None and held_state(optimizer) is not self.state:
            return ("load_state_dict() between backward and step(); the updates backward started stepped the "
                    "state it replaced.", "Load the optimizer's state before backward or after step(), or build "
                    "OffloadOptimizer without update_in_backward.")
        if clipped:
            return (f"clip_grad_norm_ ran over the gradient of {listing(clipped)} between backward and step(); the "
                    "updates read it as backward left it, unclipped.", "Build OffloadOptimizer without "
                    "update_in_backward to clip gradients before the update.")
        if changed:
            return (f"the gradient of {listing(changed)} changed between backward and step() (clip_grad_norm_, a "
                    "hook, zero_grad).", "Build OffloadOptimizer without update_in_backward to change gradients "
                    "before the update.")
        moved = _moved(self.hyper, optimizer, inside)
        if moved or self.scheduled:
            what = (f"{listing(moved)} changed" if moved else
                    f"{self.scheduled[0]}.step() ran (leaving the hyperparameters as they were, this time)")
            return (f"{what} between backward and step(); the update reads the hyperparameters backward saw.",
                    "Change them before backward or after step() (a scheduler steps after optimizer.step()), or "
                    "build OffloadOptimizer without update_in_backward.")
        return None


#: The reads of the backwards whose step() has not come (each goes with its step()).
_open: weakref.WeakSet[BackwardReads] = weakref.WeakSet()
_watching = False
_watch_lock = threading.Lock()


def _watch_clips_and_schedulers() -> None:
    """Once: have ``offload.clip_grad_norm_`` and every ``torch.optim.lr_scheduler`` step tell the
    open reads: ``LRScheduler.step``, which its subclasses run, and each of torch's classes that
    overrides it (``ReduceLROnPlateau``, ``CosineAnnealingWarmRestarts``, the chaining ones);
    nothing else steps a torch scheduler, and no hook of torch's sees it."""
    global _watching
    with _watch_lock:
        if _watching:
            return
        _watching = True
    add_clip_listener(_clipped)
    for cls in vars(lr_scheduler).values():
        if (isinstance(cls, type) and "step" in cls.__dict__
                and (issubclass(cls, lr_scheduler.LRScheduler) or cls is lr_scheduler.ReduceLROnPlateau)):
            cls.step = _telling(cls.__dict__["step"])  # type: ignore[method-assign]
    initial_step = lr_scheduler.LRScheduler.__dict__.get("_initial_step")
    if initial_step is not None:
        lr_scheduler.LRScheduler._initial_step = _flagging(initial_step)  # type: ignore[method-assign]


def _telling(step: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(step)
    def scheduler_step(scheduler: Any, *args: Any, **kwargs: Any) -> Any:
        if not _initial(scheduler):
            optimizer = getattr(scheduler, "optimizer", None)
            for reads in list(_open):
                if optimizer is not None and reads.owner() is optimizer:
                    reads.scheduled.append(type(scheduler).__name__)
        return step(scheduler, *args, **kwargs)

    return scheduler_step


def _flagging(initial_step: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(initial_step)
    def flagged(scheduler: Any, *args: Any, **kwargs: Any) -> Any:
        scheduler.__dict__["_offload_initial"] = True
        try:
            return initial_step(scheduler, *args, **kwargs)
        finally:
            scheduler.__dict__["_offload_initial"] = False

    return flagged


def _initial(scheduler: Any) -> bool:
    """Whether this is the step a scheduler takes as it is built (in ``LRScheduler._initial_step``):
    as torch flags it where it does (``_is_initial``), and as :func:`_flagging` does in every
    release (torch's flag came later)."""
    return bool(getattr(scheduler, "_is_initial", False) or scheduler.__dict__.get("_offload_initial", False))


def _clipped(params: Sequence[torch.Tensor]) -> None:
    for reads in list(_open):
        reads.clipped.extend(p for p in params if p.grad is not None)


def _moved(before: list[dict[str, Any]], optimizer: Any, inside: set[int]) -> list[str]:
    """The hyperparameters whose values differ from ``before`` (``snapshot`` of each group), by
    name, in the groups holding a parameter of the model (ids ``inside``): step() steps the others
    with what they hold then."""
    if optimizer is None:
        return []
    groups = optimizer.param_groups
    if len(groups) != len(before):
        return ["the parameter groups"]
    moved = []
    for g, (old, group) in enumerate(zip(before, groups)):
        if not any(id(p) in inside for p in group["params"]):
            continue
        for key in old.keys() | (group.keys() - {"params"}):
            if not _same(old.get(key), group.get(key)):
                moved.append(f"'{key}' of group {g}")
    return sorted(moved)


def _same(a: Any, b: Any) -> bool:
    """Whether two hyperparameters hold the same values, tensors in a tuple or list (betas) included."""
    a_leaves, a_spec = tree_flatten(a)
    b_leaves, b_spec = tree_flatten(b)
    if a_spec != b_spec:
        return False
    for x, y in zip(a_leaves, b_leaves):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x, y)):
                return False
        elif x != y:
            return False
    return True


def listing(names: list[str]) -> str:
    """The first of ``names``, and how many more."""
    return names[0] if len(names) == 1 else f"{names[0]} (and {len(names) - 1} more)"
