"""What a checkpoint holds (Note: [Checkpoint layout]), and how each part is taken from the model,
the optimizer and the random number generators and put back.

What this file holds: the format of ``offload.json`` and what it says (:func:`_info`), the model's
tensors as DCP reads them (each under a storage of its own), the optimizer's state and groups named
after the model's parameters, the generators' states, and the masters on disk a save or a load
reads or writes. What it does not: the steps of a save (``saver.py``) or of a load
(``loader.py``), what is checked before either (``checks.py``), or which ranks take part
(``ranks.py``).

Note: [Checkpoint layout]
    Keys of the DCP state dict, by name, so that a checkpoint loads on any number of ranks and
    into the plain model and optimizer:

    ``model/<name>``
        each entry of ``model.state_dict()`` (parameters and persistent buffers); every rank
        offers them and DCP writes each once. A module's ``get_extra_state()``
        (``<module>._extra_state``) is saved as the value it is, pickled unless it is a tensor,
        and handed to its ``set_extra_state()`` on load (Note: [Module load hooks]).
    ``optim/state/<parameter name>/<key>``
        the optimizer's state of a parameter (``exp_avg``, ``step``...), named after the
        parameter (its first name in ``named_parameters()``), offered by the rank that keeps it:
        sharded, each rank writes the state it owns, in parallel, and nothing is gathered.
        The optimizer hands it over one slice at a time: the state it holds in memory as
        references (no copies), the state a disk tier keeps as stand-ins of its shape and dtype,
        which the save planner reads from the tier when DCP writes them, one slice at a time
        (Note: [Slice-by-slice save] in ``offload/checkpoint/slice_save_planner.py``). Loading, each rank
        reads the state of the parameters it updates now, whatever the number of ranks that saved
        it; the state a disk tier keeps goes into the tier's files a slice at a time, as DCP reads
        it (Note: [Slice-by-slice load] in ``offload/checkpoint/slice_load_planner.py``), and the rest
        through the optimizer's ``load_state_dict()``. A value kept as a tensor subclass around
        plain tensors is a description here, its tensors under ``optim/wrapped/<parameter
        name>/<key>/<tensor name>`` (Note: [Wrapped state] in ``wrapped_state.py``).
    ``optim/param_groups``
        the groups' hyperparameters (learning rate as the scheduler left it...), each group's
        parameters by name.
    ``optim/hooked``
        what the optimizer's ``state_dict()`` post-hooks add to its ``state_dict()`` beside
        ``state`` and ``param_groups``, as a dict, present only when they add something (Note:
        [State dict hooks in a checkpoint]).
    ``rng/<rank>``
        that rank's CPU and CUDA generators and Python's ``random``: dropout draws the same
        numbers after a resume. Restored only when the number of ranks is unchanged.
    ``extra``
        rank 0's ``extra`` (each rank passes its own), as ``{"value": extra}``: DCP pickles a
        dict whatever it holds, where a bare tensor at the top level would be saved as tensor
        data, which a load asking for a pickled value cannot read. Before format 3, ``extra``
        itself (a bare tensor as tensor data, which a load now reads into a tensor of its shape).
        Offered by rank 0 and the ranks whose ``extra`` is the same: every rank used to offer its
        own under this one key, and DCP kept whichever it chose (Note: [Extra per rank]).
    ``extra/<rank>``
        another rank's ``extra``, as ``extra`` holds rank 0's, present only when it differs from
        rank 0's (Note: [Extra per rank]).

    Every value that is not a tensor (the groups, the generators, ``extra``, an extra state) is
    pickled whole, as it is: a save's planner does not flatten sharded tensors (there are none
    here), which would rebuild every nested dict as a plain ``dict`` with ``str`` keys, so that
    ``{0: 120}`` loaded as ``{'0': 120}``, a ``defaultdict`` as a ``dict``, and a second
    optimizer's ``state_dict()`` in ``extra`` loaded into no parameter. Checkpoints saved before
    (format 3 too) hold such values rebuilt that way, and load so.

    ``offload.json`` holds the names, shapes and dtypes of the model's tensors, the names of its
    modules' extra states, the slicing, the optimizer class, its groups' parameters by name and
    the number of ranks: what :func:`load_checkpoint` checks before it writes anything.

Note: [Extra per rank]
    Each rank's ``extra`` is its own (a data position, a generator's ``get_state()``), and a load
    gives each rank back the one it saved:

    1. A save compares the ranks' ``extra`` by a digest of its pickled bytes (:func:`_extra_digest`,
       gathered once). Rank 0's is saved as ``extra``, and so is every rank's that is the same: DCP
       writes one of these copies (on the rank it balances onto); another rank's as
       ``extra/<rank>``. Ranks that pass the same value (the step, a scheduler's state) write it
       once, as every save did before, and a run of one process writes what it always did.
    2. A load on the saved number of ranks reads ``extra/<rank>`` where there is one, else
       ``extra``; on another number, ``extra`` on every rank (no saved rank is this one: rank 1
       of two is not rank 1 of four, whose data it read), and, when some ``extra/<rank>`` is
       there, a warning that the ranks saved different values and that rank 0's is returned.
    3. The format did not change: a release that predates these keys reads ``extra``, rank 0's, on
       every rank, which is what it documented (the same on every rank), and a checkpoint it wrote
       loads here as one whose ranks saved the same value. Equal values whose pickles differ (a
       tensor on another device on each rank) count as different: the warning is the cost.

Note: [Module load hooks]
    DCP loads the model's tensors in place, into the parameters and buffers themselves, so
    ``model.load_state_dict()`` is not called; a load then does what it does beside the copies,
    as it does them, module by module from the root, children before their parent's hooks:

    1. a module that overrides ``set_extra_state()`` gets its saved extra state;
    2. its ``register_load_state_dict_post_hook`` hooks run, given the ``IncompatibleKeys`` of
       a strict load that matched every key (empty: the keys were checked before the load); a
       key a hook adds there raises, as ``load_state_dict(strict=True)`` does.

    What does not run: the modules' ``_load_from_state_dict`` (overrides included) and their
    ``load_state_dict`` pre-hooks, which take the incoming state dict before the copies: they
    convert or rename what they are given, and the checkpoint holds what ``state_dict()`` gave,
    loaded as it is. Going through ``load_state_dict()`` with the loaded tensors would run them,
    at the cost of a copy of every tensor onto itself (``copy_`` does not skip it) and, with
    masters on disk, a read of every slice's file.

Note: [State dict hooks in a checkpoint]
    A save and a load run the optimizer's hooks as ``state_dict()`` and ``load_state_dict()``
    run them, so that PyTorch's pairing of a ``state_dict`` post-hook that adds a key with a
    ``load_state_dict`` pre-hook that reads it survives a checkpoint:

    1. A save runs the ``state_dict`` pre-hooks, then the post-hooks on the dict ``state_dict()``
       would hand them (tensors as references; a disk tier's read in, as ``state_dict()`` reads
       them: only when post-hooks are registered).
    2. The keys they add beside ``state`` and ``param_groups`` are saved, pickled, as
       ``optim/hooked``; a load puts them back into the dict it hands ``load_state_dict()``,
       whose pre-hooks and post-hooks run as they always do (into the plain optimizer too).
    3. The state and the groups are saved as the optimizer holds them, slice by slice, not from
       that dict: a post-hook that changes them (drops a key, casts a tensor) refuses the save
       before anything is written, where taking its change would read the whole state at once
       and skipping it would save something else than ``state_dict()``. Such a hook's pair is a
       ``load_state_dict`` pre-hook that reverses it: keep the state as it is, or save
       ``optimizer.state_dict()`` in ``extra``.
"""

