"""Save a training run so that it resumes exactly: :func:`save_checkpoint`.

A checkpoint is a directory in the format of ``torch.distributed.checkpoint`` (DCP), the one
torchtitan and FSDP use, plus a small ``offload.json`` that says what was saved. It holds the
model's ``state_dict()``, the optimizer's state and hyperparameters, every rank's random number
generators and whatever the caller passes as ``extra`` (a scheduler's, a ``GradScaler``'s, the
data position). It does not hold gradients: save between steps. This file holds the steps of a
save; what a checkpoint holds is in ``contents.py`` (Note: [Checkpoint layout]), the checks before
it writes in ``checks.py``, loading in ``loader.py``. It does not export to Hugging Face
(``save_pretrained`` does) and does not decide when to save (the training loop does).

A save is atomic: it either returns, the checkpoint whole under its name and ``latest`` naming
it, or raises with nothing new visible (Note: [Atomic save] in ``offload/checkpoint/commit.py``).
Before anything is written, the arguments are checked (``extra`` pickles), every rank must name
the same directory, the target must be a checkpoint holding only its own files, an empty directory
or absent, and the filesystem must have room for the tensors and their headers (a lower bound;
every rank decides from the same gathered figures). A save that fails after that (a disk that
fills up, any error DCP gathers, a rank's files that rank 0 does not find before the commit: no
shared filesystem) deletes what it wrote and raises :class:`CheckpointError` on every rank.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from .checkpoint_files import (CheckpointError, ChecksummingFileSystem, disk_full, failure_text, free_bytes,
                               interrupt_behind, pickled_size)
from .checks import _check_room, _check_save_arguments, _check_target
from .commit import HalfCommitted, commit, latest_checkpoint, partial_directory, prepare, tidy
from .contents import (HOOKED, STRAY_PARAMETER, _extra_digest, _extra_keys, _extra_to_save, _hooked_keys, _info,
                       _master_files, _masters_on_disk, _masters_releaser, _model_state, _named_groups, _optimizer_state,
                       _own_storage, _parameter_names, _release_masters, _rng_state, _split_model_state, _steps_only)
from .framework_wrappers import unwrapped
from .ranks import _agreed, _gathered_list, _group, _on_rank_0
from ..model import engine_of
from ..tiers.disk_tier import size_text
from ..optimizer import OffloadOptimizer, check_whole
from ..optimizing.copying import HALF_A_STEP, check_step_finished
from .slice_save_planner import SliceReadingSavePlanner
from .wrapped_state import state_entries


def save_checkpoint(path: str | os.PathLike[str], model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    *, extra: Any = None, keep_last: int | None = None,
                    process_group: Any = None) -> Path:
    """Write the model, the optimizer, the random number generators and ``extra`` into the
    checkpoint directory ``path`` and point ``latest`` beside it at it, as one event: when it
    returns, both are done; when it raises, nothing new is visible and the previous checkpoint is
    intact (Note: [Atomic save] in ``offload/checkpoint/commit.py``). Call it on every rank,
    between steps; pending host updates finish first.

    The optimizer's ``state_dict`` hooks run, and what its post-hooks add is saved for its
    ``load_state_dict`` pre-hooks (``docs/checkpoints.md``, "Optimizer hooks"). The modules' extra
    states (``get_extra_state()``) are saved as they are, for their ``set_extra_state()`` on load.

    Data parallel, each rank writes the optimizer state it owns, in parallel, and the parameters
    are written once; nothing is gathered. DCP reads the host copies and the optimizer state where
    they are: a save adds next to no host memory (``docs/checkpoints.md`` has the figures).

    Args:
        path: the checkpoint directory to create; an earlier checkpoint there is replaced, and
            anything else there (a file, a directory of other files, a checkpoint that also holds
            files no save wrote) is refused. Its parent is created.
        model: an :class:`~offload.OffloadModel` or any ``nn.Module``.
        optimizer: an :class:`~offload.OffloadOptimizer`, any ``torch.optim`` optimizer over the
            model's parameters, or ``None``.
        extra: any picklable value to save with it, usually a dict (a scheduler's and a
            ``GradScaler``'s ``state_dict()``, the step, the data position), each rank's own:
            :func:`load_checkpoint` returns to each rank the one it saved, as it was (a bare
            tensor too); on another number of ranks, rank 0's (Note: [Extra per rank] in
            ``contents.py``). Ranks that pass the same value write it once.
        keep_last: keep only this many checkpoints beside ``path`` (the newest), or all (``None``);
            an older one that also holds files no save wrote stays, with a warning.
        process_group: the group that saves together; default: the optimizer's, else the
            model's, else the default group when ``torch.distributed`` is initialised.

    Returns:
        ``path``.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, ``optimizer`` not an optimizer, ``extra``
            (or what the optimizer's ``state_dict()`` post-hooks add) cannot be pickled, or
            ``model.state_dict()`` holds a value that is neither a tensor nor a module's extra
            state (checked before anything is written).
        ValueError: a bad ``keep_last``, the optimizer steps a parameter the model lacks, a
            ``state_dict()`` post-hook of the optimizer changed its state or groups (Note: [State
            dict hooks in a checkpoint] in ``contents.py``; checked before anything is written), or
            ``path`` is named ``latest`` or starts with ``.`` (the names of the save's own files),
            names no directory of its own (``.``, ``..``, ``""``) or has a name that starts or ends
            with whitespace (checked before anything is written).
        FileExistsError: ``path`` is a file, a directory of files that is not a checkpoint, or a
            checkpoint that also holds files no save wrote (an export in ``step-N/hf``), which the
            save would delete (Note: [What a save deletes] in ``commit.py``); the message names them.
        NotADirectoryError: a directory above ``path`` is a file (checked before anything is
            written).
        RuntimeError: the optimizer's parameters and state mix two steps (an update failed part
            way), or may (a write-back of masters on disk failed), or a load into its disk tier
            failed part way: load the last checkpoint first; or,
            with ``update_in_backward``, the save comes between the backward that started this
            step's updates and ``step()``: call ``step()`` first (checked before anything is
            written).
        CheckpointError: another rank refused one of the above (said on every rank; checked before
            anything is written), the ranks were given different paths (as absolute paths; checked before
            anything is written), the filesystem has less room than the save needs (checked before
            anything is written), rank 0 does not find every rank's files where they were written
            (the ranks share no filesystem there), or the save failed (a full disk says so): what
            it wrote is removed, ``latest`` is unchanged and the previous checkpoint is intact.

    Warns:
        UserWarning: on rank 0, the checkpoint is saved and ``latest`` names it, but what follows
            failed: deleting the checkpoint it replaced, removing the oldest for ``keep_last``
            (the next save tries again; one that holds files no save wrote is left, naming them),
            or syncing the directory. The message says which.

    Example::

        >>> save_checkpoint(f"ckpt/step-{step}", model, optimizer,
        ...                 extra={"step": step, "scheduler": scheduler.state_dict()}, keep_last=3)
    """
    model, optimizer = unwrapped(model, optimizer)  # Fabric's wrappers (framework_wrappers.py)
    extra_nbytes = _check_save_arguments(model, optimizer, extra, keep_last)
    path = Path(path).expanduser()
    _check_target(path)
    group, rank, world_size = _group(model, optimizer, process_group)
    names = _parameter_names(model)
    # Rank-local refusals (this rank's optimizer mixes two steps) are said on every rank, and so
    # are paths that differ: each rank would write into a directory of its own, and rank 0 commit
    # a checkpoint without the others' files. The extra's digest is taken here too, so that a
    # pickle that fails on one rank is said on every rank; the ranks compare digests next (Note:
    # [Extra per rank] in contents.py).
    state, on_disk, digest = _agreed(group, lambda: (*_state_to_save(model, optimizer, names, rank),
                                                     _extra_digest(extra)),
                                     same=lambda _: _absolute(path), differ=functools.partial(_other_paths, path))
    extra_nbytes = _add_extra(state, extra, digest, extra_nbytes, group, rank)
    needed = _check_room(group, rank, path, state, extra_nbytes, optimizer)
    partial = partial_directory(path)
    _on_rank_0(group, rank, functools.partial(prepare, path), lambda error: _save_failure(path, error, [], needed))
    written = _write_data(path, partial, model, optimizer, state, on_disk, group, rank, needed)
    checksums = _gathered_list(group, written)  # each rank's data files, by rank
    merged = {name: crc for files in checksums for name, crc in files.items()}  # each rank's files have own names
    info = functools.partial(_info, model, optimizer, names, world_size, merged)
    try:
        problems = _commit_saved(path, info, keep_last, group, rank, needed, checksums)
    except CheckpointError:
        if rank != 0:  # rank 0 removed its partial directory, and this rank's may be another
            _remove_written(partial, written)
        raise
    if isinstance(optimizer, OffloadOptimizer):
        optimizer._updates.failure.saved(path)  # the one to reload after a failure: partial_failure.py, rule 7
    files = _master_files(model)
    if files is not None:  # and the model's (Note: [Masters on disk], "Errors")
        files.saved(path, isinstance(optimizer, OffloadOptimizer))
    for problem in problems:
        warnings.warn(problem, stacklevel=2)
    return path


def _absolute(path: Path) -> tuple[str, str]:
    """What the ranks of a save of ``path`` compare, and name when it differs: the absolute path
    (one relative path from other working directories names other directories). Symbolic links
    are not resolved: a shared directory reached through a link on one machine and directly on
    another is one directory, and one path names it on both; that every rank's files reached the
    directory rank 0 commits is checked after the write (``_check_every_rank_wrote``)."""
    absolute = os.path.abspath(path)
    return absolute, absolute


def _other_paths(path: Path, listing: str) -> str:
    """Why a save of ``path`` is refused when the ranks' absolute paths differ (``listing``)."""
    return (f"cannot save checkpoint {path}: the ranks were given different paths ({listing}). Nothing was written. "
            "Pass the same path on every rank, in a directory they all see (a shared filesystem): rank 0 commits "
            "the checkpoint once every rank's files are in it.")


