"""Resume a training run from a checkpoint: :func:`load_checkpoint`.

It reads what :func:`~offload.save_checkpoint` wrote (Note: [Checkpoint layout] in
``contents.py``) into the model and the optimizer in place, on any number of ranks, once
``checks.py`` found the checkpoint whole and of this model and optimizer and
``checkpoint_files.py`` its data files' checksums right: nothing is loaded before. What it does not
hold: saving (``saver.py``), or which ranks take part (``ranks.py``).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import hashlib
import json
import os
import warnings
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from .checkpoint_files import CheckpointError, interrupt_behind, verify_checksums
from .checks import _check_arguments, _check_model, _check_optimizer, _listed, _read
from .commit import committed
from .contents import (HOOKED, _extra_key_to_load, _kept_parameters, _loaded_extra, _loads_on_disk,
                       _master_files, _masters_on_disk, _masters_releaser, _model_state, _parameter_names,
                       _release_masters, _restore_modules, _set_rng_state, _split_model_state)
from .framework_wrappers import unwrapped
from .quant_states import format_differences, is_packed, read_packed, set_unreached
from .ranks import _agreed, _group
from ..tiers.disk_tier import DiskTierError
from ..optimizer import OffloadOptimizer, load_beside_tier
from .slice_load_planner import SliceWritingLoadPlanner
from .wrapped_state import inner_destinations, loaded_value, saved_inner

#: What a load of ``None`` says: the path a first run gets from :func:`latest_checkpoint`.
NO_PATH = ("load_checkpoint() got None for the path: latest_checkpoint() returns None when nothing was saved in "
           "that directory yet. On a first run, start fresh: load only when it returns a path, as in "
           "`if (latest := latest_checkpoint(directory)) is not None: load_checkpoint(latest, model, optimizer)`.")


def load_checkpoint(path: str | os.PathLike[str], model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    *, process_group: Any = None) -> Any:
    """Load a checkpoint written by :func:`save_checkpoint` into ``model`` and ``optimizer``, in
    place, restore this rank's random number generators, and return the ``extra`` this rank saved.
    Call it on every rank.

    It loads on any number of ranks (each reads the optimizer state of the parameters it updates
    now), and into the plain model and a plain ``torch.optim`` optimizer as well as into an
    :class:`~offload.OffloadModel` and :class:`~offload.OffloadOptimizer`. Random number
    generators are restored only when the number of ranks is the one saved; on another number,
    every rank gets rank 0's ``extra`` (Note: [Extra per rank] in ``contents.py``). The optimizer's
    ``load_state_dict`` hooks run, its pre-hooks seeing what its ``state_dict()`` post-hooks added
    at save (Note: [State dict hooks in a checkpoint] in ``contents.py``). The model's tensors are
    loaded in place; its modules' extra states are set and their ``load_state_dict`` post-hooks
    run, as ``model.load_state_dict()`` does, but not their ``_load_from_state_dict`` or its
    pre-hooks (Note: [Module load hooks] in ``contents.py``). Into an
    OffloadOptimizer with a disk tier, the state the tier keeps is written to its files a slice at
    a time as it is read: the load holds about one slice of it in host memory.

    Args:
        path: a checkpoint directory (see :func:`latest_checkpoint`; not ``None``: start fresh
            when it returns that). When a save replacing it was killed between the commit's
            renames, the previous checkpoint is loaded from where it waits, beside it (Note: [Atomic save] in ``offload/checkpoint/commit.py``).
        model: the model to load into, built as the saved one was.
        optimizer: the optimizer to load into (the saved run's class), or ``None`` to skip it.
        process_group: as in :func:`save_checkpoint`.

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` or ``optimizer`` not an optimizer, or
            ``model.state_dict()`` holds a value that is neither a tensor nor a module's extra
            state.
        CheckpointError: ``path`` is ``None`` (what :func:`latest_checkpoint` returns before the
            first save: start fresh), no checkpoint at ``path`` (when ``latest`` names it, the
            message says it is gone and lists the checkpoints still there), an incomplete
            checkpoint (a missing or truncated file), a damaged one (an unreadable ``.metadata``
            or ``offload.json``, an ``offload.json`` that is not what a save writes, a data file
            whose CRC-32 differs from the one recorded at save: Note: [Checkpoint checksums] in
            ``offload/checkpoint/checkpoint_files.py``), one of a newer format (upgrade), or one of
            another model (names, shapes, dtypes, a 4-bit weight's format, its modules' extra
            states), slicing or optimizer
            (its class, its parameter groups); or, data parallel, the ranks were given different
            checkpoints (compared by their ``offload.json``): the message says what differs and
            what to do. Nothing was loaded: the model and optimizer are unchanged.
        DiskTierError: the optimizer's disk tier could not write part of the loaded state, raised
            once the load is done: that state is held in RAM (Note: [Disk tier failures] in
            ``offload/tiers/disk_tier.py``).
        torch.distributed.checkpoint.api.CheckpointException: (a ``BaseException``) a file could
            not be read although its checksum matched (a read error), or a checkpoint saved
            without checksums is damaged: the model and optimizer may be partly loaded. An OffloadOptimizer with a disk tier whose slices were partly written refuses
            to step or be saved until a load succeeds (Note: [Slice-by-slice load] in
            ``offload/checkpoint/slice_load_planner.py``).
        KeyboardInterrupt: (or ``SystemExit``) an interrupt during the read, raised as itself
            (not DCP's wrapper), with the note a disk tier's partly loaded state adds; the model
            and optimizer may be partly loaded, as above: load again.

    Warns:
        UserWarning: on another number of ranks than saved the checkpoint, when its ranks saved
            different ``extra`` values: the message names them and says rank 0's is returned.
    """
    model, optimizer = unwrapped(model, optimizer)  # Fabric's wrappers (framework_wrappers.py)
    _check_arguments("load_checkpoint", model, optimizer)
    group, rank, world_size = _group(model, optimizer, process_group)
    files = _master_files(model)
    # A write-back that failed, not raised yet, is latched, not raised, once the checks pass (the load
    # replaces what it may revert); a refused load leaves it to be raised.
    with files.replacing() if files is not None else contextlib.nullcontext():
        # Each rank checks what it reads before any collective; a refusal on one is said on every rank,
        # and so are checkpoints that differ between ranks, which would resume each from another step.
        path, extra_read, metadata, model_state, extra_states, names, groups, state, wanted, on_disk, _ = _agreed(
            group, lambda: _checked_load(path, model, optimizer, rank, world_size), "loaded",
            same=lambda loaded: loaded[-1], differ=functools.partial(_other_checkpoints, path))
        packed = _check_packed(path, metadata, model_state, state, group)
    rng_key = f"rng/{rank}"
    stored = _read_data(path, model, optimizer, state, on_disk, group)
    set_unreached(model, packed, state)  # the model whole before anything else can raise

    def finish() -> DiskTierError | None:
        # Before the generators are restored: a hook that draws random numbers draws them as after
        # model.load_state_dict(), before the caller's own restore.
        _restore_modules(model, {name: state[f"model/{name}"] for name in extra_states})
        failure: DiskTierError | None = None
        if optimizer is not None:
            try:
                _load_optimizer(optimizer, groups, names, state, wanted, stored)
            except DiskTierError as error:
                failure = error  # the state is loaded, part of it held in RAM: finish the load, then raise
        if rng_key in state:
            _set_rng_state(state[rng_key])
        return failure

    # What runs here is each rank's own (hooks, set_extra_state, the optimizer's load_state_dict):
    # one that raises on one rank is said on every rank, as a refusal before the read is.
    try:
        failure = _agreed(group, finish, others=(
            "the load did not finish on every rank: the model holds the checkpoint's tensors, but the modules' "
            "load hooks, the optimizer and the random generators may not have been loaded on every rank. Load "
            "again on every rank once the rank that raised can: it said"))
    finally:
        _release_masters(model)
    if failure is not None:
        raise failure
    saved_format, extra_key, not_own = extra_read
    if not_own is not None:
        warnings.warn(not_own, stacklevel=2)
    return _loaded_extra(state[extra_key], saved_format)


def _checked_load(path: str | os.PathLike[str] | None, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                  rank: int, world_size: int) -> tuple[Any, ...]:
    """What this rank loads, checked before anything is: the checkpoint directory; its format, the
    key of the ``extra`` this rank reads and what the load warns of it (``None``: nothing; Note:
    [Extra per rank] in ``contents.py``); its metadata, the model's tensors, its modules' extra
    states' names, parameter names, the optimizer's groups, DCP's state to fill and, as
    :func:`_state_to_load` says, the optimizer's keys and what its disk tier keeps; last, which
    checkpoint it is (:func:`_identity`).

    Raises:
        CheckpointError: as :func:`load_checkpoint` says, before anything is loaded.
    """
    if path is None:
        raise CheckpointError(NO_PATH)
    path = committed(Path(path))
    info, metadata = _read(path)
    model_state, extra_states = _split_model_state(model, _model_state(model))
    _check_model(path, info, model, model_state, extra_states)
    names = _parameter_names(model)
    groups = None if optimizer is None else _check_optimizer(path, info, metadata, optimizer, names)
    state, wanted, on_disk = _state_to_load(model_state, optimizer, names, metadata)
    for name in extra_states:  # Note: [Module load hooks]
        state[f"model/{name}"] = _destination(metadata.state_dict_metadata[f"model/{name}"], None)
    rng_key = f"rng/{rank}"
    if info["world_size"] == world_size and rng_key in metadata.state_dict_metadata:
        state[rng_key] = None
    extra_key, others = _extra_key_to_load(metadata.state_dict_metadata, rank, info["world_size"] == world_size)
    # Before format 3, a bare tensor as extra was saved as tensor data (Note: [Checkpoint layout]).
    saved_extra = metadata.state_dict_metadata.get(extra_key)
    state[extra_key] = _destination(saved_extra, None) if isinstance(saved_extra, TensorStorageMetadata) else None
    # The files this rank reads, checked whole before anything is loaded (Note: [Checkpoint checksums]).
    verify_checksums(path, info.get("crc32"), {storage.relative_path for index, storage in
                                               (metadata.storage_data or {}).items() if index.fqn in state})
    not_own = _rank_0s_extra(path, info["world_size"], world_size, others) if others else None
    return (path, (info["format"], extra_key, not_own), metadata, model_state, list(extra_states), names, groups,
            state, wanted, on_disk, _identity(path, info))


def _identity(path: Path, info: dict[str, Any]) -> tuple[str, str]:
    """What the ranks of a load compare, and name when it differs: a digest of the checkpoint's
    ``offload.json`` (its save time and every data file's checksum: a copy elsewhere is the same
    checkpoint, a path that names another on each rank's filesystem is not), and its resolved
    path and save time."""
    digest = hashlib.sha256(json.dumps(info, sort_keys=True).encode()).hexdigest()
    saved_ns = info.get("saved_ns")
    when = (datetime.datetime.fromtimestamp(saved_ns / 1e9, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")
            + " UTC" if isinstance(saved_ns, int) else "at a time it does not record")
    return digest, f"{path.resolve()}, saved {when}"


def _rank_0s_extra(path: Path, saved: int, world_size: int, others: list[str]) -> str:
    """What a load of ``path``, saved on ``saved`` ranks, warns on ``world_size`` ranks when the
    saved ranks ``others`` passed another ``extra`` than rank 0 (Note: [Extra per rank])."""
    ranks = f"rank {others[0]}" if len(others) == 1 else f"ranks {', '.join(others[:-1])} and {others[-1]}"
    return (f"checkpoint {path} was saved on {saved} ranks whose extra values differ ({ranks} saved another value "
            f"than rank 0), and is loaded on {world_size}: load_checkpoint returns rank 0's extra on every rank. "
            "Derive what is per rank in it (a data position, a generator's state) for this number of ranks, or "
            f"resume on {saved} ranks to get each rank's own.")


def _other_checkpoints(path: Any, listing: str) -> str:
    """Why a load of ``path`` is refused when the ranks' checkpoints differ (``listing``)."""
    return (f"cannot load checkpoint {path}: the ranks were given different checkpoints ({listing}). Nothing was "
            "loaded: each rank would resume from another step, and the next update would mix them. Pass the same "
            "checkpoint on every rank (one directory they all see, or identical copies of it).")


def _check_packed(path: Path, metadata: Metadata, model_state: dict[str, torch.Tensor], state: dict[str, Any],
                  group: Any) -> dict[str, dict[str, Any]]:
    """The 4-bit weights' packed states, read and their formats checked before anything is loaded,
    and taken out of what the load reads (Note: [Packed quantisation state] in ``quant_states.py``)."""
    names = [name for name in model_state if is_packed(name)]
    try:
        saved = read_packed(path, metadata, names, group)
    except BaseException as error:  # DCP's CheckpointException is a BaseException
        _raise_interrupt_behind(error)
        raise
    differences = format_differences(saved, model_state)
    if differences:
        raise CheckpointError(f"checkpoint {path} holds another model: " + _listed(differences))
    for name in names:
        del state[f"model/{name}"]
    return saved


def _raise_interrupt_behind(error: BaseException, note: str | None = None) -> None:
    """Raise the interrupt (Ctrl-C, SIGTERM: KeyboardInterrupt, SystemExit) that DCP caught while
    it read and wrapped in ``error``, with ``note``, as the save does: a caller's ``except
    KeyboardInterrupt`` (``offload-finetune``'s one line) must see it. Returns when there is none."""
    interrupt = interrupt_behind(error)
    if interrupt is None or interrupt is error:
        return  # a read error, or an interrupt DCP did not wrap: the caller raises it as it is
    if note is not None:
        interrupt.add_note(note)
    raise interrupt from None


def _state_to_load(model_state: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer | None,
                   names: dict[int, str], metadata: Metadata
                   ) -> tuple[dict[str, Any], dict[str, list[str]], dict[str, tuple[int, torch.Tensor, str]]]:
    """What DCP loads into (the model's tensors themselves, and where the optimizer state this
    rank keeps goes); per parameter name, the keys of its state loaded through
    ``load_state_dict()``; and, by key, the state a disk tier keeps: where the planner loads it
    (slice index, parameter, state key)."""
    state: dict[str, Any] = {f"model/{name}": tensor for name, tensor in model_state.items()}
    wanted: dict[str, list[str]] = {}  # parameter name -> its state's keys, for the state this rank keeps
    on_disk: dict[str, tuple[int, torch.Tensor, str]] = {}  # key -> where the planner loads it
    if optimizer is not None:
        saved = _saved_optimizer_state(metadata)
        wrapped = saved_inner(metadata)
        for slice_index, param in _kept_parameters(optimizer):
            name = names[id(param)]
            held = optimizer.state.get(param, {})
            for key, entry in saved.get(name, {}).items():
                entry_key = f"optim/state/{name}/{key}"
                if _loads_on_disk(optimizer, slice_index, param, key, entry):
                    # A stand-in: the planner loads it into the disk tier, a slice at a time.
                    state[entry_key] = torch.zeros((), dtype=entry.properties.dtype).expand(entry.size)
                    on_disk[entry_key] = (slice_index, param, key)
                    continue
                wanted.setdefault(name, []).append(key)
                state[entry_key] = _destination(entry, held.get(key))
                if entry_key in wrapped:  # Note: [Wrapped state]
                    state.update(inner_destinations(entry_key, wrapped[entry_key], held.get(key), _destination))
        state["optim/param_groups"] = None
        if HOOKED in metadata.state_dict_metadata:  # Note: [State dict hooks in a checkpoint]
            state[HOOKED] = None
    return state, wanted, on_disk


def _saved_optimizer_state(metadata: Metadata) -> dict[str, dict[str, Any]]:
    saved: dict[str, dict[str, Any]] = {}
    for key, entry in metadata.state_dict_metadata.items():
        if key.startswith("optim/state/"):
            name, _, state_key = key.removeprefix("optim/state/").rpartition("/")
            saved.setdefault(name, {})[state_key] = entry
    return saved


def _destination(entry: Any, held: Any) -> Any:
    """Where DCP loads one saved value: the state tensor the optimizer holds when it has the saved
    shape and dtype (no second copy of the state while loading), else a new tensor, or ``None``
    for an object."""
    if isinstance(entry, TensorStorageMetadata):
        if (isinstance(held, torch.Tensor) and held.shape == entry.size and held.dtype == entry.properties.dtype
                and held.device.type == "cpu"):
            return held
        return torch.empty(entry.size, dtype=entry.properties.dtype)
    assert isinstance(entry, BytesStorageMetadata)
    return None


def _read_data(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, state: dict[str, Any],
               on_disk: dict[str, tuple[int, torch.Tensor, str]], group: Any) -> Collection[int] | None:
    """Load ``state`` from ``path`` through DCP, slice by slice where a disk tier or masters on disk
    keep part of it (Note: [Slice-by-slice load]); the slices loaded into the disk tier's files,
    or ``None`` when nothing was loaded into a tier.

    Raises:
        CheckpointException: as :func:`load_checkpoint` says; a disk tier partly loaded refuses to
            step or be saved until a load succeeds.
    """
    # Unflattened, objects (groups, generators, extra) are loaded into this very dict.
    planner: DefaultLoadPlanner = DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    tiered = bool(on_disk) and isinstance(optimizer, OffloadOptimizer)
    masters = _masters_on_disk(model, state)
    if tiered or masters:
        planner = SliceWritingLoadPlanner(optimizer._disk.open_slice_load if tiered else None,  # type: ignore[union-attr]
                                          on_disk if tiered else {}, masters,
                                          _masters_releaser(model))
    try:
        dcp.load(state, storage_reader=FileSystemReader(path), planner=planner, process_group=group,
                 no_dist=group is None)
        if isinstance(planner, SliceWritingLoadPlanner):
            planner.check_complete()
    except BaseException as error:  # DCP's CheckpointException is a BaseException
        note = None
        if tiered:
            # Slices already written hold the checkpoint's state, the others their own, and the
            # scalars (read first, in place) may be either: say so, and have the optimizer refuse
            # to step or save that mix until a load succeeds. Every rank refuses, whether or not
            # it wrote a slice yet: a rank that went on would wait for the others in its next
            # collective forever.
            assert isinstance(optimizer, OffloadOptimizer) and optimizer._tier is not None
            mix = optimizer._tier.load_failed(planner.stored, f"load_checkpoint({str(path)!r})")
            note = (f"offload: the optimizer's state is partly loaded: {mix}. It refuses to step or be saved until "
                    "a load succeeds: load a checkpoint again.")
            error.add_note(note)
        _raise_interrupt_behind(error, note)
        raise
    finally:
        if isinstance(planner, SliceWritingLoadPlanner):
            planner.release()
    if not tiered:
        return None
    assert isinstance(planner, SliceWritingLoadPlanner)
    return planner.stored


def _load_optimizer(optimizer: torch.optim.Optimizer, groups: list[list[torch.Tensor]], names: dict[int, str],
                    state: dict[str, Any], wanted: dict[str, list[str]], stored: Collection[int] | None) -> None:
    """Load the optimizer state DCP read into ``state`` through ``load_state_dict()``, beside the
    slices ``stored`` in the disk tier's files already (``None``: no tier took part).

    Raises:
        DiskTierError: the state is loaded, part of it held in RAM.
    """
    # Through load_state_dict, so that the optimizer casts and places its state as it does
    # when the plain torch.optim optimizer loads it (the tensors loaded into a disk tier were
    # cast by the same function: Note: [Slice-by-slice load] in offload/checkpoint/slice_load_planner.py).
    params = [p for params in groups for p in params]
    index = {names[id(p)]: k for k, p in enumerate(params)}
    loaded = {
        "state": {index[name]: {key: loaded_value(f"optim/state/{name}/{key}", state) for key in keys}
                  for name, keys in wanted.items()},
        "param_groups": [{**{k: v for k, v in hyper.items() if k != "params"},
                          "params": [index[name] for name in hyper["params"]]}
                         for hyper in state["optim/param_groups"]],
        # For the load_state_dict() pre-hooks (Note: [State dict hooks in a checkpoint]).
        **(state.get(HOOKED) or {}),
    }
    if stored is not None:
        assert isinstance(optimizer, OffloadOptimizer)
        load_beside_tier(optimizer, loaded, stored)
    else:
        optimizer.load_state_dict(loaded)