from __future__ import annotations

import hashlib
import io
import random
import time
from collections.abc import Collection, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.nn.modules.module import _IncompatibleKeys

from ..model import OffloadModel, engine_of
from ..optimizer import OffloadOptimizer, state_layout_by_slice
from ..streams.flat_views import dense_stride
from ..tiers.slice_update import same_value

#: The format a save writes. 2: optimizer state kept as a tensor subclass is saved as what it holds
#: (Note: [Wrapped state]), which a reader of format 1 would hand the optimizer as a description:
#: it refuses format 2 instead. 3: ``extra`` is saved as ``{"value": extra}`` (Note: [Checkpoint
#: layout]), which a reader of format 2 would return as it is: it refuses format 3. A load reads all.
FORMAT = 3
READABLE_FORMATS = (1, 2, 3)
#: The first format whose ``extra`` is saved as ``{"value": extra}``.
EXTRA_WRAPPED_SINCE = 3
#: The key of rank 0's ``extra``; another rank's is under ``EXTRA/<rank>`` (Note: [Extra per rank]).
EXTRA = "extra"
#: The key of what the optimizer's ``state_dict()`` post-hooks add (Note: [State dict hooks in a checkpoint]).
HOOKED = "optim/hooked"
#: The last part of the name ``state_dict()`` gives a module's ``get_extra_state()``.
EXTRA_STATE = "_extra_state"
STRAY_PARAMETER = ("the optimizer steps a parameter that is not in the model; a checkpoint names optimizer state "
                   "after the model's parameters: save such parameters in extra and give them their own optimizer")


