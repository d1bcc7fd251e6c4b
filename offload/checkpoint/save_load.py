"""Save a training run and resume it exactly: :func:`save_checkpoint`, :func:`load_checkpoint`,
:func:`latest_checkpoint`.

A checkpoint is a directory in the format of ``torch.distributed.checkpoint`` (DCP), the one
torchtitan and FSDP use, plus a small ``offload.json`` that says what was saved. It holds the
model's ``state_dict()``, the optimizer's state and hyperparameters, every rank's random number
generators and whatever the caller passes as ``extra`` (a scheduler's, a ``GradScaler``'s, the
data position). It does not hold gradients: save between steps. This file does not export to
Hugging Face (``save_pretrained`` does) and does not decide when to save (the training loop does).

Note: [Checkpoint layout]
    Keys of the DCP state dict, by name, so that a checkpoint loads on any number of ranks and
    into the plain model and optimizer:

    ``model/<name>``
        each entry of ``model.state_dict()`` (parameters and persistent buffers); every rank
        offers them and DCP writes each once.
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
        through the optimizer's ``load_state_dict()``.
    ``optim/param_groups``
        the groups' hyperparameters (learning rate as the scheduler left it...), each group's
        parameters by name.
    ``rng/<rank>``
        that rank's CPU and CUDA generators and Python's ``random``: dropout draws the same
        numbers after a resume. Restored only when the number of ranks is unchanged.
    ``extra``
        the caller's ``extra``, the same on every rank.

    ``offload.json`` holds the names, shapes and dtypes of the model's tensors, the slicing, the
    optimizer class, its groups' parameters by name and the number of ranks: what
    :func:`load_checkpoint` checks before it writes anything.

A save is atomic: it either returns, the checkpoint whole under its name and ``latest`` naming
it, or raises with nothing new visible (Note: [Atomic save] in ``offload/checkpoint/commit.py``).
Before anything is written, the arguments are checked (``extra`` pickles), the target must be a
checkpoint, an empty directory or absent, and the filesystem must have room for the tensors and
their headers (a lower bound; every rank decides from the same gathered figures). A save that fails
after that (a disk that fills up, any error DCP gathers) deletes what it wrote and raises
:class:`CheckpointError` on every rank.
"""

from __future__ import annotations

import functools
import json
import os
import random
import shutil
import time
import warnings
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from .checkpoint_files import (CheckpointError, ChecksummingFileSystem, disk_full,
                               failure_text, free_bytes, pickled_size, verify_checksums)
from .commit import INFO_FILE, LATEST_FILE, HalfCommitted, commit, partial_directory, prepare, tidy
from ..tiers.disk_tier import DiskTierError, size_text
from ..model import OffloadModel, engine_of
from ..optimizer import OffloadOptimizer
from .slice_load_planner import SliceWritingLoadPlanner
from .slice_save_planner import SliceReadingSavePlanner
from ..streams.host_storage import dense_stride

# DCP warns when it works without a process group; for a single process that is the plan, not an
# accident. One filter, added once at import, for the words DCP uses: a ``warnings.catch_warnings()``
# around each save would, on leaving, reset every module's once-registry, so every warning a user
# had already seen (a deprecation, say) would print again after each checkpoint.
warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled, unavailable or uninitialized, "
                        r"assuming the intent is to (save|load) in a single process")

FORMAT = 1
#: Bytes a save counts for each item's header in its data file, at least (a lower bound: a save
#: is refused only when it cannot fit).
ITEM_HEADER = 1024
STRAY_PARAMETER = ("the optimizer steps a parameter that is not in the model; a checkpoint names optimizer state "
                   "after the model's parameters: save such parameters in extra and give them their own optimizer")


# -- saving ----------------------------------------------------------------------------------------


