"""``OffloadOptimizer``: any ``torch.optim`` optimizer, stepping an OffloadModel's host copies slice
by slice on a host worker, overlapped with the device's next forward.

Note: [Overlapped host update]
    ``step()`` captures each parameter's gradient and each group's hyperparameters, then hands
    one task per slice, in slice order, to a host worker (``offload/streams/workers.py``) and
    returns. The next forward loads slice ``k`` only once slice ``k``'s update is done (the device
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

import copy
import functools
import os
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .autograd.accumulation import mark_zeroed
from .tiers.disk_tier import DiskTier, StateTier
from .model import OffloadModel, engine_of
from .streams import Event
from .streams.collectives import HostCollectives
from .tiers.slice_update import HostUpdateError, InnerOptimizer, SliceStep, StateByProxy, held_state


#: The OffloadOptimizer built last for each model: only it may step the model (an older one, still
#: alive, refuses), so a rebuilt optimizer replaces the old one and two never step one model.
_newest: weakref.WeakKeyDictionary[OffloadModel, weakref.ref[OffloadOptimizer]] = weakref.WeakKeyDictionary()


class OffloadOptimizer(torch.optim.Optimizer):
    """Wrap a ``torch.optim`` optimizer class so it steps an :class:`~offload.OffloadModel`'s host
    copies on a host worker, overlapped with the next forward. See Note: [Overlapped host update].

    It *is* a ``torch.optim.Optimizer``: learning-rate schedulers and ``torch.amp.GradScaler``
    accept it, its ``param_groups`` are the groups you passed, and its ``state_dict()`` loads into
    ``optimizer_class`` and back.

    Args:
        model: the :class:`~offload.OffloadModel` whose parameters it steps.
        optimizer_class: a ``torch.optim.Optimizer`` subclass (``torch.optim.AdamW``, ...).
        params: parameters or parameter groups, as ``optimizer_class`` takes them; default
            ``model.parameters()``. Parameters outside ``model`` are stepped in ``step()`` itself.
        num_threads: CPU threads for the update (``torch.set_num_threads`` in the worker); default:
            PyTorch's setting. On a machine with few cores, leave some to the input pipeline.
        disk_tier: keep the per-element state of the model's slices (AdamW's moments) in files on a
            local disk instead of RAM: a :class:`~offload.DiskTier`, or a directory path for its
            defaults. The files are removed by :meth:`close` (or leaving ``with optimizer:``), or
            when the optimizer is garbage-collected. See ``docs/disk-tier.md``.
        **optimizer_kwargs: keyword arguments of ``optimizer_class`` (``lr=1e-4, fused=True``).

    Raises:
        TypeError: ``model`` is not an OffloadModel or ``optimizer_class`` not an optimizer class.
        ValueError: an optimizer that needs a closure (``LBFGS``), or a bad ``num_threads``.
        DiskTierError: the disk tier could not write state (raised by ``step()``,
            ``synchronize()`` and ``state_dict()``; the message says which slices are updated).

    If the optimizer raises while it updates a slice, the error (a :class:`HostUpdateError`)
    surfaces at the next call that waits for updates; slices before that one are updated, the
    ones after it are left as they were, and that slice is unchanged when the optimizer raised
    before changing it (argument checks, setting up its state), as ``torch.optim`` optimizers do.

    Example::

        >>> model = OffloadModel(layers, device="cuda", num_slices=8)
        >>> optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-4, fused=True)
        >>> for x, y in loader:
        ...     loss_fn(model(x), y).backward()
        ...     optimizer.step()          # returns at once; the update runs beside the next forward
        ...     optimizer.zero_grad()
    """

    def __init__(self, model: OffloadModel, optimizer_class: type[torch.optim.Optimizer],
                 params: Iterable[Any] | None = None, *, num_threads: int | None = None,
                 shard: bool | None = None, process_group: Any = None,
                 disk_tier: DiskTier | str | os.PathLike[str] | None = None, **optimizer_kwargs: Any) -> None:
        if not isinstance(model, OffloadModel):
            raise TypeError(
                f"OffloadOptimizer steps an OffloadModel, got {type(model).__name__}; wrap the model first: "
                f"model = OffloadModel(model, device=...), then OffloadOptimizer(model, torch.optim.AdamW, lr=...)")
        if isinstance(optimizer_class, torch.optim.Optimizer):
            # Its repr would list every hyperparameter of every group.
            raise TypeError(
                f"optimizer_class must be a torch.optim.Optimizer subclass, got a {type(optimizer_class).__name__} "
                f"instance; pass the class and its arguments: OffloadOptimizer(model, "
                f"torch.optim.{type(optimizer_class).__name__}, lr=...)")
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(
                f"optimizer_class must be a torch.optim.Optimizer subclass such as torch.optim.AdamW, got "
                f"{optimizer_class!r}; pass its arguments as keywords: OffloadOptimizer(model, torch.optim.AdamW, lr=1e-3)")
        if issubclass(optimizer_class, torch.optim.LBFGS):
            raise ValueError("LBFGS re-evaluates the model inside step() through a closure; OffloadOptimizer "
                             "cannot overlap that. Use it directly on model.parameters().")
        if num_threads is not None and (isinstance(num_threads, bool) or not isinstance(num_threads, int)
                                        or num_threads < 1):
            raise ValueError(f"num_threads must be a positive int or None, got {num_threads!r}")
        if disk_tier is not None and not isinstance(disk_tier, (DiskTier, str, os.PathLike)):
            raise TypeError(f"disk_tier must be a DiskTier or a directory path, got {type(disk_tier).__name__}")
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
        self._worker: Any = None
        self._offload_outer = True  # the per-tensor warning names optimizer_class (per_tensor_warning.py)
        self._collectives = self._sharding(shard, process_group)
        self._shared: dict[int, tuple[list[torch.Tensor], list[int]]] = {}
        _newest[model] = weakref.ref(self)
        self._tier: StateTier | None = None
        if disk_tier is not None:
            setting = disk_tier if isinstance(disk_tier, DiskTier) else DiskTier(disk_tier)
            rank = self._collectives.rank if self._collectives is not None else None
            ranks = self._collectives.world_size if self._collectives is not None else 1
            self._tier = StateTier(setting, self, engine_of(model).copies, rank, ranks)
            engine_of(model).disk_tiers.add(self._tier)
        engine_of(model).optimizers.add(self)  # its state counts in model.memory_footprint()

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
        model = self.__dict__.get("model")  # None while torch.optim's __init__ sets the state up
        if model is not None and engine_of(model).updates.pending():
            engine_of(model).updates.finish_all()
        return held_state(self)

    @state.setter
    def state(self, value: Any) -> None:
        self.__dict__["state"] = value  # where torch.optim's load_state_dict() puts it too

    # -- stepping --------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Start the update of every slice, in slice order, on the host worker, and return.

        The next forward waits for each slice's update just before loading it. Parameters without a
        gradient (all of them before the first backward) are left as they are, as ``torch.optim``
        leaves them.

        Raises:
            RuntimeError: a newer OffloadOptimizer was built for the same model.
        """
        newest = _newest.get(self.model)
        if newest is not None and newest() not in (self, None):
            raise RuntimeError(
                "a newer OffloadOptimizer was built for this model; two would both step its parameters, and their "
                "updates would race over its slices. Keep one: for different settings on parts of the model, pass "
                "parameter groups, OffloadOptimizer(model, torch.optim.AdamW, [{'params': ...}, {'params': ..., "
                "'lr': ...}])")
        self._check_loaded("step()")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        engine = engine_of(self.model)
        self._plan()
        if engine.master_files is not None:
            engine.master_files.flush()  # masters that could not be written back are raised first
        if self._tier is not None:
            self._tier.flush("step")  # a write that failed last step is retried (or raised) first
        hyper = [_snapshot(group) for group in self.param_groups]
        # GradScaler hands fused optimizers its scale and inf flag on the loss's device. The update
        # reads them on a host worker, where the optimizer's own non-blocking copy to the host would
        # be queued on that thread's stream behind the next forward's kernels, and read before it
        # lands. Bring them to the host here, waiting for them.
        grad_scale, found_inf = (None if t is None else t.to("cpu")
                                 for t in (getattr(self, "grad_scale", None), getattr(self, "found_inf", None)))
        # An update must not write host copies that a load still reads (a safety net: see Note:
        # [Orderings the end of a walk covers] in offload/streams/copies.py).
        engine.copies.wait_loads_done()
        if self._worker is None:
            self._worker = engine.copies.new_worker("host update", self.num_threads)
            weakref.finalize(self, self._worker.close)
        for step in self._steps:
            if self._collectives is not None:
                self._submit_shard(step, hyper, grad_scale, found_inf)
                continue
            updated = self._submit_update(step, hyper, grad_scale, found_inf)
            if updated is not None:
                engine.updates.submitted(step.index, updated)
                self._write_masters(step.index, updated)
        for step in self._rest:
            step.bind()
            step.run([p.grad for p in step.whole.params], hyper, grad_scale, found_inf)
        return loss

    def _submit_update(self, step: SliceStep, hyper: list[dict[str, Any]], grad_scale: torch.Tensor | None,
                       found_inf: torch.Tensor | None) -> Event | None:
        """Queue the update of the parameters ``step`` steps on the host worker; its event, or
        ``None`` when none of them has a gradient."""
        assert step.whole is not None
        grads = [p.grad for p in step.whole.params]
        if all(g is None for g in grads):
            return None
        engine = engine_of(self.model)
        if step.needs_bind():
            engine.updates.wait(step.index)  # the proxies may still be in use by its last update
            step.bind()
        work = functools.partial(step.run, grads, hyper, grad_scale, found_inf)
        return self._submit(step.index, work)

    def _submit_shard(self, step: SliceStep, hyper: list[dict[str, Any]], grad_scale: torch.Tensor | None,
                      found_inf: torch.Tensor | None) -> None:
        """Sharded: this rank updates the parameters it owns, then every rank takes each updated
        parameter from its owner; the next forward's load waits for that."""
        engine = engine_of(self.model)
        collectives = self._collectives
        assert collectives is not None
        everyone, owners = self._shared[step.index]
        stepped = [(p, owner) for p, owner in zip(everyone, owners) if p.grad is not None]
        if not stepped:
            return
        updated = self._submit_update(step, hyper, grad_scale, found_inf) if step.whole is not None else None
        storage = step.storage
        then = None
        if storage is not None and storage.shadow is not None:
            def then() -> None:  # every parameter is final now: write the whole shadow
                storage.write_shadow()
                storage.shadow_written()
        event = collectives.broadcast([p.detach() for p, _ in stepped], [owner for _, owner in stepped],
                                      after=[updated], what=f"sharing the updated parameters of slice {step.index}",
                                      then=then)
        engine.updates.submitted(step.index, event)
        self._write_masters(step.index, event)

    def _submit(self, index: int, work: Callable[[], None]) -> Any:
        """Run slice ``index``'s update on the update worker (its masters read in first when they
        are on disk, its state read before and written after by the disk tier, if there is one);
        returns the update's event."""
        engine = engine_of(self.model)
        files, mapped = engine.master_files, engine.slices[index].storage.masters_file
        after = []
        if files is not None and mapped is not None:
            after.append(files.read(index, mapped))
            work = files.guard(index, work)
        if self._tier is None:
            return engine.copies.submit(self._worker, work, after=after)
        return self._tier.submit(index, self._worker, work, after=after)

    def _write_masters(self, index: int, after: Event | None) -> None:
        """With masters on disk, write slice ``index``'s back and drop them after ``after``, the
        last work that writes them (Note: [Masters on disk] in ``offload/tiers/master_files.py``)."""
        engine = engine_of(self.model)
        files, mapped = engine.master_files, engine.slices[index].storage.masters_file
        if files is not None and mapped is not None:
            files.write(index, mapped, after)

    def consolidated_state_dict(self, to: int = 0) -> dict[str, Any] | None:
        """The whole optimizer state, gathered from the ranks that own its parts, on rank ``to``
        (of the process group); ``None`` on the others. Call it on every rank. Without sharding it
        is ``state_dict()`` on every rank. The result loads into ``optimizer_class`` and into an
        OffloadOptimizer, sharded or not.
        """
        local = self.state_dict()
        if self._collectives is None:
            return local
        group = self._collectives.group
        gathered: list[Any] | None = [None] * self._collectives.world_size if self._collectives.rank == to else None
        dist.gather_object(local["state"], gathered, dst=dist.get_global_rank(group, to), group=group)
        if gathered is None:
            return None
        merged: dict[int, Any] = {}
        for part in gathered:
            merged.update(part)
        return {"state": dict(sorted(merged.items())), "param_groups": local["param_groups"]}

    def state_by_slice(self) -> Iterator[tuple[int, dict[torch.Tensor, dict[str, Any]]]]:
        """The optimizer state this rank keeps, one slice at a time, after every pending update.

        Yields ``(slice index, {parameter: its state})`` in slice order, then ``(-1, ...)`` for
        parameters outside the model; each parameter's state is the plain optimizer's (a dict of
        tensors and numbers; empty before its first update). Sharded, only the parameters this
        rank updates appear. Checkpoints
        read the state through this (Note: [Checkpoint layout] in ``offload/checkpoint/save_load.py``): a
        store that keeps state away from host memory hands over one slice's state at a time here,
        never the whole of it.
        """
        self._check_loaded("Reading the state")
        self.synchronize()
        self._plan()
        for step in (*self._steps, *self._rest):
            if step.whole is not None:
                # With a disk tier, the slice's tensors come from its file: copies, one slice at a time.
                on_disk = self._tier.slice_state(step.index) if self._tier is not None else {}
                yield step.index, {p: {**self.state.get(p, {}), **on_disk.get(p, {})} for p in step.whole.params}

    def _state_layout_by_slice(self) -> Iterator[tuple[int, dict[torch.Tensor, dict[str, Any]],
                                                       dict[torch.Tensor, dict[str, Any]]]]:
        """As :meth:`state_by_slice`, without reading the disk tier: yields ``(slice index,
        {parameter: its state}, {parameter: its state on disk})`` where each tensor the tier keeps
        is a stand-in of its shape and dtype (:meth:`StateTier.slice_layout`), to be read with
        :meth:`_slice_state_on_disk` when needed (Note: [Checkpoint layout] in
        ``offload/checkpoint/save_load.py``)."""
        self.synchronize()
        self._plan()
        for step in (*self._steps, *self._rest):
            if step.whole is not None:
                on_disk = self._tier.slice_layout(step.index) if self._tier is not None else {}
                yield (step.index, {p: {**self.state.get(p, {}), **on_disk.get(p, {})} for p in step.whole.params},
                       on_disk)

    def _slice_state_on_disk(self, index: int) -> dict[torch.Tensor, dict[str, torch.Tensor]]:
        """Copies of slice ``index``'s state tensors read from the disk tier (none without one);
        call after :meth:`_state_layout_by_slice`, which finishes pending updates and writes."""
        return self._tier.slice_state(index) if self._tier is not None else {}

    def _sharding(self, shard: bool | None, process_group: Any) -> HostCollectives | None:
        """The host collectives of a sharded update, or None when every rank updates everything."""
        data_parallel = self.model.__dict__.get("_data_parallel")
        group = process_group if process_group is not None else (
            data_parallel.group if data_parallel is not None else None)
        if shard is None:
            shard = group is not None and dist.get_world_size(group) > 1
        if not shard:
            return None
        if group is None:
            raise ValueError("shard=True needs a process group: the model's (OffloadModel(..., process_group=...)) "
                             "or process_group= here")
        if process_group is None and data_parallel is not None and data_parallel.host is not None:
            return data_parallel.host  # one worker issues all of the group's host collectives
        if "nccl" in str(dist.get_backend(group)).lower():
            raise ValueError(
                "the sharded update shares parameters between the ranks' host memory, which NCCL cannot reduce: "
                "pass process_group=torch.distributed.new_group(backend='gloo'), or shard=False to update "
                "everything on every rank")
        return HostCollectives(engine_of(self.model).copies, group)

    def synchronize(self) -> None:
        """Block until every pending update is done; raise what an update raised (and what the
        disk tier could not write)."""
        engine = engine_of(self.model)
        engine.updates.wait_all()
        if engine.master_files is not None:
            engine.master_files.flush()
        if self._tier is not None:
            self._tier.flush()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients, as ``torch.optim.Optimizer.zero_grad`` does.

        With ``set_to_none=True`` (the default) it returns at once: pending updates keep the
        gradients they captured. With ``False`` it zeroes them in place, after the updates that
        read them (which keep the shadows they wrote: the next forward does not cast them again,
        nor read masters on disk in for that).
        """
        if not set_to_none:
            engine_of(self.model).updates.finish_all()
        super().zero_grad(set_to_none=set_to_none)
        if not set_to_none:
            mark_zeroed(p for group in self.param_groups for p in group["params"])

    def state_dict(self) -> dict[str, Any]:
        """``torch.optim.Optimizer.state_dict()``, after the pending updates; with a disk tier, the
        state on disk is read into it one slice at a time."""
        self._check_loaded("state_dict()")
        self.synchronize()
        packed = super().state_dict()
        if self._tier is not None:
            self._tier.add_to_state_dict(packed, self._param_indices())
        return packed

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """``torch.optim.Optimizer.load_state_dict()``, after the pending updates; with a disk tier,
        the loaded state moves to disk one slice at a time."""
        self.synchronize()
        super().load_state_dict(state_dict)
        if self._tier is not None:
            self._tier.forget()
        self._plan_key = None  # a sharded optimizer keeps only its own parameters' state
        if self._collectives is not None or self._tier is not None:
            self._plan()
        if self._tier is not None:
            self._tier.adopt()

    # -- loading a checkpoint into the disk tier, slice by slice -----------------------------------

    def _check_loaded(self, doing: str) -> None:
        """Raise if a load into the disk tier failed part way (Note: [Slice-by-slice load] in
        ``offload/checkpoint/slice_load_planner.py``): ``doing`` would step or save a mix of two states."""
        if self._tier is not None:
            self._tier.check_loaded(doing)

    def _loads_on_disk(self, index: int, param: torch.Tensor, key: str, dtype: torch.dtype,
                       shape: torch.Size) -> bool:
        """Whether a checkpoint's state tensor ``key`` of ``param`` (in slice ``index``, saved in
        ``dtype`` and ``shape``) loads straight into the disk tier, a slice at a time (Note:
        [Slice-by-slice load] in ``offload/checkpoint/slice_load_planner.py``): the tier would keep it on disk
        once ``load_state_dict()`` cast it. Never ``step``, whose cast depends on the saved
        groups' ``fused`` and ``capturable``, nor a tensor without elements (there is nothing to read)."""
        if self._tier is None or key == "step" or len(shape) == 0 or any(n == 0 for n in shape):
            return False
        return self._tier.keeps(index, param, self._as_loaded(param, key, torch.empty(0, dtype=dtype)))

    @staticmethod
    def _as_loaded(param: torch.Tensor, key: str, value: torch.Tensor) -> torch.Tensor:
        """``value`` as ``torch.optim``'s ``load_state_dict()`` puts it into ``param``'s state under
        ``key`` (any key but ``step``): the function it casts with, which casts to the parameter's
        dtype (floating point) and device."""
        assert key != "step", "internal error: the cast of step depends on the saved groups"
        # The groups tell only step's cast (fused, capturable); any list naming the parameter does.
        return torch.optim.Optimizer._process_value_according_to_param_policy(param, value, 0, [{"params": [0]}], key)

    def _open_slice_load(self, index: int, saved: dict[torch.Tensor, dict[str, torch.Tensor]]) -> _TierSliceLoad:
        """Where a checkpoint loads slice ``index``'s state tensors that the disk tier keeps, given
        stand-ins of their saved shapes and dtypes; its ``store()`` writes them to the slice's file."""
        return _TierSliceLoad(self, index, saved)

    def _load_state_dict_beside_tier(self, state_dict: dict[str, Any], loaded: Collection[int]) -> None:
        """``load_state_dict()`` of a checkpoint's state less the tensors already loaded into the
        disk tier's files, slice by slice (slices ``loaded``; Note: [Slice-by-slice load] in
        ``offload/checkpoint/slice_load_planner.py``): the scalars (``step``) and the groups go through
        ``torch.optim``'s ``load_state_dict()`` as with any load; the tier's other slices hold what
        it puts into ``optimizer.state``.

        Raises:
            DiskTierError: a slice's state could not be written; it is held in RAM, and the state
                is loaded.
        """
        assert self._tier is not None
        # Not synchronize(): a write that failed while loading is raised as a load's, by adopt().
        engine_of(self.model).updates.wait_all()
        super().load_state_dict(state_dict)
        self._tier.forget(keep=loaded)
        self._tier.adopt()

    def close(self) -> None:
        """Wait for the pending updates and remove the disk tier's files (kept with
        ``DiskTier(keep=True)``); the optimizer cannot step afterwards if it has a disk tier.
        Save ``state_dict()`` first to keep the state. Leaving ``with optimizer:`` calls it."""
        try:
            engine_of(self.model).updates.wait_all()
        finally:
            if self._tier is not None:
                self._tier.close(self._param_indices())

    def __enter__(self) -> OffloadOptimizer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _param_indices(self) -> dict[int, int]:
        """Each parameter's number in ``state_dict()``, as ``torch.optim`` numbers them."""
        indices: dict[int, int] = {}
        for p in (p for group in self.param_groups for p in group["params"]):
            indices.setdefault(id(p), len(indices))
        return indices

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_steps", None):
            self.synchronize()
        super().add_param_group(param_group)

    # -- the plan: which inner optimizer steps which parameters -----------------------------------

    def _plan(self) -> None:
        engine = engine_of(self.model)
        key = (tuple(tuple(map(id, group["params"])) for group in self.param_groups),
               tuple(tuple(id(e.tensor) for e in s.storage.held) for s in engine.slices))
        if key == self._plan_key:
            return
        self.synchronize()
        # A tied parameter is stepped once, with the slice that holds it (its first): later slices
        # that borrow it load it after that slice's update (Note: [Tied parameters across slices]).
        place = {id(e.tensor): (s.index, k) for s in engine.slices for k, e in enumerate(s.storage.held)
                 if e.is_parameter}
        per_slice: dict[int, list[tuple[int, torch.Tensor, int]]] = {}
        rest: list[tuple[torch.Tensor, int]] = []
        for g, group in enumerate(self.param_groups):
            for p in group["params"]:
                if id(p) in place:
                    index, k = place[id(p)]
                    per_slice.setdefault(index, []).append((k, p, g))
                else:
                    rest.append((p, g))
        self._steps = []
        self._shared = {}
        sharded = self._collectives is not None
        # Each slice's parameters in memory order.
        ordered = {index: sorted(per_slice[index], key=lambda item: item[0]) for index in sorted(per_slice)}
        if sharded:
            owners_of = dict(zip(ordered, _owners([[p for _, p, _ in items] for items in ordered.values()],
                                                  self._collectives.world_size)))  # type: ignore[union-attr]
        for index, items in ordered.items():
            storage = engine.slices[index].storage
            if sharded:
                owners = owners_of[index]
                self._shared[index] = ([p for _, p, _ in items], owners)
                mine = self._collectives.rank  # type: ignore[union-attr]
                for (_, p, _), owner in zip(items, owners):
                    if owner != mine:
                        self.state.pop(p, None)  # its owner keeps its state
                items = [item for item, owner in zip(items, owners) if owner == mine]
            if not items:
                self._steps.append(SliceStep(index, storage, None, writes_shadow=False))
                continue
            whole = self._inner([p for _, p, _ in items], [g for _, _, g in items])
            # Sharded, the shadow is written once every rank's part of the slice has arrived.
            self._steps.append(SliceStep(index, storage, whole, writes_shadow=not sharded))
        if self._tier is not None:
            self._tier.plan([(step.index, step.whole.params) for step in self._steps if step.whole is not None])
        self._rest = []
        if rest:
            self._rest = [SliceStep(-1, None, self._inner([p for p, _ in rest], [g for _, g in rest]))]
        self._plan_key = key

    def _inner(self, params: list[torch.Tensor], groups: list[int]) -> InnerOptimizer:
        """An inner optimizer over proxies of ``params``, each in its user group's settings."""
        proxies = [nn.Parameter(p.data, requires_grad=p.requires_grad) for p in params]
        by_group: dict[int, list[nn.Parameter]] = {}
        for proxy, g in zip(proxies, groups):
            by_group.setdefault(g, []).append(proxy)
        inner_groups = [{**_snapshot(self.param_groups[g]), "params": members} for g, members in by_group.items()]
        inner = self.optimizer_class(inner_groups, **self.optimizer_kwargs)
        inner._offload_inner = True  # type: ignore[attr-defined]
        inner.state = StateByProxy(self, dict(zip(proxies, params)))  # type: ignore[assignment]
        return InnerOptimizer(inner, proxies, params, list(by_group))


