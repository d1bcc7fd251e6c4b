"""``OffloadOptimizer``: any ``torch.optim`` optimizer, stepping an OffloadModel's host copies slice
by slice on a host worker, overlapped with the device's next forward. This file holds the
optimizer users call; what it hands off (its plan, the hand-off of each update, the sharded
exchange, the disk tier's plumbing) lives in ``offload/optimizing/``.

Note: [Overlapped host update]
    ``step()`` captures each parameter's gradient and each group's hyperparameters, then hands
    one task per slice, in slice order, to a host worker (``offload/streams/workers.py``) and
    returns; the worker runs what it holds in the order the next forward loads it (Note: [Updates
    in the next forward's order] in ``offload/optimizing/stepping.py``). The next forward loads slice ``k`` only once slice ``k``'s update is done (the device
    slots wait for it, ``offload/streams/updates.py``), so while the device computes slice ``k``,
    the host updates slice ``k + 1``: what is left on the critical path is about one slice's
    update. No update starts while a load still reads the host copies (``step()`` waits for the
    loads first).

    The results are the plain optimizer's, bit for bit: the same class steps the same values
    with the same hyperparameters, and ``torch.optim`` updates treat every parameter on its own,
    so stepping a slice at a time changes nothing (see ``offload/tiers/slice_update.py``). Gradients and
    hyperparameters are captured when ``step()`` is called, so ``zero_grad()``, a learning-rate
    scheduler or a ``GradScaler.update()`` right after it cannot change the update.

    What reads the parameters through the model (``parameters()``, ``named_parameters()``,
    ``modules()``, ``children()``, ``state_dict()``, ``load_state_dict()``, ``zero_grad()``,
    submodules by attribute, pickling) or through this optimizer (``state``, ``state_dict()``,
    ``synchronize()``) first waits for every pending update. The one thing that does not: a
    reference to a parameter (or to the model's submodule) taken before ``step()``; call
    ``synchronize()`` before reading through it.
"""

from __future__ import annotations

import functools
import os
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator
from typing import Any

import torch
from torch.optim.optimizer import _global_optimizer_post_hooks  # mutated in place, never rebound

from .autograd.accumulation import mark_zeroed
from .streams.gradient_files import zeroed_in_files
from .model import OffloadModel, engine_of
from .modeling.compiled import EagerUnderDynamo
from .optimizing.arguments import check_arguments
from .optimizing.backward_norms import BackwardNorms
from .optimizing.copying import HALF_A_STEP, CopiedByStateDict, check_step_finished
from .optimizing.deferred_scaling import DeferredScaling
from .optimizing.eager_step import EAGER_STEP_REASON, waiting
from .optimizing.in_backward import BackwardUpdates, check_failed_backward, check_in_backward, check_zero_grad
from .optimizing.plan import as_class_adds, inner_optimizer, plan_key, slice_steps, snapshot
from .optimizing.random_draws import RandomDraws
from .optimizing.sharding import Sharding
from .optimizing.stepping import SliceUpdates
from .optimizing.following import follow, tied_to_engine
from .optimizing.tier_plumbing import SliceState, TierPlumbing
from .streams.collectives import HostCollectives
from .tiers.disk_tier import DiskTier, DiskTierError, StateTier
from .tiers.slice_update import SliceStep, held_state, hold_state, setstate_through_property, unwrapped_optimizer
from .walk.steps import count_step


#: The OffloadOptimizer built last for each model: only it may step the model (an older one, still
#: alive, refuses), so a rebuilt optimizer replaces the old one and two never step one model.
_newest: weakref.WeakKeyDictionary[OffloadModel, weakref.ref[OffloadOptimizer]] = weakref.WeakKeyDictionary()