def save_checkpoint(path: str | os.PathLike[str], model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    *, extra: dict[str, Any] | None = None, keep_last: int | None = None,
                    process_group: Any = None) -> Path:
    """Write the model, the optimizer, the random number generators and ``extra`` into the
    checkpoint directory ``path`` and point ``latest`` beside it at it, as one event: when it
    returns, both are done; when it raises, nothing new is visible and the previous checkpoint is
    intact (Note: [Atomic save] in ``offload/checkpoint/commit.py``). Call it on every rank,
    between steps; pending host updates finish first.

    Data parallel, each rank writes the optimizer state it owns, in parallel, and the parameters
    are written once; nothing is gathered. DCP reads the host copies and the optimizer state where
    they are: a save adds next to no host memory (``docs/checkpoints.md`` has the figures).

    Args:
        path: the checkpoint directory to create; an earlier checkpoint there is replaced, and
            anything else there (a file, a directory of other files) is refused. Its parent is
            created.
        model: an :class:`~offload.OffloadModel` or any ``nn.Module``.
        optimizer: an :class:`~offload.OffloadOptimizer`, any ``torch.optim`` optimizer over the
            model's parameters, or ``None``.
        extra: picklable values to save with it (a scheduler's and a ``GradScaler``'s
            ``state_dict()``, the step, the data position), the same on every rank;
            :func:`load_checkpoint` returns it.
        keep_last: keep only this many checkpoints beside ``path`` (the newest), or all (``None``).
        process_group: the group that saves together; default: the optimizer's, else the
            model's, else the default group when ``torch.distributed`` is initialised.

    Returns:
        ``path``.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, ``optimizer`` not an optimizer, or ``extra``
            cannot be pickled (checked before anything is written).
        ValueError: a bad ``keep_last``, or the optimizer steps a parameter the model lacks.
        FileExistsError: ``path`` is a file, or a directory of files that is not a checkpoint.
        CheckpointError: the filesystem has less room than the save needs (checked before
            anything is written), or the save failed (a full disk says so): what it wrote is
            removed, ``latest`` is unchanged and the previous checkpoint is intact.

    Warns:
        UserWarning: on rank 0, the checkpoint is saved and ``latest`` names it, but what follows
            failed: deleting the checkpoint it replaced, removing the oldest for ``keep_last``
            (the next save tries again), or syncing the directory. The message says which.

    Example::

        >>> save_checkpoint(f"ckpt/step-{step}", model, optimizer,
        ...                 extra={"step": step, "scheduler": scheduler.state_dict()}, keep_last=3)
    """
    extra_nbytes = _check_save_arguments(model, optimizer, extra, keep_last)
    path = Path(path)
    _check_target(path)
    group, rank, world_size = _group(model, optimizer, process_group)
    names = _parameter_names(model)
    state, on_disk = _state_to_save(model, optimizer, names, rank, extra)
    needed = _check_room(group, rank, path, state, extra_nbytes, optimizer)
    partial = partial_directory(path)
    _on_rank_0(group, rank, functools.partial(prepare, path), lambda error: _save_failure(path, error, [], needed))
    checksums = _gathered(group, _write_data(path, partial, model, optimizer, state, on_disk, group, rank, needed))
    info = functools.partial(_info, model, optimizer, names, world_size, checksums)
    for problem in _commit_saved(path, info, keep_last, group, rank, needed):
        warnings.warn(problem, stacklevel=2)
    return path


def _info(model: nn.Module, optimizer: torch.optim.Optimizer | None, names: dict[int, str], world_size: int,
          checksums: dict[str, int]) -> dict[str, Any]:
    """What ``offload.json`` says of a checkpoint (Note: [Checkpoint layout])."""
    return {"format": FORMAT, "world_size": world_size, "saved_ns": time.time_ns(),
            "tensors": {name: _describe(t) for name, t in _model_state(model).items()},
            "partition": _partition(model),
            "optimizer": None if optimizer is None else _optimizer_class(optimizer).__name__,
            "groups": None if optimizer is None else [g["params"] for g in _named_groups(optimizer, names)],
            "crc32": checksums}