def _info(model: nn.Module, optimizer: torch.optim.Optimizer | None, names: dict[int, str], world_size: int,
          checksums: dict[str, int]) -> dict[str, Any]:
    """What ``offload.json`` says of a checkpoint (Note: [Checkpoint layout])."""
    tensors, extra_states = _split_model_state(model, _model_state(model))
    return {"format": FORMAT, "world_size": world_size, "saved_ns": time.time_ns(),
            "tensors": {name: _describe(t) for name, t in tensors.items()},
            "extra_states": sorted(extra_states),
            "partition": _partition(model),
            "optimizer": None if optimizer is None else _optimizer_class(optimizer).__name__,
            "groups": None if optimizer is None else [g["params"] for g in _named_groups(optimizer, names)],
            "crc32": checksums}


def _extra_to_save(extra: Any) -> dict[str, Any]:
    """``extra`` as DCP saves it (Note: [Checkpoint layout]): in a dict, which DCP pickles whatever
    it holds, so that any picklable value, a bare tensor too, loads back as it was."""
    return {"value": extra}


def _extra_digest(extra: Any) -> str:
    """A digest of ``extra``'s pickled bytes, which the ranks of a save compare (Note: [Extra per
    rank]). ``torch.save``'s, not ``pickle``'s: a tensor pickles the address of its storage, which
    differs from process to process, where ``torch.save`` writes the same bytes for the same value."""
    sink = _HashingSink()
    torch.save(extra, sink)
    return sink.digest.hexdigest()


class _HashingSink(io.RawIOBase):
    """A writable file that keeps nothing but a digest of the bytes written."""

    def __init__(self) -> None:
        self.digest = hashlib.sha256()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self.digest.update(view)
        return view.nbytes


def _extra_keys(digests: list[str]) -> list[str]:
    """By rank, the key each rank offers its ``extra`` under, from their digests (Note: [Extra per
    rank], rule 1)."""
    return [EXTRA if digest == digests[0] else f"{EXTRA}/{rank}" for rank, digest in enumerate(digests)]


def _extra_key_to_load(saved: Collection[str], rank: int, same_ranks: bool) -> tuple[str, list[str]]:
    """The key of the ``extra`` this rank loads among the ``saved`` keys (Note: [Extra per rank],
    rule 2), and the saved ranks whose ``extra`` it is not: empty on the saved number of ranks, or
    when every rank saved rank 0's."""
    if same_ranks:
        own = f"{EXTRA}/{rank}"
        return (own if own in saved else EXTRA), []
    return EXTRA, sorted((key.removeprefix(f"{EXTRA}/") for key in saved if key.startswith(f"{EXTRA}/")), key=int)


def _loaded_extra(loaded: Any, saved_format: int) -> Any:
    """The ``extra`` a checkpoint of ``saved_format`` was saved with, from what DCP loaded."""
    return loaded["value"] if saved_format >= EXTRA_WRAPPED_SINCE else loaded