class OffloadOptimizer(CopiedByStateDict, torch.optim.Optimizer):
    """Wrap a ``torch.optim`` optimizer class so it steps an :class:`~offload.OffloadModel`'s host
    copies on a host worker, overlapped with the next forward. See Note: [Overlapped host update].

    It *is* a ``torch.optim.Optimizer``: learning-rate schedulers and ``torch.amp.GradScaler``
    accept it, its ``param_groups`` are the groups you passed, and its ``state_dict()`` loads into
    ``optimizer_class`` and back (sharded over several ranks: :meth:`consolidated_state_dict`).

    Args:
        model: the :class:`~offload.OffloadModel` it steps, or an ``OffloadedCausalLM`` (it steps ``model.offloaded``).
        optimizer_class: a ``torch.optim.Optimizer`` subclass (``torch.optim.AdamW``, ...).
        params: parameters or parameter groups, as ``optimizer_class`` takes them; default
            ``model.parameters()``. Parameters outside ``model`` are stepped in ``step()`` itself.
        num_threads: CPU threads for the update (``torch.set_num_threads`` in the worker); default:
            PyTorch's setting. On a machine with few cores, leave some to the input pipeline.
        disk_tier: keep the per-element state of the model's slices (AdamW's moments) in files on a
            local disk instead of RAM: a :class:`~offload.DiskTier`, or a directory path for its
            defaults. The files are removed by :meth:`close` (or leaving ``with optimizer:``), or
            once the optimizer is dropped. See ``docs/disk-tier.md``.
        update_in_backward: start each slice's update in backward, once its gradients are on the
            host (Note: [Update in backward]; ``docs/optimizer.md``); exact, and nothing may change
            the gradients before ``step()`` (no clipping, no ``GradScaler``).
        accumulation_steps: with ``update_in_backward`` or ``norms_in_backward``, backwards per ``step()``.
        norms_in_backward: compute the host gradients' 2-norms in backward, for :func:`offload.clip_grad_norm_`
            to take (Note: [Norms from backward]; ``docs/optimizer.md``; not with ``update_in_backward``).
        scale_in_update: :func:`offload.clip_grad_norm_` leaves its scaling of each streamed slice's
            host gradients to the slice's update, which multiplies them as it reads them (Note:
            [Scaling in the update]).
        **optimizer_kwargs: keyword arguments of ``optimizer_class`` (``lr=1e-4, fused=True``).

    Raises:
        TypeError: ``model`` is no OffloadModel or OffloadedCausalLM, or ``optimizer_class`` no optimizer class.
        ValueError: an optimizer that needs a closure (``LBFGS``), or a bad ``num_threads``.
        DiskTierError: the disk tier could not write state (raised by ``step()``,
            ``synchronize()`` and ``state_dict()``; the message says which slices are updated).

    If the optimizer raises while it updates a slice, the error (a :class:`HostUpdateError`)
    surfaces at the next call that waits for updates; the updates that ran before it are kept (from
    ``step()``, the slices before it), the others skipped, and that slice is unchanged when the
    optimizer raised before changing it (argument checks, setting up its state), as ``torch.optim``'s do.

    Example::

        >>> model = OffloadModel(layers, device="cuda", num_slices=8)
        >>> optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-4, fused=True)
        >>> for x, y in loader:
        ...     loss_fn(model(x), y).backward()
        ...     optimizer.step()          # returns at once; the update runs beside the next forward
        ...     optimizer.zero_grad()
    """

    def __init__(self, model: OffloadModel | torch.nn.Module, optimizer_class: type[torch.optim.Optimizer],
                 params: Iterable[Any] | None = None, *, num_threads: int | None = None,
                 shard: bool | None = None, process_group: Any = None,
                 disk_tier: DiskTier | str | os.PathLike[str] | None = None, update_in_backward: bool = False,
                 accumulation_steps: int = 1, norms_in_backward: bool = False, scale_in_update: bool = False,
                 **optimizer_kwargs: Any) -> None:
        model = check_arguments(model, optimizer_class, num_threads, disk_tier, params)
        check_in_backward(model, engine_of(model), update_in_backward, accumulation_steps, shard, norms_in_backward,
                          scale_in_update)
        # The class checks its own arguments and fills in its defaults.
        template = optimizer_class(model.parameters() if params is None else params, **optimizer_kwargs)
        super().__init__(template.param_groups, template.defaults)
        self.state.update(template.state)  # optimizers that set up state eagerly (Adagrad)
        # Fused implementations take GradScaler's scale and inf flag themselves: so do we.
        self._step_supports_amp_scaling = getattr(template, "_step_supports_amp_scaling", False)
        self.model = model
        self.optimizer_class = optimizer_class
        self.optimizer_kwargs = optimizer_kwargs
        self.num_threads = num_threads
        self._plan_key: tuple[Any, ...] | None = None
        self._steps: list[SliceStep] = []
        self._rest: list[SliceStep] = []
        self._offload_outer = True  # the per-tensor warning names optimizer_class (per_tensor_warning.py)
        # - Collaborators (offload/optimizing/): the exchange across ranks of a sharded update (None:
        #   every rank updates everything), the disk tier's plumbing (a no-op without one), the
        #   hand-off of each slice's update to the host worker, and what backward starts early.
        self._sharding = Sharding.of(model, shard, process_group)
        collectives = self._collectives
        _newest[model] = weakref.ref(self)
        self._disk = TierPlumbing.of(disk_tier, self, engine_of(model), collectives.rank if collectives else None,
                                     collectives.world_size if collectives else 1, optimizer_class)
        self._updates = SliceUpdates(engine_of(model), self._disk, self._sharding, num_threads)
        engine_of(model).optimizers.add(self)  # its state counts in model.memory_footprint()
        self._in_backward = BackwardUpdates.attach(self, engine_of(model), accumulation_steps, self._updates,
                                                   _before_update, update_in_backward)
        self._norms = BackwardNorms.attach(self, engine_of(model), accumulation_steps, norms_in_backward)
        self._scaling = DeferredScaling.attach(self, _scaled_in_update, scale_in_update)
        self._draws = RandomDraws(optimizer_class)  # Note: [An optimizer that draws random numbers]
        _STEP.prepare()  # outside any tracing (Note: [A compiled step])
        #: step() ran on the model's engine: a move to the host is a teardown then (rule 3 of Note:
        #: [Moving an OffloadModel] in offload/modeling/placement.py)
        self._stepped_engine = False

    # -- the state --------------------------------------------------------------------------------

    @property  # type: ignore[override]
    def state(self) -> Any:
        """The per-parameter state, as ``torch.optim``'s, after the pending updates: the worker
        creates and rewrites it while a slice is updated. Code that walks it between steps
        (Lightning moves every state tensor at teardown) sees a finished update, not a dict that
        changes size while it iterates.

        It waits as ``zero_grad(set_to_none=False)`` does: the updates stay pending for the next
        forward, so the shadows they wrote are kept (no cast again).

        Raises:
            HostUpdateError: an update raised.
        """
        _finish_updates(self)
        return held_state(self)

    @state.setter
    def state(self, value: Any) -> None:
        # After the pending updates, as the getter: one still running would write into the new dict.
        _finish_updates(self)
        hold_state(self, value)  # in the box that the updates hold (Note: [What an update holds])

    __setstate__ = setstate_through_property

    # -- stepping --------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Start each slice's update, in slice order, on the host worker (resident slices': here, on the device).

        The next forward waits for each slice's update just before loading it. Parameters without a
        gradient (all of them before the first backward) are left as they are, as ``torch.optim``
        leaves them. Under ``torch.compile`` it runs eagerly (Note: [A compiled step] in
        ``offload/optimizing/eager_step.py``).

        Raises:
            RuntimeError: a newer OffloadOptimizer was built for the same model.
        """
        return _STEP(self, closure)

    def consolidated_state_dict(self, to: int = 0) -> dict[str, Any] | None:
        """The whole optimizer state, gathered from the ranks that own its parts, on rank ``to``
        (of the process group); ``None`` on the others. Call it on every rank, then save it on rank
        ``to``. Without sharding it is ``state_dict()`` on every rank. The result loads into
        ``optimizer_class`` and into an OffloadOptimizer, sharded or not.
        """
        local = local_state_dict(unwrapped_optimizer(self))  # its plan and hooks, not a wrapper's copies
        return local if self._sharding is None else self._sharding.gather_state(local, to)

    def state_by_slice(self) -> Iterator[tuple[int, dict[torch.Tensor, dict[str, Any]]]]:
        """The optimizer state this rank keeps, one slice at a time, after every pending update.

        Yields ``(slice index, {parameter: its state})`` in slice order, then ``(-1, ...)`` for
        parameters outside the model; each parameter's state is the plain optimizer's (a dict of
        tensors and numbers; empty before its first update). Sharded, only the parameters this
        rank updates appear. Checkpoints read the state through this (Note: [Checkpoint layout] in
        ``offload/checkpoint/contents.py``): a store that keeps state away from host memory hands
        over one slice's state at a time here, never the whole of it.
        """
        check_whole(self, "Reading the state")
        # With a disk tier, the slice's tensors come from its file: copies, one slice at a time.
        for index, states, _ in _states_by_slice(unwrapped_optimizer(self), self._disk.slice_state):
            yield index, states

    def synchronize(self) -> None:
        """Block until every pending update is done; raise what an update raised (and what the
        disk tier could not write)."""
        engine = engine_of(self.model)
        engine.updates.wait_all()
        if engine.master_files is not None:
            engine.master_files.flush(self._updates.failure.unwritten)  # latched: partial_failure.py, rule 7
        self._disk.flush(_waiting(self))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients, as ``torch.optim.Optimizer.zero_grad`` does.

        With ``set_to_none=True`` (the default) it returns at once: pending updates keep the
        gradients they captured. With ``False`` it zeroes them in place, after the updates that
        read them (which keep the shadows they wrote: the next forward does not cast them again,
        nor read masters on disk in for that).
        """
        check_zero_grad(self._in_backward)  # a step skipped after backward started its updates
        if set_to_none:
            super().zero_grad(set_to_none=True)
            return
        engine = engine_of(self.model)
        engine.updates.finish_all()
        params = [p for group in self.param_groups for p in group["params"]]
        with zeroed_in_files([s.storage for s in engine.slices], params):  # Note: [Gradients on disk]
            super().zero_grad(set_to_none=False)
        mark_zeroed(params)

    def state_dict(self) -> dict[str, Any]:
        """``torch.optim.Optimizer.state_dict()``, after the pending updates (a disk tier's state read in one
        slice at a time). Sharded, each rank holds only its share: a ``RuntimeError`` says to call
        :meth:`consolidated_state_dict` instead (Note: [A sharded state_dict()]); between a backward that started
        updates and ``step()``, one says to call ``step()`` first (Note: [Copying an OffloadOptimizer], rule 5)."""
        if self._sharding is not None:
            self._sharding.refuse_partial("state_dict()")
        check_step_finished(self, "call state_dict()", HALF_A_STEP)
        return local_state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """``optimizer_class``'s ``load_state_dict()``, after the pending updates (a disk tier's: slice by slice)."""
        self.synchronize()
        _load_as_class(self, state_dict)
        self._disk.forget()
        self._plan_key = None  # a sharded optimizer keeps only its own parameters' state
        if self._sharding is not None or self._tier is not None:
            _plan(self)
        self._disk.adopt()

    def close(self) -> None:
        """Wait for the pending updates and remove the disk tier's files (kept with
        ``DiskTier(keep=True)``); the optimizer cannot step afterwards if it has a disk tier.
        Save ``state_dict()`` first to keep the state. Leaving ``with optimizer:`` calls it."""
        try:
            engine_of(self.model).updates.wait_all()
        finally:
            self._disk.close(_param_indices(self))

    def __enter__(self) -> OffloadOptimizer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_steps", None):
            self.synchronize()
        super().add_param_group(as_class_adds(self, param_group))  # the class's own normalisation (lr as a tensor)

    # -- following the model to another compute device (offload/optimizing/following.py) ---------------

    _tied_to_engine = tied_to_engine
    _follow = follow

    # -- the collaborators, as tests, scripts and checkpoints name them ---------------------------------

    @property
    def _collectives(self) -> HostCollectives | None:
        """The host collectives of a sharded update; ``None`` when every rank updates everything."""
        return None if unwrapped_optimizer(self).__dict__.get("_sharding") is None else self._sharding.collectives

    @property
    def _tier(self) -> StateTier | None:
        """The disk tier, or ``None``."""
        return None if unwrapped_optimizer(self).__dict__.get("_disk") is None else self._disk.tier