def _check_save_arguments(model: Any, optimizer: Any, extra: Any, keep_last: Any) -> int:
    """Raise what :func:`save_checkpoint` says of its arguments; the pickled size of ``extra``."""
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"keep_last must be a positive int or None, got {keep_last!r}")
    _check_arguments("save_checkpoint", model, optimizer)
    try:
        return pickled_size(extra)  # before anything is written: DCP would fail half way
    except Exception as error:
        raise TypeError(f"save_checkpoint(): extra must be picklable (DCP writes it with torch.save): {error}. "
                        "Pass state_dict()s and plain values, not the objects themselves.") from error


def _state_to_save(model: nn.Module, optimizer: torch.optim.Optimizer | None, names: dict[int, str], rank: int,
                   extra: Any) -> tuple[dict[str, Any], dict[str, tuple[int, torch.Tensor, str]]]:
    """What DCP saves (Note: [Checkpoint layout]), and, by key, the optimizer state a disk tier
    keeps: where the planner reads it (slice index, parameter, state key).

    Raises:
        ValueError: the optimizer steps a parameter the model lacks.
    """
    state: dict[str, Any] = {f"model/{name}": _own_storage(tensor) for name, tensor in _model_state(model).items()}
    on_disk: dict[str, tuple[int, torch.Tensor, str]] = {}  # key -> where the planner reads it
    if optimizer is not None:
        if not _steps_only(optimizer, names):
            raise ValueError(STRAY_PARAMETER)
        if isinstance(optimizer, OffloadOptimizer):
            optimizer._disk.check_loaded("save_checkpoint()")
        for index, param, param_state, disk_keys in _optimizer_state(optimizer):
            for key, value in param_state.items():
                entry = f"optim/state/{names[id(param)]}/{key}"
                state[entry] = value if key in disk_keys else _own_storage(value)
                if key in disk_keys:
                    on_disk[entry] = (index, param, key)
        state["optim/param_groups"] = _named_groups(optimizer, names)
    state[f"rng/{rank}"] = _rng_state()
    state["extra"] = extra
    return state, on_disk


def _write_data(path: Path, partial: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                state: dict[str, Any], on_disk: dict[str, tuple[int, torch.Tensor, str]], group: Any, rank: int,
                needed: int) -> dict[str, int]:
    """Write ``state`` into ``partial`` through DCP, slice by slice where a disk tier or masters on
    disk keep part of it (Note: [Slice-by-slice save]); this rank's data files' checksums.

    Raises:
        CheckpointError: the write failed; ``partial`` is removed.
    """
    planner: DefaultSavePlanner = DefaultSavePlanner(flatten_state_dict=False)
    writer = FileSystemWriter(partial, sync_files=True)
    masters = _masters_on_disk(model, state)
    if (on_disk and isinstance(optimizer, OffloadOptimizer)) or masters:
        read_slice = optimizer._disk.slice_state if on_disk and isinstance(optimizer, OffloadOptimizer) else None
        planner = SliceReadingSavePlanner(read_slice, on_disk, masters,
                                          _masters_releaser(model))
        # One thread, nothing resolved ahead: each item's data is asked for once the previous one
        # is written (Note: [Slice-by-slice save]).
        writer = FileSystemWriter(partial, sync_files=True, thread_count=1, per_thread_copy_ahead=0)
    # Each data file is summed as it is written (Note: [Checkpoint checksums]).
    files = writer.fs = ChecksummingFileSystem()
    try:
        dcp.save(state, storage_writer=writer, planner=planner, process_group=group, no_dist=group is None)
        _release_masters(model)
    except BaseException as error:  # DCP's CheckpointException is a BaseException
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)  # every rank is past its writes: DCP gathered them
        if not isinstance(error, (Exception, CheckpointException)):
            raise  # KeyboardInterrupt, SystemExit
        raise CheckpointError(_save_failure(path, error, files.write_errors, needed)) from error
    finally:
        if isinstance(planner, SliceReadingSavePlanner):
            planner.release()
    return files.checksums