class _TierSliceLoad:
    """One slice's state tensors that a checkpoint loads into the disk tier (Note: [Slice-by-slice
    load] in ``offload/checkpoint/slice_load_planner.py``).

    ``tensors`` are views of the tier's buffer, laid out as its file, where the saved dtype is the
    one ``load_state_dict()`` would keep; otherwise tensors of the saved dtype, which :meth:`store`
    casts into their views as ``load_state_dict()`` casts them: the state is the same bit for bit.
    """

    def __init__(self, optimizer: OffloadOptimizer, index: int,
                 saved: dict[torch.Tensor, dict[str, torch.Tensor]]) -> None:
        assert optimizer._tier is not None
        self._tier = optimizer._tier
        kept = {p: {key: torch.empty(s.shape, dtype=optimizer._as_loaded(p, key, torch.empty(0, dtype=s.dtype)).dtype,
                                     device="meta") for key, s in states.items()} for p, states in saved.items()}
        self._loading = self._tier.begin_load(index, kept)
        self.tensors = {p: {key: view if view.dtype == saved[p][key].dtype
                            else torch.empty(saved[p][key].shape, dtype=saved[p][key].dtype)
                            for key, view in views.items()} for p, views in self._loading.tensors.items()}

    def store(self) -> None:
        """Every tensor is loaded: cast those of another dtype into their views, and write the slice."""
        for p, tensors in self.tensors.items():
            for key, tensor in tensors.items():
                view = self._loading.tensors[p][key]
                if tensor is not view:
                    view.copy_(OffloadOptimizer._as_loaded(p, key, tensor))
        self.tensors = {}
        self._tier.end_load(self._loading)