# -- the optimizer's state, as checkpoints read and load it -------------------------------------------


def local_state_dict(optimizer: OffloadOptimizer) -> dict[str, Any]:
    """``torch.optim.Optimizer.state_dict()`` of the state this rank keeps, after the pending
    updates, with a disk tier's state read in one slice at a time: sharded, only this rank's share
    (which :meth:`OffloadOptimizer.state_dict` refuses to hand out: Note: [A sharded state_dict()]
    in ``offload/optimizing/sharding.py``). Not public: for the gather of
    :meth:`OffloadOptimizer.consolidated_state_dict`, and for tests that read one rank's share."""
    check_whole(optimizer, "state_dict()")
    optimizer.synchronize()
    # Post-hooks after the tier's tensors are in (one casting the moments sees them); pre-hooks still first.
    hooks, optimizer._optimizer_state_dict_post_hooks = optimizer._optimizer_state_dict_post_hooks, {}
    try:
        packed = torch.optim.Optimizer.state_dict(optimizer)
    finally:
        optimizer._optimizer_state_dict_post_hooks = hooks
    optimizer._disk.add_to_state_dict(packed, _param_indices(optimizer))
    for hook in hooks.values():  # as torch.optim runs them: a result other than None replaces the dict
        packed = packed if (result := hook(optimizer, packed)) is None else result
    return packed