def _commit_saved(path: Path, info: Callable[[], dict[str, Any]], keep_last: int | None, group: Any, rank: int,
                  needed: int) -> list[str]:
    """On rank 0, commit the checkpoint written for ``path``, ``info()`` as its ``offload.json``,
    and tidy after it (Note: [Atomic save] in ``offload/checkpoint/commit.py``); what tidying
    could not do, one sentence each (none on the other ranks).

    Raises:
        CheckpointError: on every rank, when the commit failed on rank 0: nothing new is visible
            (or, should undoing its renames fail too, the message says what is where).
    """
    problems: list[str] = []

    def work() -> None:
        commit(path, lambda: json.dumps(info(), indent=1).encode())
        problems.extend(tidy(path, keep_last))

    def failure(error: BaseException) -> str:
        return str(error) if isinstance(error, HalfCommitted) else _save_failure(path, error, [], needed)

    _on_rank_0(group, rank, work, failure)
    return problems


def _on_rank_0(group: Any, rank: int, work: Any, failure: Any) -> None:
    """Run ``work`` on rank 0; on every rank, raise :class:`CheckpointError` with ``failure(error)``
    when it raised an ``Exception`` (so that no rank waits for one that gave up). A barrier too."""
    message, raised = None, None
    if rank == 0:
        try:
            work()
        except Exception as error:
            message, raised = failure(error), error
    if group is not None:
        message = _gathered_list(group, message)[0]
    if message is not None:
        raise CheckpointError(message) from raised


def _check_arguments(function: str, model: Any, optimizer: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{function}() takes the model (an nn.Module: the OffloadModel) after the path, got "
                        f"{type(model).__name__} {model!r:.60}; call {function}(path, model, optimizer)")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{function}(): optimizer must be a torch.optim.Optimizer (an OffloadOptimizer) or None, got "
                        f"{type(optimizer).__name__} {optimizer!r:.60}")


def _check_target(path: Path) -> None:
    """Refuse, before anything is written, a ``path`` that holds something other than a checkpoint:
    a save replaces what is there."""
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        raise FileExistsError(f"cannot save a checkpoint at {path}: it is a file, not a checkpoint directory. Choose "
                              "another path, or remove the file first.")
    if path.is_dir() and not (path / INFO_FILE).is_file() and any(path.iterdir()):
        raise FileExistsError(
            f"cannot save a checkpoint at {path}: it is a directory that holds files but no {INFO_FILE}, so it is "
            "not a checkpoint, and a save would replace it with everything in it. Choose another path (a new or "
            "empty directory, or an earlier checkpoint to replace), or move those files away first.")


def _check_room(group: Any, rank: int, path: Path, state: dict[str, Any], extra_nbytes: int,
                optimizer: torch.optim.Optimizer | None) -> int:
    """Raise :class:`CheckpointError` before anything is written when the filesystem has less room
    than the save needs; returns the bytes needed. Every rank decides from the same figures
    (rank 0's free space, every rank's share), so that none refuses while another writes."""
    # Each item also takes a header in its file (torch.save's archive: over a kilobyte each).
    model_nbytes = _tensor_bytes({k: v for k, v in state.items() if not k.startswith("optim/")})
    optim_nbytes = _tensor_bytes({k: v for k, v in state.items() if k.startswith("optim/")})
    directory = _existing_ancestor(path.parent)
    free = free_bytes(directory) if rank == 0 else None
    shares = _gathered_list(group, (model_nbytes + extra_nbytes, optim_nbytes, free))
    # Parameters are offered by every rank and written once; sharded, each rank writes its own
    # optimizer state, unsharded the same state once. A lower bound: the files add their headers.
    sharded = isinstance(optimizer, OffloadOptimizer) and optimizer._collectives is not None
    needed = max(s[0] for s in shares) + (sum if sharded else max)(s[1] for s in shares)
    free = shares[0][2]
    if free < needed:
        raise CheckpointError(
            f"not enough room to save checkpoint {path}: it needs at least {size_text(needed)}, the filesystem of "
            f"{directory} has {size_text(free)} free. Nothing was written; the previous checkpoint is intact. Free "
            "space (or save elsewhere) and save again.")
    return needed


