"""One slice's share of an optimizer step, as work a host worker runs.

The user's optimizer class steps *proxies*: parameters that share the memory of the user's
parameters (the host copies) but are objects of their own, so that a proxy's ``.grad`` can hold the
gradient captured when ``step()`` was called while the user's ``.grad`` is already reset for the
next step. The optimizer state is keyed by the user's parameters, as the plain optimizer keys it,
through :class:`StateByProxy`; so ``state_dict()`` has the plain optimizer's format, and, because
every ``torch.optim`` update treats each parameter on its own, stepping a slice's parameters
gives bit for bit what stepping all of them at once gives.

A slice is stepped by one call of the optimizer, so an optimizer that raises before changing
anything (checking its arguments, allocating state or a temporary) leaves the whole slice as it
was. Under a compute dtype the slice's shadow is then cast from the fresh masters on the worker,
beside the device's work, instead of on the thread that drives the next forward. See Note:
[Whole-slice update].

Note: [State kept per group]
    An inner optimizer's groups are copies: ``step()`` hands each update the user's groups'
    hyperparameters as they were (``group.update``), one way. A class that writes into its group
    (a step count, Lookahead's counters, Prodigy's ``d``) would keep what it writes per slice,
    out of ``param_groups`` and ``state_dict()``, and a resume would start it again; so after each
    inner step the group's keys are checked against what was handed in, and an added or changed
    key refuses (:class:`GroupStateError`, raised as the update's :class:`HostUpdateError`). The
    check runs at every step, not only the first few: a class may write only later (at the end of
    a warm-up, when its estimate grows), and by identity it costs a dozen ``is`` per group. A
    class whose update reads several parameters at once (a norm over the whole group) cannot be
    seen from outside; docs/optimizer.md states that contract.

Note: [Whole-slice update]
    Stepping a slice in cache-sized chunks and casting each chunk's shadow right after its update
    would read the masters once instead of twice, but a failure in a later chunk would leave the
    earlier ones updated. Measured when the update was chunked (the chunk sweeps in
    ``benchmarks/results/optimizer_cpu_2026-11-22.json`` and ``optimizer_chunks_cpu_2026-11-22.json``,
    docs/optimizer.md), the per-chunk optimizer calls cost more than the cache hits saved, at every chunk size
    tried: the whole slice, then its shadow, is both the simpler guarantee and the faster update.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..kernels import OnePassUpdate, host_kernel
from ..kernels.scaling import OwedScaling
from ..streams.host_storage import SliceStorage, shadow_views


class HeldState:
    """Where an OffloadOptimizer's ``state`` dict is held: a box that the optimizer and what runs its
    updates share. See Note: [What an update holds].

    Note: [What an update holds]
        The updates of a step read and write the optimizer's ``state`` on a host worker, through
        each inner optimizer's :class:`StateByProxy` and the disk tier (which knows the optimizer
        as a ``TierOwner``, ``offload/optimizing/tier_plumbing.py``). They hold this box, never the
        optimizer, for two reasons (``tests/test_freed_when_dropped.py``):

        1. The optimizer holds its inner optimizers (its plan): one holding it back would make a
           reference cycle, and a dropped optimizer (its model, their host copies, pinned
           buffers, device slots and a disk tier's files with it) would wait for Python's cycle
           collector instead of going at ``del``.
        2. An update still pending when the optimizer is dropped (``step()``, then ``del
           optimizer``) runs to its end: the next forward waits for it. The box, held by the
           work queued, keeps the state it reads alive until then (and the disk tier, its files
           and their writes: they go after the last of them). The optimizer itself goes at once,
           in the caller's thread, with its finalizer, which closes the update worker: run by the
           worker's last task instead, it would close the worker from its own thread. What goes
           after a task on a worker only asks workers to end (``HostWorker.close``), never waits.

        ``load_state_dict()`` replaces the dict the box holds, never the box: the inner optimizers
        built before read the loaded state.
    """

    __slots__ = ("state",)

    def __init__(self, state: Any) -> None:
        self.state = state


def unwrapped_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """``optimizer``, or the optimizer that a training framework's wrapper of it stands for: the one
    that holds the state in its ``__dict__``.

    Lightning wraps an optimizer in an object that keeps it as ``_optimizer`` and whose class is
    made a subclass of the optimizer's class, so that ``isinstance`` holds: the class's methods and
    properties (an OffloadOptimizer's ``state``) then run with the wrapper as ``self``. The
    Trainer's ``LightningOptimizer`` copies the optimizer's ``__dict__``, but Fabric's
    ``_FabricOptimizer`` does not (it forwards missing attributes through ``__getattr__``, which
    ``__dict__`` bypasses), so code that reads ``__dict__`` follows the wrapper here, recognised by
    that shape, so that ``import offload`` needs no Lightning.
    """
    while isinstance(inner := vars(optimizer).get("_optimizer"), torch.optim.Optimizer) and (
            isinstance(optimizer, type(inner)) and optimizer is not inner):
        optimizer = inner
    return optimizer


def hold_state(optimizer: torch.optim.Optimizer, state: Any) -> None:
    """Make ``state`` what ``optimizer``'s box holds (Note: [What an update holds]), made at the first."""
    optimizer = unwrapped_optimizer(optimizer)
    box = optimizer.__dict__.get("_held_state")
    if box is None:
        optimizer.__dict__["_held_state"] = HeldState(state)
    else:
        box.state = state


def setstate_through_property(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """An OffloadOptimizer's ``__setstate__`` (its ``load_state_dict()`` calls it): ``torch.optim``'s,
    but for ``state``, which that would put into ``__dict__``, under the optimizer's ``state``
    property; set through the property instead, after the pending updates, into the box."""
    torch.optim.Optimizer.__setstate__(optimizer, {key: value for key, value in state.items() if key != "state"})
    if "state" in state:
        optimizer.state = state["state"]


def state_box(optimizer: torch.optim.Optimizer) -> HeldState:
    """The box that holds ``optimizer``'s ``state``, for what runs its updates to hold instead of it."""
    return unwrapped_optimizer(optimizer).__dict__["_held_state"]


def held_state(optimizer: torch.optim.Optimizer) -> Any:
    """``optimizer.state`` as it is held now, without waiting for pending updates: for the host
    worker that runs those updates and for the code that waits for them. An OffloadOptimizer's
    ``state`` waits for them first (Note: [Overlapped host update] in ``offload/optimizer.py``),
    which on the worker would wait for itself."""
    return state_box(optimizer).state


class StateByProxy(MutableMapping[torch.Tensor, dict[str, Any]]):
    """An inner optimizer's ``state``: what it keeps for a proxy is kept for the user's parameter,
    in the outer optimizer's own ``state`` (which ``load_state_dict`` may replace), read through
    the box that holds it (Note: [What an update holds]): it runs on the host worker."""

    def __init__(self, held: HeldState, owner: dict[torch.Tensor, torch.Tensor]) -> None:
        self.held = held
        self.owner = owner  # proxy -> the user's parameter

    def __getitem__(self, proxy: torch.Tensor) -> dict[str, Any]:
        return self.held.state[self.owner[proxy]]  # a defaultdict: made on first use, as in torch.optim

    def __setitem__(self, proxy: torch.Tensor, value: dict[str, Any]) -> None:
        self.held.state[self.owner[proxy]] = value

    def __delitem__(self, proxy: torch.Tensor) -> None:
        del self.held.state[self.owner[proxy]]

    def __contains__(self, proxy: object) -> bool:
        return proxy in self.owner and self.owner[proxy] in self.held.state  # type: ignore[index]

    def __iter__(self) -> Iterator[torch.Tensor]:
        state = self.held.state
        return (proxy for proxy, param in self.owner.items() if param in state)

    def __len__(self) -> int:
        return sum(1 for _ in self)


@dataclass
class InnerOptimizer:
    """Parameters stepped together (a slice's, or those outside the model), by one inner
    optimizer over their proxies."""

    optimizer: torch.optim.Optimizer
    proxies: list[nn.Parameter]
    params: list[torch.Tensor]
    group_of: list[int]  # per inner group: the index of the user's group it comes from

    def step(self, grads: Sequence[torch.Tensor | None], hyper: Sequence[dict[str, Any]],
             grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None) -> None:
        if all(g is None for g in grads):
            return
        for proxy, grad in zip(self.proxies, grads):
            proxy.grad = grad
        for group, source in zip(self.optimizer.param_groups, self.group_of):
            group.update(hyper[source])
        self.optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
        self.optimizer.found_inf = found_inf  # type: ignore[attr-defined]
        try:
            step_unhooked(self.optimizer)
        finally:
            for proxy in self.proxies:
                proxy.grad = None
        _check_groups_kept(self.optimizer, self.group_of, hyper)


def step_unhooked(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.step()`` without the step hooks PyTorch wraps around every optimizer's ``step``.

    The slice's optimizer is the library's own, one of several behind the user's
    ``OffloadOptimizer``, whose ``step()`` runs the hooks registered with
    ``register_optimizer_step_pre_hook`` / ``_post_hook`` once, as the plain optimizer's does;
    through each slice's they would run again per slice, some on an update worker's thread. A
    subclass whose ``step`` calls ``super().step()`` still reaches its parent's wrapper, and with
    it the hooks, once per slice: only the outermost wrapper is left out. A rehearsal of the step
    (Note: [A step refused as a whole] in ``offload/optimizing/whole_step.py``) steps so too.
    """
    step = type(optimizer).step
    raw = getattr(step, "__wrapped__", None) if getattr(step, "hooked", False) else None
    if raw is None:  # not wrapped (a PyTorch that no longer does): nothing to leave out
        optimizer.step()
    else:
        raw(optimizer)


def _check_groups_kept(optimizer: torch.optim.Optimizer, group_of: Sequence[int],
                       hyper: Sequence[dict[str, Any]]) -> None:
    """Raise if the step wrote into its groups (Note: [State kept per group]).

    Each key is compared by identity first: ``group.update`` put the very objects of ``hyper``
    there, so a class that leaves its groups alone (every ``torch.optim`` one) costs a dozen
    ``is`` per group and slice, nothing beside the update. Only a key that is another object is
    compared by value, so that a class writing back what it read (``group["lr"] = float(lr)``)
    passes.

    Raises:
        GroupStateError: a key was added, or one changed its value.
    """
    for group, source in zip(optimizer.param_groups, group_of):
        given = hyper[source]
        if len(group) == len(given) + 1 and all(group[k] is v for k, v in given.items()):
            continue
        added = sorted(k for k in group if k != "params" and k not in given)
        changed = sorted(k for k, v in given.items() if k in group and not same_value(group[k], v))
        if added or changed:
            raise GroupStateError(
                f"{type(optimizer).__name__} keeps state in its parameter groups: its step() "
                + (f"added {added}" if added else "") + (" and " if added and changed else "")
                + (f"changed {changed}" if changed else "") + " in a group. OffloadOptimizer steps each slice's "
                "parameters with an optimizer of their own, through a copy of your group's hyperparameters, so what "
                "the class counts or adapts per group (a step count, Lookahead's counters, Prodigy's or "
                "D-Adaptation's d) would be kept per slice, and neither param_groups nor state_dict() would hold it. "
                "Use the class directly on model.parameters() (the OffloadModel stays as it is), or an optimizer that "
                "keeps its state per parameter, as every torch.optim class does (docs/optimizer.md, 'Which "
                "optimizer classes').")


def same_value(a: Any, b: Any) -> bool:
    """Whether a group's value ``a`` equals ``b`` and is of its type (``param_groups`` would show
    ``0.0`` for ``0``), tensors of the same dtype, shape and elements."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and bool(torch.equal(a, b)))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # a value whose == does not say (an array): another object is a change
        return False


class GroupStateError(TypeError):
    """The optimizer class wrote into its parameter groups during ``step()``: it keeps state per
    group, which a slice-by-slice update cannot reproduce (Note: [State kept per group]). The
    update's :class:`HostUpdateError` is raised from it."""


class HostUpdateError(RuntimeError):
    """The optimizer raised while a host worker updated a slice (raised at the next call that
    waits for the update: a forward, ``step()``, ``synchronize()``...)."""


#: The most characters of an error's own message that a HostUpdateError repeats.
SAID_AT_MOST = 300


def said(error: BaseException) -> str:
    """What ``error`` says, for the message of the :class:`HostUpdateError` raised from it: its type
    and the first line of its message, cut at :data:`SAID_AT_MOST` characters (the whole of it is
    the error's ``__cause__``), so that the reason shows where the error is printed."""
    lines = str(error).strip().splitlines()
    text = lines[0] if lines else ""
    if len(text) > SAID_AT_MOST or len(lines) > 1:
        text = text[:SAID_AT_MOST].rstrip() + " ..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def other_slices(index: int) -> str:
    """What the error of slice ``index``'s failed update says of the step's other slices.

    Which of their updates ran before it depends on the schedule, not on the slice's index: the
    worker runs what it holds lowest slice first among the ready (Note: [Updates in the next
    forward's order] in ``offload/optimizing/stepping.py``), ``step()`` hands the updates over in
    slice order, backward (``update_in_backward``) as the gradients land, last slice first. The
    worker skips what it had not started; the record of Note: [An update that failed part way]
    (``offload/optimizing/partial_failure.py``) knows which ran, and its refusal names them.
    """
    return (f"Of the step's other updates, those that ran before it are kept and the others skipped: step() runs "
            f"them in slice order, so the slices before {index} are updated and the slices after it were left as "
            "they were, but update_in_backward runs them as their gradients land, last slice first. Until a load, "
            "state_dict() and save_checkpoint refuse any mix of two steps this leaves, naming the slices updated.")


@dataclass
class SliceStep:
    """Everything needed to step one slice's parameters.

    Attributes:
        whole: one inner optimizer over all of the slice's parameters (see Note: [Whole-slice
            update]).
    """

    index: int
    storage: SliceStorage | None  # None: parameters outside the model (index -1), stepped before the slices
    whole: InnerOptimizer | None  # None: this rank owns none of the slice's parameters (sharded update)
    writes_shadow: bool = True  # sharded, the shadow is written after the other ranks' parts arrive

    def needs_bind(self) -> bool:
        """Whether a parameter's memory moved since the proxies were pointed at it."""
        if self.whole is None:
            return False
        return any(proxy.data_ptr() != param.data_ptr() or proxy.shape != param.shape or proxy.dtype != param.dtype
                   for proxy, param in zip(self.whole.proxies, self.whole.params))

    def bind(self) -> None:
        """Point the proxies at the parameters' current memory (it moves when a slice is laid out
        again); called in the caller's thread before the work is submitted."""
        if self.whole is None:
            return
        for proxy, param in zip(self.whole.proxies, self.whole.params):
            proxy.data = param.data

    def run(self, grads: Sequence[torch.Tensor | None], hyper: Sequence[dict[str, Any]],
            grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None,
            scaling: OwedScaling | None = None) -> None:
        """Step the slice with the gradients (aligned with ``whole.params``) and hyperparameters
        captured by ``step()``, then write its shadow, if it has one, from the fresh masters.
        ``scaling``: a clip's product owed on its gradients, done in the same pass where the
        one-pass kernel reads them, else first (Note: [Scaling in the update]).

        One optimizer call steps the whole slice, and the shadow is written only after it
        returned: an optimizer that raises before changing anything leaves the slice, and its
        shadow, as they were (see Note: [Whole-slice update]).

        Raises:
            HostUpdateError: the optimizer raised.
        """
        shadow = self.writes_shadow and self.storage is not None and self.storage.shadow is not None
        assert self.whole is not None
        try:
            written = self._step(grads, hyper, grad_scale, found_inf, shadow, scaling)
            if shadow:
                assert self.storage is not None
                self.storage.write_shadow(written)
        except Exception as error:
            raise HostUpdateError(self._failure(error)) from error
        if shadow:
            assert self.storage is not None
            self.storage.shadow_written()

    def _failure(self, error: Exception) -> str:
        """What the :class:`HostUpdateError` of this slice's failed update says."""
        where = "on the device" if self.storage is not None and self.storage.resident else "on the host"
        if self.index < 0:  # parameters outside the model: the step's first update (Note: [Parameters
            # outside the model] in offload/optimizing/stepping.py)
            return (f"the optimizer raised while updating the parameters outside the model (those the optimizer "
                    f"holds that no slice does) {where} ({said(error)}): they are unchanged if it raised before "
                    "changing them, and may be partly updated otherwise. Their update runs first, so the slices' "
                    "updates of this step were skipped. Reload a checkpoint before training on.")
        if isinstance(error, GroupStateError):  # seen once the step returned: the slice is updated
            return (f"{error} Slice {self.index} was updated {where} before this showed. {other_slices(self.index)} "
                    "Reload a checkpoint before training on.")
        return (f"the optimizer raised while updating slice {self.index} of the model {where} ({said(error)}): slice "
                f"{self.index} is unchanged if the optimizer raised before changing it (checking its arguments, "
                f"allocating its state) and may be partly updated otherwise. {other_slices(self.index)} Reload a "
                "checkpoint before training on.")

    def _step(self, grads: Sequence[torch.Tensor | None], hyper: Sequence[dict[str, Any]],
              grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None, shadow: bool,
              scaling: OwedScaling | None) -> Collection[int]:
        """One optimizer call over the whole slice; with a shadow, its fused Adam/AdamW/SGD kernel writes
        the shadow as it goes where it can (Note: [One-pass update] in ``offload/kernels/one_pass.py``),
        and multiplies the gradients by a clip's owed coefficient as it reads them.
        Returns the addresses of the host copies whose shadow is written."""
        assert self.whole is not None
        # Without a shadow the kernel still pays where it multiplies a clip's owed gradients as it reads them.
        # It serves PyTorch's fused Adam, AdamW and SGD kernels alone: around any other step the mode would
        # only cost (a clip owed is then scaled first, with no watch over the step's many calls), and a
        # compiled step (torchao's AdamW8bit, fullgraph) refuses to run under a dispatch mode at all.
        wanted = (shadow or scaling is not None) and _served(self.whole.optimizer)
        kernel = host_kernel() if wanted else None
        if kernel is None:
            if scaling is not None:
                scaling.apply_rest()
            self.whole.step(grads, hyper, grad_scale, found_inf)
            return ()
        assert self.storage is not None
        one_pass = OnePassUpdate(kernel, shadow_views(self.storage) if shadow else {}, scaling)
        with one_pass:
            self.whole.step(grads, hyper, grad_scale, found_inf)
        if scaling is not None:
            scaling.apply_rest()  # gradients the step did not read (a captured list that changed since the clip)
        return one_pass.written


def _served(optimizer: torch.optim.Optimizer) -> bool:
    """Whether :class:`OnePassUpdate` can serve ``optimizer``'s step: PyTorch's Adam, AdamW or SGD
    (or a subclass), every group ``fused``."""
    return (isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD))
            and all(g.get("fused") for g in optimizer.param_groups))