def state_layout_by_slice(optimizer: OffloadOptimizer) -> Iterator[tuple[int, SliceState, SliceState]]:
    """As :meth:`OffloadOptimizer.state_by_slice`, without reading the disk tier: yields ``(slice
    index, {parameter: its state}, {parameter: its state on disk})`` where each tensor the tier keeps
    is a stand-in of its shape and dtype (:meth:`StateTier.slice_layout`), to be read with
    ``_disk.slice_state`` when needed (Note: [Checkpoint layout] in ``offload/checkpoint/contents.py``)."""
    return _states_by_slice(optimizer, optimizer._disk.slice_layout)


def _states_by_slice(optimizer: OffloadOptimizer, on_disk: Callable[[int], SliceState]
                     ) -> Iterator[tuple[int, SliceState, SliceState]]:
    """Per slice with parameters this rank steps, after every pending update: its index, each
    parameter's state (with what ``on_disk`` gives for it), and what ``on_disk`` gave."""
    optimizer.synchronize()
    _plan(optimizer)
    for step in (*optimizer._steps, *optimizer._rest):
        if step.whole is not None:
            disk = on_disk(step.index)
            yield step.index, {p: {**optimizer.state.get(p, {}), **disk.get(p, {})} for p in step.whole.params}, disk


def load_beside_tier(optimizer: OffloadOptimizer, state_dict: dict[str, Any], loaded: Collection[int]) -> None:
    """``load_state_dict()`` of a checkpoint's state less the tensors already loaded into the
    disk tier's files, slice by slice (slices ``loaded``; Note: [Slice-by-slice load] in
    ``offload/checkpoint/slice_load_planner.py``): the scalars (``step``) and the groups go through
    ``torch.optim``'s ``load_state_dict()`` as with any load; the tier's other slices hold what
    it puts into ``optimizer.state``.

    Raises:
        DiskTierError: a slice's state could not be written; it is held in RAM, and the state
            is loaded.
    """
    assert optimizer._tier is not None
    # Not synchronize(): a write that failed while loading is raised as a load's, by adopt().
    engine_of(optimizer.model).updates.wait_all()
    _load_as_class(optimizer, state_dict)
    optimizer._disk.forget(keep=loaded)
    optimizer._disk.adopt()