def _tensor_bytes(state: dict[str, Any]) -> int:
    return sum(ITEM_HEADER + (v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0)
               for v in state.values())


def _existing_ancestor(directory: Path) -> Path:
    directory = directory.absolute()
    while not directory.exists() and directory != directory.parent:
        directory = directory.parent
    return directory


def _gathered_list(group: Any, value: Any) -> list[Any]:
    """``value`` of every rank of ``group``, in rank order (``[value]`` for one process)."""
    if group is None:
        return [value]
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, value, group=group)
    return everyone


def _gathered(group: Any, checksums: dict[str, int]) -> dict[str, int]:
    """Every rank's data files' checksums (each rank writes files of its own names)."""
    merged: dict[str, int] = {}
    for part in _gathered_list(group, checksums):
        merged.update(part)
    return merged


def _save_failure(path: Path, error: BaseException, write_errors: list[OSError], needed: int) -> str:
    previous = latest_checkpoint(path.parent)
    if path.is_dir():
        intact = f"checkpoint {path} is intact (it was not replaced)"
    elif previous is not None and previous.is_dir():
        intact = f"the previous checkpoint, {previous}, is intact"
    else:
        intact = "no earlier checkpoint was touched"
    if disk_full(error, write_errors):
        return (f"could not save checkpoint {path}: the disk filled up while writing it (the filesystem of "
                f"{path.parent} has {size_text(free_bytes(path.parent))} free once the partial save was removed; the "
                f"save needs more than that: at least {size_text(needed)} for its tensors and their headers alone). "
                f"Nothing of it was kept and {intact}. Free space (or save elsewhere) and save again.")
    return (f"could not save checkpoint {path}: {failure_text(error)}. Nothing of it was kept and {intact}.")


def latest_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    """The checkpoint the ``latest`` file in ``directory`` names (the last one saved there), or
    ``None`` when nothing was saved there yet."""
    pointer = Path(directory) / LATEST_FILE
    try:
        name = pointer.read_text().strip()
    except FileNotFoundError:
        return None
    return Path(directory) / name


# -- loading ---------------------------------------------------------------------------------------