def _state_to_save(model: nn.Module, optimizer: torch.optim.Optimizer | None, names: dict[int, str], rank: int
                   ) -> tuple[dict[str, Any], dict[str, tuple[int, torch.Tensor, str]]]:
    """What DCP saves (Note: [Checkpoint layout]) but ``extra`` (:func:`_add_extra`), and, by key,
    the optimizer state a disk tier keeps: where the planner reads it (slice index, parameter,
    state key).

    Raises:
        ValueError: the optimizer steps a parameter the model lacks.
    """
    # Buffers may differ between ranks (BatchNorm's running statistics stay per rank): only rank 0
    # offers them, so that the checkpoint holds one rank's, not a mix that DCP's choice of writer
    # per key would make. Parameters are the same on every rank, and any rank may write each.
    # Extra states too: they are per module, like buffers.
    tensors, extra_states = _split_model_state(model, _model_state(model))
    theirs = set() if rank == 0 else {*(name for name, _ in model.named_buffers(remove_duplicate=False)),
                                      *extra_states}
    state: dict[str, Any] = {f"model/{name}": _own_storage(value)
                             for name, value in {**tensors, **extra_states}.items() if name not in theirs}
    on_disk: dict[str, tuple[int, torch.Tensor, str]] = {}  # key -> where the planner reads it
    if optimizer is not None:
        if not _steps_only(optimizer, names):
            raise ValueError(STRAY_PARAMETER)
        if isinstance(optimizer, OffloadOptimizer):
            check_whole(optimizer, "save_checkpoint()")
            # Between a backward that started updates and step() (Note: [Copying an OffloadOptimizer], rule 5).
            check_step_finished(optimizer, "save the checkpoint", HALF_A_STEP)
        for index, param, param_state, disk_keys in _optimizer_state(optimizer):
            for key, value in param_state.items():
                entry = f"optim/state/{names[id(param)]}/{key}"
                if key in disk_keys:
                    state[entry] = value
                    on_disk[entry] = (index, param, key)
                else:
                    state.update(state_entries(entry, value, _own_storage))  # Note: [Wrapped state]
        state["optim/param_groups"] = _named_groups(optimizer, names)
        hooked = _hooked_keys(optimizer)  # Note: [State dict hooks in a checkpoint]
        if hooked:
            _check_hooked_pickles(hooked)
            if rank == 0:  # rank 0's, as buffers and extra states: DCP would keep any one rank's
                state[HOOKED] = hooked
    files = _master_files(model)
    if files is not None:  # after the optimizer's refusals, which say more: a write-back that failed since a load
        files.refuse_unwritten(engine_of(model).slices, "save_checkpoint()", optimizer is not None)
    state[f"rng/{rank}"] = _rng_state()
    return state, on_disk