def _model_state(model: nn.Module) -> dict[str, Any]:
    # OffloadModel.state_dict() waits for pending host updates; the tensors share the host copies'
    # memory, so DCP reads from them and loads into them in place.
    return dict(model.state_dict())


def _split_model_state(model: nn.Module, model_state: dict[str, Any]
                       ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``model_state``'s parameters and buffers, and its modules' extra states (any value, a
    tensor too, whose shape may change from save to save), by name.

    Raises:
        TypeError: an entry is neither (a ``state_dict`` hook added it), which a load could not
            put back.
    """
    tensors: dict[str, torch.Tensor] = {}
    extra_states: dict[str, Any] = {}
    for name, value in model_state.items():
        prefix, _, last = name.rpartition(".")
        if last == EXTRA_STATE and _overrides(model.get_submodule(prefix), "get_extra_state"):
            extra_states[name] = value
        elif isinstance(value, torch.Tensor):
            tensors[name] = value
        else:
            raise TypeError(f"model.state_dict() holds {name!r}, a {type(value).__name__}: neither a parameter, a "
                            "buffer nor a module's get_extra_state(), so a checkpoint could not put it back (a "
                            "state_dict hook added it?). Keep such values in a module's get_extra_state() and "
                            "set_extra_state(), or pass them in extra.")
    return tensors, extra_states


def _overrides(module: nn.Module, method: str) -> bool:
    """Whether ``module``'s class overrides ``nn.Module``'s ``method``, as ``state_dict()`` and
    ``load_state_dict()`` ask before they save or load an extra state."""
    return getattr(type(module), method, None) is not getattr(nn.Module, method)


def _restore_modules(model: nn.Module, extra_states: dict[str, Any]) -> None:
    """What ``model.load_state_dict()`` does beside copying the tensors DCP loaded in place: each
    module's ``set_extra_state()`` with ``extra_states`` (by name), and its load post-hooks (Note:
    [Module load hooks]).

    Raises:
        RuntimeError: a post-hook added a missing or unexpected key, as ``load_state_dict()`` does.
    """
    incompatible = _IncompatibleKeys([], [])
    _restore_module(model, "", extra_states, incompatible)
    if incompatible.missing_keys or incompatible.unexpected_keys:
        raise RuntimeError(f"Error(s) in loading state_dict for {type(model).__name__} (a load_state_dict post-hook "
                           f"reported them after load_checkpoint): missing keys {incompatible.missing_keys}, "
                           f"unexpected keys {incompatible.unexpected_keys}")


def _restore_module(module: nn.Module, prefix: str, extra_states: dict[str, Any],
                    incompatible: _IncompatibleKeys) -> None:
    """:func:`_restore_modules` for ``module`` at ``prefix`` and its children, in
    ``load_state_dict()``'s order: its extra state, its children, its post-hooks."""
    key = prefix + EXTRA_STATE
    if key in extra_states:
        if _overrides(module, "set_extra_state"):
            module.set_extra_state(extra_states[key])
        else:
            incompatible.unexpected_keys.append(key)  # as load_state_dict() has it: nothing takes it
    for name, child in module._modules.items():
        if child is not None:
            _restore_module(child, f"{prefix}{name}.", extra_states, incompatible)
    for hook in module._load_state_dict_post_hooks.values():
        if hook(module, incompatible) is not None:
            raise AssertionError("Hooks registered with register_load_state_dict_post_hook are not expected to "
                                 "return new values; modify incompatible_keys in place.")


def _own_storage(value: Any) -> Any:
    """``value``, or for a tensor that shares a larger storage (a host copy is a view into its
    slice's buffer) the same memory under a storage of its own, without a copy.

    DCP writes a tensor's whole storage, so it copies such a view out first, and keeps every copy
    until the rank's file is written: a whole model's parameters, where one tensor is enough.
    """
    if not isinstance(value, torch.Tensor) or value.device.type != "cpu" or value.numel() == 0:
        return value
    if value.untyped_storage().nbytes() == value.nbytes:
        return value
    if not value.is_contiguous() and dense_stride(value) is None:
        return value  # overlapping or with gaps: DCP's copy it is
    run = torch.as_strided(value, (value.numel(),), (1,))  # the tensor's memory, in memory order
    own = torch.frombuffer(run.view(torch.uint8).numpy(), dtype=value.dtype)
    return torch.as_strided(own, value.shape, value.stride())