def load_checkpoint(path: str | os.PathLike[str], model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    *, process_group: Any = None) -> Any:
    """Load a checkpoint written by :func:`save_checkpoint` into ``model`` and ``optimizer``, in
    place, restore this rank's random number generators, and return the ``extra`` it was saved
    with. Call it on every rank.

    It loads on any number of ranks (each reads the optimizer state of the parameters it updates
    now), and into the plain model and a plain ``torch.optim`` optimizer as well as into an
    :class:`~offload.OffloadModel` and :class:`~offload.OffloadOptimizer`. Random number
    generators are restored only when the number of ranks is the one saved. Into an
    OffloadOptimizer with a disk tier, the state the tier keeps is written to its files a slice at
    a time as it is read: the load holds about one slice of it in host memory.

    Args:
        path: a checkpoint directory (see :func:`latest_checkpoint`).
        model: the model to load into, built as the saved one was.
        optimizer: the optimizer to load into (the saved run's class), or ``None`` to skip it.
        process_group: as in :func:`save_checkpoint`.

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` or ``optimizer`` not an optimizer.
        CheckpointError: an incomplete checkpoint (a missing or truncated file), a damaged one (an
            unreadable ``.metadata`` or ``offload.json``, a data file whose CRC-32 differs from the
            one recorded at save: Note: [Checkpoint checksums] in ``offload/checkpoint/checkpoint_files.py``),
            or one of another model (names, shapes, dtypes), slicing or optimizer; the message
            says what differs. Nothing was loaded: the model and optimizer are unchanged.
        DiskTierError: the optimizer's disk tier could not write part of the loaded state, raised
            once the load is done: that state is held in RAM (Note: [Disk tier failures] in
            ``offload/tiers/disk_tier.py``).
        torch.distributed.checkpoint.api.CheckpointException: (a ``BaseException``) a file could
            not be read although its checksum matched (a read error), or a checkpoint saved
            without checksums is damaged: the model and optimizer may be partly loaded. An OffloadOptimizer with a disk tier whose slices were partly written refuses
            to step or be saved until a load succeeds (Note: [Slice-by-slice load] in
            ``offload/checkpoint/slice_load_planner.py``).
    """
    _check_arguments("load_checkpoint", model, optimizer)
    path = Path(path)
    info, metadata = _read(path)
    model_state = _model_state(model)
    _check_model(path, info, model, model_state)
    names = _parameter_names(model)
    if optimizer is not None:
        groups = _check_optimizer(path, info, metadata, optimizer, names)
    group, rank, world_size = _group(model, optimizer, process_group)

    state, wanted, on_disk = _state_to_load(model_state, optimizer, names, metadata)
    rng_key = f"rng/{rank}"
    if info["world_size"] == world_size and rng_key in metadata.state_dict_metadata:
        state[rng_key] = None
    state["extra"] = None
    # The files this rank reads, checked whole before anything is loaded (Note: [Checkpoint checksums]).
    verify_checksums(path, info.get("crc32"), {storage.relative_path for index, storage in
                                               (metadata.storage_data or {}).items() if index.fqn in state})
    stored = _read_data(path, model, optimizer, state, on_disk, group)
    failure: DiskTierError | None = None
    if optimizer is not None:
        try:
            _load_optimizer(optimizer, groups, names, state, wanted, stored)
        except DiskTierError as error:
            failure = error  # the state is loaded, part of it held in RAM: finish the load, then raise
    if rng_key in state:
        _set_rng_state(state[rng_key])
    _release_masters(model)
    _barrier(group)
    if failure is not None:
        raise failure
    return state["extra"]


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
        state["optim/param_groups"] = None
    return state, wanted, on_disk


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
        planner = SliceWritingLoadPlanner(optimizer._open_slice_load if tiered else None,  # type: ignore[union-attr]
                                          on_disk if tiered else {}, masters,
                                          _masters_releaser(model))
    try:
        dcp.load(state, storage_reader=FileSystemReader(path), planner=planner, process_group=group,
                 no_dist=group is None)
        if isinstance(planner, SliceWritingLoadPlanner):
            planner.check_complete()
    except BaseException as error:  # DCP's CheckpointException is a BaseException
        if tiered:
            # Slices already written hold the checkpoint's state, the others their own, and the
            # scalars (read first, in place) may be either: say so, and have the optimizer refuse
            # to step or save that mix until a load succeeds. Every rank refuses, whether or not
            # it wrote a slice yet: a rank that went on would wait for the others in its next
            # collective forever.
            assert isinstance(optimizer, OffloadOptimizer) and optimizer._tier is not None
            mix = optimizer._tier.load_failed(planner.stored, f"load_checkpoint({str(path)!r})")
            error.add_note(f"offload: the optimizer's state is partly loaded: {mix}. It refuses to step or be "
                           "saved until a load succeeds: load a checkpoint again.")
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
        "state": {index[name]: {key: state[f"optim/state/{name}/{key}"] for key in keys}
                  for name, keys in wanted.items()},
        "param_groups": [{**{k: v for k, v in hyper.items() if k != "params"},
                          "params": [index[name] for name in hyper["params"]]}
                         for hyper in state["optim/param_groups"]],
    }
    if stored is not None:
        assert isinstance(optimizer, OffloadOptimizer)
        optimizer._load_state_dict_beside_tier(loaded, stored)
    else:
        optimizer.load_state_dict(loaded)