def _finish_updates(optimizer: OffloadOptimizer) -> None:
    """Wait for the pending updates, leaving them pending for the next forward (the shadows they
    wrote are kept), as ``zero_grad(set_to_none=False)`` does."""
    model = unwrapped_optimizer(optimizer).__dict__.get("model")  # None while torch.optim's __init__ sets the state
    if model is not None and engine_of(model).updates.pending():
        engine_of(model).updates.finish_all()


def _load_as_class(optimizer: OffloadOptimizer, state_dict: dict[str, Any]) -> None:
    """``optimizer_class``'s ``load_state_dict()``, on an instance of the class over the same
    parameters, so that every rule of the class holds here:

    - its ``__setstate__``: a ``torch.optim`` class fills the group keys an older checkpoint lacks
      with their defaults (Adam's ``maximize=False``, not this optimizer's setting) and turns a
      ``step`` saved as a number (PyTorch before 1.12) into a tensor, which its update needs;
    - ``torch.optim`` casts every saved state tensor to its parameter's dtype; a class that keeps
      state of other dtypes loads it with rules of its own: bitsandbytes' 8-bit optimizers keep
      their codes as uint8 and their quantization maps and block scales in float32 (cast to the
      parameter's float dtype, the next update would read the codes as 32-bit moments), and
      unwrap the quantization state their ``state_dict()`` nests under a key of its own.

    The optimizer's load hooks run around it as ``torch.optim``'s would run them.

    The state loaded replaces what the updates of a backward that raised wrote
    (:meth:`~offload.optimizing.in_backward.BackwardUpdates.state_loaded`).
    """
    _load_through_class(optimizer, state_dict)
    if optimizer._in_backward is not None:
        optimizer._in_backward.state_loaded()
    optimizer._updates.failure.forget()  # Note: [An update that failed part way], rule 4