def _parameter_names(model: nn.Module) -> dict[int, str]:
    """Each parameter's first name (a tied parameter is stepped, and its state named, once)."""
    return {id(p): name for name, p in model.named_parameters()}


def _steps_only(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> bool:
    """Whether every parameter the optimizer steps is the model's (and so has a name)."""
    return all(id(p) in names for group in optimizer.param_groups for p in group["params"])


def _optimizer_state(optimizer: torch.optim.Optimizer
                     ) -> Iterator[tuple[int, torch.Tensor, dict[str, Any], dict[str, Any]]]:
    """(slice index, parameter, state, its state on disk) for each parameter whose state this rank
    keeps; the state a disk tier keeps is a stand-in of its shape and dtype, read when DCP writes
    it (Note: [Slice-by-slice save] in ``offload/checkpoint/slice_save_planner.py``)."""
    if isinstance(optimizer, OffloadOptimizer):
        for index, states, on_disk in state_layout_by_slice(optimizer):
            yield from ((index, p, state, on_disk.get(p, {})) for p, state in states.items() if state)
        return
    optimizer_state = optimizer.state
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p in optimizer_state:
                yield -1, p, optimizer_state[p], {}


def _hooked_keys(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Run the optimizer's ``state_dict`` hooks as ``state_dict()`` does; what the post-hooks add
    beside ``state`` and ``param_groups`` (Note: [State dict hooks in a checkpoint]).

    Raises:
        ValueError: a post-hook changed the state or the groups (rule 3).
    """
    for pre_hook in getattr(optimizer, "_optimizer_state_dict_pre_hooks", {}).values():
        pre_hook(optimizer)
    post_hooks = list(getattr(optimizer, "_optimizer_state_dict_post_hooks", {}).values())
    if not post_hooks:
        return {}
    packed = _packed(optimizer)
    handed = ({i: dict(s) for i, s in packed["state"].items()}, [dict(g) for g in packed["param_groups"]])
    for post_hook in post_hooks:
        hook_result = post_hook(optimizer, packed)
        if hook_result is not None:
            packed = hook_result
    changed = _changed_by_hooks(packed, *handed)
    if changed:
        raise ValueError(
            f"a state_dict() post-hook of the optimizer changed {changed}. save_checkpoint saves the optimizer's "
            "state and groups as the optimizer holds them, a slice at a time, and keeps only the keys its "
            "state_dict() post-hooks add beside 'state' and 'param_groups' (handed back to its load_state_dict() "
            "pre-hooks by load_checkpoint). Leave the state and the groups as they are in the hook, or save "
            "optimizer.state_dict() in extra (docs/checkpoints.md, 'Optimizer hooks').")
    return {k: v for k, v in packed.items() if k not in ("state", "param_groups")}


def _packed(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The dict ``state_dict()`` hands its post-hooks: state by parameter number (each parameter's
    dict a copy of its own, so a hook cannot change the optimizer's), groups' parameters by number."""
    index: dict[int, int] = {}
    for p in (p for group in optimizer.param_groups for p in group["params"]):
        index.setdefault(id(p), len(index))
    packed = {"state": {index[id(p)] if isinstance(p, torch.Tensor) else p: dict(s)
                        for p, s in optimizer.state.items()},
              "param_groups": [{**{k: v for k, v in group.items() if k != "params"},
                                "params": [index[id(p)] for p in group["params"]]} for group in optimizer.param_groups]}
    if isinstance(optimizer, OffloadOptimizer):
        optimizer._disk.add_to_state_dict(packed, index)  # as state_dict(): a disk tier's state, read in
    return packed


def _changed_by_hooks(packed: dict[str, Any], state: dict[Any, dict[str, Any]], groups: list[dict[str, Any]]) -> str:
    """What of the state and the groups ``packed`` differs from (empty: nothing)."""
    if not isinstance(packed.get("state"), dict) or packed["state"].keys() != state.keys():
        return "which parameters have state"
    for i, held in state.items():
        if not _same_entries(packed["state"][i], held):
            return f"the state of parameter {i}"
    if not isinstance(packed.get("param_groups"), list) or len(packed["param_groups"]) != len(groups):
        return "the parameter groups"
    for k, group in enumerate(groups):
        if not _same_entries(packed["param_groups"][k], group):
            return f"parameter group {k}"
    return ""


def _same_entries(now: Any, before: dict[str, Any]) -> bool:
    """Whether the dict ``now`` holds ``before``'s keys and values (the same objects, or equal ones)."""
    return (isinstance(now, dict) and now.keys() == before.keys()
            and all(now[k] is v or same_value(now[k], v) for k, v in before.items()))


def _kept_parameters(optimizer: torch.optim.Optimizer) -> list[tuple[int, torch.Tensor]]:
    """(slice index, parameter) for each parameter whose state this rank keeps (sharded: those it
    updates); the index is -1 outside an OffloadOptimizer's slices."""
    if isinstance(optimizer, OffloadOptimizer):
        # Stand-ins for the state a disk tier keeps: which parameters, without reading their files.
        return [(index, p) for index, states, _ in state_layout_by_slice(optimizer) for p in states]
    return [(-1, p) for group in optimizer.param_groups for p in group["params"]]


def _loads_on_disk(optimizer: torch.optim.Optimizer, index: int, param: torch.Tensor, key: str, entry: Any) -> bool:
    """Whether a saved state tensor loads straight into the optimizer's disk tier, a slice at a time
    (Note: [Slice-by-slice load] in ``offload/checkpoint/slice_load_planner.py``)."""
    return (isinstance(optimizer, OffloadOptimizer) and isinstance(entry, TensorStorageMetadata) and index >= 0
            and optimizer._disk.loads_on_disk(index, param, key, entry.properties.dtype, entry.size))


def _named_groups(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> list[dict[str, Any]]:
    return [{**{k: v for k, v in group.items() if k != "params"}, "params": [names[id(p)] for p in group["params"]]}
            for group in optimizer.param_groups]


def _optimizer_class(optimizer: torch.optim.Optimizer) -> type:
    return optimizer.optimizer_class if isinstance(optimizer, OffloadOptimizer) else type(optimizer)


def _partition(model: nn.Module) -> list[list[str]] | None:
    return [list(names) for names in model.partition] if isinstance(model, OffloadModel) else None


def _describe(tensor: torch.Tensor) -> dict[str, Any]:
    return {"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch.")}


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state(), "python": random.getstate()}
    # Don't initialise CUDA by accident: a process that never used it has no state to keep.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _masters_on_disk(model: nn.Module, state: dict[str, Any]) -> dict[str, int]:
    """``model/<name>`` -> slice index, for the keys of ``state`` that hold tensors of the model
    whose masters are on disk (the model's children are its slices' layers, by name)."""
    if not isinstance(model, OffloadModel) or engine_of(model).master_files is None:
        return {}
    slice_of = {name: s.index for s in engine_of(model).slices if s.storage.masters_file is not None
                for name in s.names}
    found = {}
    for key, value in state.items():
        if key.startswith("model/") and isinstance(value, torch.Tensor):  # an object lives in no slice
            layer = key.removeprefix("model/").split(".", 1)[0]
            if layer in slice_of:
                found[key] = slice_of[layer]
    return found


def _master_files(model: nn.Module) -> Any:
    """The model's masters on disk (``MasterFiles``), or ``None``."""
    return engine_of(model).master_files if isinstance(model, OffloadModel) else None


def _masters_releaser(model: nn.Module) -> Any:
    """What a planner calls with a slice index once DCP is done with that slice's masters."""
    return engine_of(model).release_masters if isinstance(model, OffloadModel) else None


def _release_masters(model: nn.Module) -> None:
    """Masters on disk that DCP read or wrote go back to their files (Note: [Masters on disk])."""
    if isinstance(model, OffloadModel):
        engine_of(model).release_masters()