def _masters_on_disk(model: nn.Module, state: dict[str, Any]) -> dict[str, int]:
    """``model/<name>`` -> slice index, for the keys of ``state`` that hold tensors of the model
    whose masters are on disk (the model's children are its slices' layers, by name)."""
    if not isinstance(model, OffloadModel) or engine_of(model).master_files is None:
        return {}
    slice_of = {name: s.index for s in engine_of(model).slices if s.storage.masters_file is not None
                for name in s.names}
    found = {}
    for key in state:
        if key.startswith("model/"):
            layer = key.removeprefix("model/").split(".", 1)[0]
            if layer in slice_of:
                found[key] = slice_of[layer]
    return found


def _masters_releaser(model: nn.Module) -> Any:
    """What a planner calls with a slice index once DCP is done with that slice's masters."""
    return engine_of(model).release_masters if isinstance(model, OffloadModel) else None


def _release_masters(model: nn.Module) -> None:
    """Masters on disk that DCP read or wrote go back to their files (Note: [Masters on disk])."""
    if isinstance(model, OffloadModel):
        engine_of(model).release_masters()


# -- what is saved ---------------------------------------------------------------------------------


def _model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    # OffloadModel.state_dict() waits for pending host updates; the tensors share the host copies'
    # memory, so DCP reads from them and loads into them in place.
    return dict(model.state_dict())


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
        for index, states, on_disk in optimizer._state_layout_by_slice():
            yield from ((index, p, state, on_disk.get(p, {})) for p, state in states.items() if state)
        return
    optimizer_state = optimizer.state
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p in optimizer_state:
                yield -1, p, optimizer_state[p], {}


def _kept_parameters(optimizer: torch.optim.Optimizer) -> list[tuple[int, torch.Tensor]]:
    """(slice index, parameter) for each parameter whose state this rank keeps (sharded: those it
    updates); the index is -1 outside an OffloadOptimizer's slices."""
    if isinstance(optimizer, OffloadOptimizer):
        # Stand-ins for the state a disk tier keeps: which parameters, without reading their files.
        return [(index, p) for index, states, _ in optimizer._state_layout_by_slice() for p in states]
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


def _group(model: nn.Module, optimizer: torch.optim.Optimizer | None, process_group: Any) -> tuple[Any, int, int]:
    """The group that saves or loads together, this rank in it, and its size (None, 0, 1: one process)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None, 0, 1
    group = process_group
    if group is None and isinstance(optimizer, OffloadOptimizer) and optimizer._collectives is not None:
        group = optimizer._collectives.group  # the host (gloo) group, when the model's is NCCL
    if group is None and isinstance(model, OffloadModel):
        group = model.process_group
    if group is None:
        group = dist.group.WORLD
    return group, dist.get_rank(group), dist.get_world_size(group)


def _barrier(group: Any) -> None:
    if group is not None:
        dist.barrier(group=group)


# -- checks before loading -------------------------------------------------------------------------


def _read(path: Path) -> tuple[dict[str, Any], Metadata]:
    """The checkpoint's description and DCP metadata, once every file they name is there, whole."""
    if not path.is_dir():
        partial = partial_directory(path)
        hint = f" (a save of it was interrupted: {partial} is incomplete)" if partial.exists() else ""
        raise CheckpointError(f"no checkpoint at {path}: not a directory{hint}")
    try:
        info = json.loads((path / INFO_FILE).read_text())
    except FileNotFoundError as error:
        raise CheckpointError(f"checkpoint {path} is incomplete: {INFO_FILE} is missing") from error
    except (ValueError, UnicodeDecodeError) as error:
        raise CheckpointError(f"checkpoint {path} is damaged: {INFO_FILE} is not valid JSON ({error})") from error
    if not isinstance(info, dict):
        raise CheckpointError(f"checkpoint {path} is damaged: {INFO_FILE} holds no description of a checkpoint")
    try:
        metadata = FileSystemReader(path).read_metadata()
    except FileNotFoundError as error:
        raise CheckpointError(f"checkpoint {path} is incomplete: {Path(error.filename).name} is missing") from error
    except Exception as error:  # a damaged pickle raises whatever the bytes lead the unpickler to
        raise CheckpointError(f"checkpoint {path} is damaged: its .metadata cannot be read ({type(error).__name__}: "
                              f"{error}). Nothing was loaded: load an earlier checkpoint.") from error
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"checkpoint {path} is damaged: its .metadata holds a {type(metadata).__name__}, not "
                              "DCP's metadata. Nothing was loaded: load an earlier checkpoint.")
    if info.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path} has format {info.get('format')!r}; this version reads {FORMAT}")
    needed: dict[str, int] = {}
    for storage in (metadata.storage_data or {}).values():
        needed[storage.relative_path] = max(needed.get(storage.relative_path, 0), storage.offset + storage.length)
    for relative, length in sorted(needed.items()):
        file = path / relative
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path} is incomplete: {relative} is missing")
        if file.stat().st_size < length:
            raise CheckpointError(f"checkpoint {path} is incomplete: {relative} has {file.stat().st_size} bytes, "
                                  f"{length} expected (truncated)")
    return info, metadata