def _load_through_class(optimizer: OffloadOptimizer, state_dict: dict[str, Any]) -> None:
    """``optimizer_class``'s own ``load_state_dict()``, on an instance over the same parameters."""
    # As torch.optim: the hooks get a shallow copy (one that pops its key leaves the caller's dict
    # whole, for a second load), and a hook's result replaces it unless it is None (an empty dict counts).
    state_dict = state_dict.copy()
    for pre_hook in optimizer._optimizer_load_state_dict_pre_hooks.values():
        hook_result = pre_hook(optimizer, state_dict)
        if hook_result is not None:
            state_dict = hook_result
    loader = optimizer.optimizer_class([dict(group) for group in optimizer.param_groups], **optimizer.optimizer_kwargs)
    loader.load_state_dict(state_dict)
    # Keyed by the optimizer's parameters (the loader's), its groups the saved hyperparameters.
    optimizer.__setstate__({"state": loader.__dict__["state"], "param_groups": loader.param_groups})
    for post_hook in optimizer._optimizer_load_state_dict_post_hooks.values():
        post_hook(optimizer)


def _on_host(scaling: tuple[torch.Tensor | None, ...]) -> Iterator[torch.Tensor | None]:
    """GradScaler's scale and inf flag, on the loss's device, copied to the host and waited for (the update
    reads them on a host worker: a non-blocking copy would land behind the next forward's kernels). A number,
    ``sum([])`` when no gradient was checked, becomes a float32 tensor: unread, as by torch's fused step."""
    return (t if t is None else t.to("cpu") if torch.is_tensor(t) else torch.as_tensor(t, dtype=torch.float32)
            for t in scaling)


def _plan(optimizer: OffloadOptimizer, kept: bool = False) -> None:
    """Which inner optimizer steps which parameters (``offload/optimizing/plan.py``), anew when
    the groups or the slices' host copies changed: before updates start, and before the state is
    read or loaded by slice; but not while updates a backward started await their ``step()``
    (``kept``: in that ``step()``), which keeps the plan they ran with (Note: [A plan kept for its
    step()] in ``offload/optimizing/in_backward.py``)."""
    engine = engine_of(optimizer.model)
    key = plan_key(optimizer.param_groups, engine)
    if key == optimizer._plan_key:
        return
    backward = optimizer._in_backward
    if optimizer._plan_key is not None and (kept or (backward is not None and backward.started)):
        return
    optimizer.synchronize()
    inner = functools.partial(inner_optimizer, optimizer)
    optimizer._steps, optimizer._rest = slice_steps(optimizer.param_groups, engine, optimizer._sharding, inner,
                                                    optimizer.state)
    # A resident slice's state stays on the device, beside its parameters (Note: [Resident slices]).
    optimizer._disk.plan([(step.index, step.whole.params) for step in optimizer._steps
                          if step.whole is not None and not _resident(step)])
    optimizer._plan_key = key