def _add_extra(state: dict[str, Any], extra: Any, digest: str, nbytes: int, group: Any, rank: int) -> int:
    """Add this rank's ``extra`` to ``state`` under its key (Note: [Extra per rank]): ``extra``
    when its ``digest`` is rank 0's, else its own. Returns the pickled bytes of every rank's that
    is written (``nbytes`` each rank's own; ``extra`` once), for the room check."""
    everyone = _gathered_list(group, (digest, nbytes))
    keys = _extra_keys([theirs for theirs, _ in everyone])
    state[keys[rank]] = _extra_to_save(extra)  # wrapped: a bare tensor would be saved as tensor data
    written = {key: theirs for key, (_, theirs) in zip(keys, everyone)}  # the copies of extra: one value, once
    return sum(written.values())


def _check_hooked_pickles(hooked: dict[str, Any]) -> None:
    """Raise, before anything is written, if what the optimizer's ``state_dict()`` post-hooks
    added does not pickle (DCP would fail half way)."""
    try:
        pickled_size(hooked)
    except Exception as error:
        raise TypeError(f"save_checkpoint(): the optimizer's state_dict() post-hooks added {sorted(hooked)}, which "
                        f"a checkpoint pickles (DCP writes it with torch.save), and pickling failed: {error}. Have "
                        "the hook add plain values.") from error


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
    # Not flattened: DCP's flattening of sharded tensors (there are none here) would rebuild every
    # nested dict with str keys, as a plain dict (Note: [Checkpoint layout]).
    planner.flatten_sharded_tensors = False
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
        interrupt = interrupt_behind(error)  # one that a writer's closing error replaced
        if interrupt is not None:
            raise interrupt from None
        raise CheckpointError(_save_failure(path, error, files.write_errors, needed)) from error
    finally:
        if isinstance(planner, SliceReadingSavePlanner):
            planner.release()
    return files.checksums