def _check_model(path: Path, info: dict[str, Any], model: nn.Module, model_state: dict[str, torch.Tensor]) -> None:
    saved = info["tensors"]
    differences = [f"{name} is not in the model" for name in saved if name not in model_state]
    differences += [f"{name} is not in the checkpoint" for name in model_state if name not in saved]
    for name, tensor in model_state.items():
        if name in saved and saved[name] != _describe(tensor):
            here = _describe(tensor)
            differences.append(f"{name} is {saved[name]['dtype']}{saved[name]['shape']} there, "
                               f"{here['dtype']}{here['shape']} here")
    if differences:
        raise CheckpointError(f"checkpoint {path} holds another model: " + _listed(differences))
    partition = _partition(model)
    if partition is not None and info["partition"] is not None and partition != info["partition"]:
        first = next(k for k in range(max(len(partition), len(info["partition"])))
                     if k >= len(partition) or k >= len(info["partition"]) or partition[k] != info["partition"][k])
        raise CheckpointError(
            f"checkpoint {path} was saved from a model cut into {len(info['partition'])} slices, this one has "
            f"{len(partition)}; slice {first} differs ({_slice(info['partition'], first)} there, "
            f"{_slice(partition, first)} here). Build the OffloadModel with the saved run's num_slices.")


def _check_optimizer(path: Path, info: dict[str, Any], metadata: Metadata, optimizer: torch.optim.Optimizer,
                     names: dict[int, str]) -> list[list[torch.Tensor]]:
    """The optimizer's groups' parameters, once they match the saved ones."""
    name = _optimizer_class(optimizer).__name__
    if info["optimizer"] is None or "optim/param_groups" not in metadata.state_dict_metadata:
        raise CheckpointError(f"checkpoint {path} holds no optimizer state; load it with optimizer=None")
    if info["optimizer"] != name:
        raise CheckpointError(f"checkpoint {path} holds the state of {info['optimizer']}, not of {name}")
    if not _steps_only(optimizer, names):
        raise CheckpointError(STRAY_PARAMETER)
    groups = [list(group["params"]) for group in optimizer.param_groups]
    here = [[names[id(p)] for p in params] for params in groups]
    if here != info["groups"]:
        if len(here) != len(info["groups"]):
            raise CheckpointError(f"checkpoint {path} holds {len(info['groups'])} parameter group(s), the optimizer "
                                  f"has {len(here)}")
        k = next(k for k, (a, b) in enumerate(zip(info["groups"], here)) if a != b)
        raise CheckpointError(f"parameter group {k} of checkpoint {path} holds other parameters than the "
                              f"optimizer's: {_listed(info['groups'][k], 4, ', ')} there, {_listed(here[k], 4, ', ')} here")
    return groups


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


def _listed(items: list[str], limit: int = 5, separator: str = "; ") -> str:
    more = f" (and {len(items) - limit} more)" if len(items) > limit else ""
    return separator.join(items[:limit]) + more


def _slice(partition: list[list[str]], k: int) -> str:
    if k >= len(partition):
        return "none"
    names = partition[k]
    return names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"