def _start_updates(optimizer: OffloadOptimizer, started: set[int], hyper: list[dict[str, Any]],
                   scaling: tuple[Any, Any], on_host: tuple[torch.Tensor | None, torch.Tensor | None]) -> None:
    """Start the updates backward did not (``started``), in slice order: the resident (first) slices',
    queued on the device (GradScaler's ``scaling`` there), then the others' (with it ``on_host``);
    waited for while the optimizer may draw random numbers (Note: [An optimizer that draws random
    numbers] in ``offload/optimizing/random_draws.py``)."""
    def start(resident: list[SliceStep], streamed: list[SliceStep], rest: list[SliceStep], handed: set[int]) -> None:
        optimizer._updates.run_now(resident, hyper, *scaling, handed)
        optimizer._updates.submit(streamed, rest, hyper, *on_host)

    optimizer._draws.start(optimizer, [s for s in optimizer._steps if s.index not in started], started, start)
    if optimizer._optimizer_step_post_hooks or _global_optimizer_post_hooks:
        # PyTorch runs step post-hooks as step() returns: they read (and may write) the parameters
        # through whatever they hold, param_groups included, which waits for nothing. As for the
        # plain optimizer they see them updated; the shadows are cast again after what they wrote.
        engine_of(optimizer.model).updates.wait_all(shadows_stale=True)


def _resident(step: SliceStep) -> bool:
    """Whether ``step`` updates a resident slice (Note: [Resident slices]), on the device in ``step()``."""
    return step.storage is not None and step.storage.resident


def _scaled_in_update(optimizer: OffloadOptimizer) -> tuple[SliceUpdates, list[SliceStep]]:
    """The hand-off of updates, and the streamed slices' steps whose gradients a clip may scale on
    the update worker (Note: [Scaling in the update]): none for a sharded optimizer or one that is
    not the model's newest (which scale at once)."""
    newest = _newest.get(optimizer.model)
    if optimizer._sharding is not None or newest is None or newest() is not optimizer:
        return optimizer._updates, []
    _plan(optimizer)
    return optimizer._updates, [step for step in optimizer._steps if not _resident(step)]


def _step(optimizer: OffloadOptimizer, closure: Callable[[], Any] | None) -> Any:
    """:meth:`OffloadOptimizer.step`'s work, eager under ``torch.compile`` as :data:`_STEP` calls it."""
    _check_newest(optimizer.model, optimizer)
    optimizer._disk.check_loaded("step()")
    optimizer._stepped_engine = True
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    engine = engine_of(optimizer.model)
    started, unwritten = _step_begins(optimizer)
    count_step(engine, optimizer.param_groups, started)  # Note: [A step between a forward and its backward]
    hyper = [snapshot(group) for group in optimizer.param_groups]
    scaling = (getattr(optimizer, "grad_scale", None), getattr(optimizer, "found_inf", None))
    grad_scale, found_inf = _on_host(scaling)
    # An update must not write host copies that a load still reads (a safety net: see Note:
    # [Orderings the end of a walk covers] in offload/streams/copies.py).
    engine.copies.wait_loads_done()
    _start_updates(optimizer, started, hyper, scaling, (grad_scale, found_inf))
    if unwritten is not None:  # a write of the updates backward ran, once the step is whole (_step_begins)
        raise unwritten
    return loss


#: :func:`_step` as ``step()`` calls it: eagerly while Dynamo traces the call (Note: [A compiled step]).
_STEP = EagerUnderDynamo(_step, EAGER_STEP_REASON, traced=waiting(_step))