def _commit_saved(path: Path, info: Callable[[], dict[str, Any]], keep_last: int | None, group: Any, rank: int,
                  needed: int, checksums: list[dict[str, int]]) -> list[str]:
    """On rank 0, once every rank's data files (``checksums``, by rank) are found in the partial
    directory, commit the checkpoint written for ``path``, ``info()`` as its ``offload.json``, and
    tidy after it (Note: [Atomic save] in ``offload/checkpoint/commit.py``); what tidying could
    not do, one sentence each (none on the other ranks).

    Raises:
        CheckpointError: on every rank, when a rank's data file is not in the partial directory
            (the ranks do not see one filesystem: rank 0 removed the partial directory) or the
            commit failed on rank 0: nothing new is visible (or, should undoing its renames fail
            too, the message says what is where).
    """
    problems: list[str] = []

    def work() -> None:
        _check_every_rank_wrote(path, checksums)
        commit(path, lambda: json.dumps(info(), indent=1).encode())
        problems.extend(tidy(path, keep_last))

    def failure(error: BaseException) -> str:
        if isinstance(error, (HalfCommitted, CheckpointError)):
            return str(error)
        return _save_failure(path, error, [], needed)

    _on_rank_0(group, rank, work, failure)
    return problems


def _check_every_rank_wrote(path: Path, checksums: list[dict[str, int]]) -> None:
    """On rank 0, before the commit of ``path``: raise unless each rank's data files (``checksums``,
    by rank) are in the partial directory. Ranks that do not share the filesystem there (machines
    without one, or a path each mounts its own) each write into a directory of their own; the
    commit would then make a checkpoint without the others' files, which no load reads.

    Raises:
        CheckpointError: some file is not there; the partial directory is removed first.
    """
    partial = partial_directory(path)
    unseen = [f"rank {rank}'s {name}" for rank, names in enumerate(checksums) for name in sorted(names)
              if not (partial / name).is_file()]
    if not unseen:
        return
    shutil.rmtree(partial, ignore_errors=True)
    raise CheckpointError(
        f"could not save checkpoint {path}: rank 0, which commits it, does not find {', '.join(unseen)} in {partial}, "
        f"where it was written: the ranks do not see one filesystem there. Nothing of it was kept and {_intact(path)}. "
        "Save on every rank to a directory they all see (a shared filesystem).")


def _remove_written(partial: Path, written: dict[str, int]) -> None:
    """On a rank other than 0, after a failed commit: delete this rank's data files (``written``)
    from ``partial``, and it once empty. Where the ranks share the filesystem, rank 0 removed them
    with its partial directory before it said the commit failed, and nothing is left to do; where
    they do not, they are in this rank's own directory, which rank 0 cannot see. Quietly: the
    commit's error is the one to report."""
    for name in written:
        with contextlib.suppress(OSError):
            (partial / name).unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        partial.rmdir()


def _save_failure(path: Path, error: BaseException, write_errors: list[OSError], needed: int) -> str:
    intact = _intact(path)
    if disk_full(error, write_errors):
        return (f"could not save checkpoint {path}: the disk filled up while writing it (the filesystem of "
                f"{path.parent} has {size_text(free_bytes(path.parent))} free once the partial save was removed; the "
                f"save needs more than that: at least {size_text(needed)} for its tensors and their headers alone). "
                f"Nothing of it was kept and {intact}. Free space (or save elsewhere) and save again.")
    return (f"could not save checkpoint {path}: {failure_text(error)}. Nothing of it was kept and {intact}.")


def _intact(path: Path) -> str:
    """Which checkpoint a failed save of ``path`` left as it was, for its message. It raises
    nothing: the error that stopped the save is the one to report, and rank 0 still has to share
    it with the other ranks (a second error here left them waiting for it)."""
    try:
        previous = latest_checkpoint(path.parent)
        if path.is_dir():
            return f"checkpoint {path} is intact (it was not replaced)"
        if previous is not None and previous.is_dir():
            return f"the previous checkpoint, {previous}, is intact"
    except (OSError, CheckpointError):  # a parent that is a file, a latest that is a directory
        return "any earlier checkpoint is as it was"
    return "no earlier checkpoint was touched"