def _owners(slices: list[list[torch.Tensor]], world_size: int) -> list[list[int]]:
    """Which rank updates each parameter of each slice (the same answer on every rank).

    Slice by slice, each slice's parameters largest first, every parameter goes to the rank with
    the fewest elements so far, counted over the whole model: a rank takes a parameter only while
    no other has less, so no rank ends with more than ``1 / world_size`` of the elements plus the
    largest parameter. Counting per slice instead would hand rank 0 the largest parameter of every
    slice (nearly all of a model whose slices are one big weight each). Parameters are not split
    across ranks: an optimizer may treat a parameter as a whole (a norm over it, a factored
    second moment), and each rank's state stays a plain optimizer's, per whole parameter.

    Args:
        slices: per slice, its parameters that the optimizer steps.
        world_size: the number of ranks.
    """
    load = [0] * world_size
    owners = [[0] * len(params) for params in slices]
    for params, mine in zip(slices, owners):
        for k in sorted(range(len(params)), key=lambda k: (-params[k].numel(), k)):
            rank = min(range(world_size), key=lambda r: (load[r], r))
            mine[k] = rank
            load[rank] += params[k].numel()
    return owners


def _snapshot(group: dict[str, Any]) -> dict[str, Any]:
    """A group's hyperparameters as they are now (tensors copied: schedulers may change them in place)."""
    return {k: (v.clone() if isinstance(v, torch.Tensor) else copy.copy(v)) for k, v in group.items() if k != "params"}