def _step_begins(optimizer: OffloadOptimizer) -> tuple[set[int], DiskTierError | None]:
    """In ``step()``, before its updates start: the slices whose update backward started
    (``update_in_backward``, once its checks pass), and :func:`_before_update`'s.

    Where backward started updates, the step is under way: a write of theirs that failed (the
    disk tier's state, masters on disk) is returned, not raised, for ``step()`` to raise once it
    has started the rest. Raised first, it would leave the slices deferred to ``step()`` never
    updated beside those backward updated, and its advice to call ``step()`` again would update
    those twice (Note: [Disk tier failures] in ``offload/tiers/disk_tier.py``, rule 1).
    """
    started = (optimizer._in_backward.before_step(getattr(optimizer, "grad_scale", None))
               if optimizer._in_backward is not None else set())
    return started, _before_update(optimizer, "stepped" if started else "step")


def _before_update(optimizer: OffloadOptimizer, when: str = "step") -> DiskTierError | None:
    """Before updates start (``when``: ``"step"`` in ``step()``, ``"backward"`` in the backward that
    starts them, ``"stepped"`` in ``step()`` after backward started some): a mix left by an update
    that failed part way remembered, the plan, and what the last step could not write, raised
    first (returned instead, ``"stepped"``: :func:`_step_begins`); the norms computed in backward
    forgotten."""
    engine = engine_of(optimizer.model)
    optimizer._updates.before_step(optimizer, when)  # Note: [A step refused as a whole] in whole_step.py
    _plan(optimizer, kept=when == "stepped")
    if optimizer._sharding is not None:
        optimizer._sharding.compare_plan()  # the ranks' plans, each made alone
    writes: list[Callable[[], None]] = [functools.partial(optimizer._disk.flush, when)]  # a failed write retried first
    if engine.master_files is not None:  # masters that could not be written back are raised first, and latched
        writes.insert(0, functools.partial(engine.master_files.flush, optimizer._updates.failure.unwritten))
    unwritten = None
    for flush in writes:
        try:
            flush()
        except DiskTierError as error:
            if when != "stepped":
                raise
            unwritten = unwritten or error
    if optimizer._norms is not None:  # the updates read this accumulation's gradients: the next one's count
        optimizer._norms.stepped()
    return unwritten


def _waiting(optimizer: OffloadOptimizer) -> str:
    """What a wait's failed write says (a key of :data:`~offload.tiers.disk_tier.FLUSHED_AT`): the
    step is done, or, between a backward that started updates and ``step()``, half done."""
    backward = optimizer._in_backward
    return "between" if backward is not None and backward.started else "wait"


def check_whole(optimizer: OffloadOptimizer, doing: str) -> None:
    """Raise if ``doing`` (a save, ``state_dict()``) would hand out a mix: a load into the disk tier
    that failed part way, or an update that did (Note: [An update that failed part way] in
    ``offload/optimizing/partial_failure.py``), until a load succeeds.

    Raises:
        HostUpdateError: an update raised, and no wait has said so yet.
        RuntimeError: the state, or the parameters and the state, mix two of them.
    """
    optimizer._disk.check_loaded(doing)
    check_failed_backward(optimizer._in_backward)
    optimizer._updates.failure.check(doing, engine_of(optimizer.model))


def _param_indices(optimizer: torch.optim.Optimizer) -> dict[int, int]:
    """Each parameter's number in ``state_dict()``, as ``torch.optim`` numbers them."""
    indices: dict[int, int] = {}
    for p in (p for group in optimizer.param_groups for p in group["params"]):
        indices.setdefault(id(p), len(indices))
    return indices


def _check_newest(model: OffloadModel, optimizer: torch.optim.Optimizer) -> None:
    """Raise if an OffloadOptimizer newer than ``optimizer`` was built for ``model``."""
    newest = _newest.get(model)
    if newest is not None and newest() not in (optimizer, None):
        raise RuntimeError(
            "a newer OffloadOptimizer was built for this model; two would both step its parameters, and their "
            "updates would race over its slices. Keep one: for different settings on parts of the model, pass "
            "parameter groups, OffloadOptimizer(model, torch.optim.AdamW, [{'params': ...}, {'params': ..., "
            "'lr': ...}])")
