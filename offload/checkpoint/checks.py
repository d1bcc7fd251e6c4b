"""What is checked before a save writes anything or a load touches the model: the arguments, the
save's target and the room it needs, and that a checkpoint is whole (every file there, long enough)
and of this model, slicing and optimizer. Each check raises one message that says what differs and
what to do.

What it does not hold: the checksums of the data files, checked as a load starts
(``checkpoint_files.py``), or what a checkpoint holds (``contents.py``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

from .checkpoint_files import CheckpointError, free_bytes, pickled_size, unreadable
from .commit import INFO_FILE, LATEST_FILE, _checkpoints_in, foreign_entries, partial_directory, read_latest
from .contents import READABLE_FORMATS, STRAY_PARAMETER, _describe, _optimizer_class, _partition, _steps_only
from .quant_states import is_packed
from .ranks import _gathered_list
from ..tiers.disk_tier import size_text
from ..optimizer import OffloadOptimizer

#: Bytes a save counts for each item's header in its data file, at least (a lower bound: a save
#: is refused only when it cannot fit).
ITEM_HEADER = 1024


def _check_arguments(function: str, model: Any, optimizer: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{function}() takes the model (an nn.Module: the OffloadModel) after the path, got "
                        f"{type(model).__name__} {model!r:.60}; call {function}(path, model, optimizer)")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{function}(): optimizer must be a torch.optim.Optimizer (an OffloadOptimizer) or None, got "
                        f"{type(optimizer).__name__} {optimizer!r:.60}")


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


def _check_target(path: Path) -> None:
    """Refuse, before anything is written, a ``path`` that holds something other than a checkpoint
    (a save replaces what is there), one under a file, one that names no directory of its own, or
    one named as the commit names its own files. Every rank checks before the first collective: on
    a shared filesystem all refuse together, and none waits for another that gave up."""
    if path.name in ("", ".."):
        # '.', '..', '' or '/': the commit would rename the directory the checkpoints go beside
        # (the working directory, say), after everything was written.
        raise ValueError(f"cannot save a checkpoint at {str(path)!r}: it names no directory of its own (a checkpoint "
                         "is a directory beside the others and the latest file). Save to a named subdirectory, such "
                         f"as {str(path / 'step-N')!r}.")
    if path.name != path.name.strip():
        # ``latest`` names it exactly, and a name that differs from another by a space is easy to miss.
        raise ValueError(f"cannot save a checkpoint named {path.name!r} ({path}): it starts or ends with whitespace, "
                         f"which a listing does not show. Choose a name without, such as {path.name.strip()!r}.")
    if path.name == LATEST_FILE or path.name.startswith("."):
        # ``latest`` is the file naming the last checkpoint (a checkpoint of that name fails at
        # its commit, all written); hidden names are the commit's partial and replaced directories.
        raise ValueError(f"cannot save a checkpoint named {path.name!r} ({path}): {LATEST_FILE} and names that start "
                         "with '.' are save_checkpoint()'s own files beside the checkpoints. Choose another name, "
                         "such as step-N.")
    above = next((parent for parent in path.parents if parent.exists()), None)
    if above is not None and not above.is_dir():
        # Found now, not by the mkdir of the save's first step, whose error named neither path.
        raise NotADirectoryError(f"cannot save a checkpoint at {path}: {above} is a file, not a directory. Choose "
                                 f"another path, or move {above} away first.")
    if path.is_symlink():
        # The commit renames the target aside and its partial directory into place: through a
        # link, that would replace the link, not what it points to.
        raise FileExistsError(f"cannot save a checkpoint at {path}: it is a symbolic link (to {os.readlink(path)}), "
                              "and save_checkpoint does not save through links. Save to the directory it points to, "
                              "or remove the link first.")
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"cannot save a checkpoint at {path}: it is a file, not a checkpoint directory. Choose "
                              "another path, or remove the file first.")
    if path.is_dir():
        _check_replaceable(path)


def _check_replaceable(path: Path) -> None:
    """Refuse a directory ``path`` that holds something no save wrote, which a save would delete (it
    replaces the whole directory): anything but an empty directory or a checkpoint of its own files
    only (Note: [What a save deletes] in ``commit.py``)."""
    entries = sorted(f"{entry.name}/" if entry.is_dir() else entry.name for entry in path.iterdir())
    if entries and not (path / INFO_FILE).is_file():
        # Not a checkpoint, even when its names are (DCP's files, written by another program).
        raise FileExistsError(
            f"cannot save a checkpoint at {path}: it is a directory that holds files but no {INFO_FILE} "
            f"({_listed(entries, 5, ', ')}), so it is not a checkpoint, and a save would replace it with everything in "
            "it. Choose another path (a new or empty directory, or an earlier checkpoint to replace), or move those "
            "files away first.")
    others = foreign_entries(path)
    if others:
        raise FileExistsError(
            f"cannot save a checkpoint at {path}: it holds a checkpoint's files, and also {_listed(others, 5, ', ')}, "
            "which save_checkpoint did not write; a save replaces the whole directory, deleting everything in it. "
            f"Move those out of {path} (keep an export beside the checkpoint, not in it), or save under another "
            "name.")


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


def _read(path: Path) -> tuple[dict[str, Any], Metadata]:
    """The checkpoint's description and DCP metadata, once every file they name is there, whole,
    and the description is one a save of a format this version reads writes.

    Raises:
        CheckpointError: no checkpoint at ``path``, or an incomplete, damaged or newer one, or one
            this user may not read (permissions).
    """
    if not path.is_dir():
        raise CheckpointError(_not_there(path))
    try:
        info = json.loads((path / INFO_FILE).read_text())
    except PermissionError as error:
        raise unreadable(path / INFO_FILE, path) from error
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
    except PermissionError as error:  # no damage: a matter of permissions, which no earlier checkpoint mends
        raise unreadable(Path(error.filename or path / ".metadata"), path) from error
    except Exception as error:  # a damaged pickle raises whatever the bytes lead the unpickler to
        raise CheckpointError(f"checkpoint {path} is damaged: its .metadata cannot be read ({type(error).__name__}: "
                              f"{error}). Nothing was loaded: load an earlier checkpoint.") from error
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"checkpoint {path} is damaged: its .metadata holds a {type(metadata).__name__}, not "
                              "DCP's metadata. Nothing was loaded: load an earlier checkpoint.")
    _check_info(path, info)
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


def _not_there(path: Path) -> str:
    """Why there is no checkpoint at ``path``, and what to do, for its message."""
    partial = partial_directory(path)
    hint = f" (a save of it was interrupted: {partial} is incomplete)" if partial.exists() else ""
    message = f"no checkpoint at {path}: not a directory{hint}"
    latest = path.parent / LATEST_FILE
    try:
        named = not path.exists() and read_latest(path.parent) == path.name
    except (OSError, CheckpointError):  # no latest there, or not the file a save writes
        named = False
    if not named:
        return message
    # What latest_checkpoint() returned, removed (by hand, or another run's keep_last) since.
    others = _checkpoints_in(path.parent)
    where = (f"pass load_checkpoint() one that is there (newest first: {_listed(others, 5, ', ')})" if others else
             f"{path.parent} holds no other checkpoint: restore this one from a copy, or start afresh (the next "
             f"save there names its own checkpoint in {LATEST_FILE})")
    return (f"{message}. It is the checkpoint {latest} names, the last one saved there, and it is gone (deleted or "
            f"moved since it was saved). Load another checkpoint: {where}.")


def _check_info(path: Path, info: dict[str, Any]) -> None:
    """Raise unless ``offload.json`` is of a format this version reads and holds what a load reads,
    each of the type a save writes (Note: [Checkpoint layout] in ``contents.py``).

    Raises:
        CheckpointError: a newer format (upgrade), or a description that is damaged or not offload's.
    """
    found = info.get("format")
    if _whole_number(found) and found > max(READABLE_FORMATS):
        readable = f"{', '.join(map(str, READABLE_FORMATS[:-1]))} and {READABLE_FORMATS[-1]}"
        raise CheckpointError(f"checkpoint {path} has format {found}; this version reads {readable} (a newer "
                              "offload wrote it: upgrade offload to load it)")
    wrong = [] if _whole_number(found) and found in READABLE_FORMATS else [_misstated(info, "format")]  # true == 1
    wrong += [_misstated(info, key) for key, fits in _INFO_FIELDS.items() if key not in info or not fits(info[key])]
    if "crc32" in info and not _checksums(info["crc32"]):
        wrong.append(_misstated(info, "crc32"))
    if "extra_states" in info and not _names(info["extra_states"]):  # none before extra states were saved
        wrong.append(_misstated(info, "extra_states"))
    if wrong:
        raise CheckpointError(f"checkpoint {path} is damaged, or was not written by offload: its {INFO_FILE} is not "
                              f"what a save writes ({'; '.join(wrong)}). Nothing was loaded: load an earlier "
                              "checkpoint.")


def _misstated(info: dict[str, Any], key: str) -> str:
    return f"{key!r} is missing" if key not in info else f"{key!r} is {info[key]!r:.40}"


def _whole_number(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _names(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(name, str) for name in value)


def _described(value: Any) -> bool:
    """Whether ``value`` describes a tensor as ``_describe`` does."""
    return (isinstance(value, dict) and isinstance(value.get("dtype"), str) and isinstance(value.get("shape"), list)
            and all(_whole_number(n) for n in value["shape"]))


def _checksums(value: Any) -> bool:
    return value is None or (isinstance(value, dict) and all(_whole_number(v) for v in value.values()))


#: What a load reads of ``offload.json``, by key: whether a value is of the type a save writes
#: (``"crc32"`` may be missing: a save before checksums were recorded wrote none).
_INFO_FIELDS: dict[str, Callable[[Any], bool]] = {
    "world_size": lambda value: _whole_number(value) and value >= 1,
    "tensors": lambda value: isinstance(value, dict) and all(map(_described, value.values())),
    "partition": lambda value: value is None or (isinstance(value, list) and all(map(_names, value))),
    "optimizer": lambda value: value is None or isinstance(value, str),
    "groups": lambda value: value is None or (isinstance(value, list) and all(map(_names, value))),
}


def _check_model(path: Path, info: dict[str, Any], model: nn.Module, model_state: dict[str, torch.Tensor],
                 extra_states: Collection[str] = ()) -> None:
    saved = info["tensors"]
    differences = [f"{name} is not in the model" for name in saved if name not in model_state]
    differences += [f"{name} is not in the checkpoint" for name in model_state if name not in saved]
    # Modules' extra states, by name only: their values are the modules' own (none before they were saved).
    saved_states = info.get("extra_states", [])
    differences += [f"{name} (extra state) is not in the model" for name in saved_states if name not in extra_states]
    differences += [f"{name} (extra state) is not in the checkpoint"
                    for name in extra_states if name not in saved_states]
    for name, tensor in model_state.items():
        if name in saved and saved[name] != _describe(tensor) and not _packed_alike(saved[name], tensor, name):
            here = _describe(tensor)
            differences.append(f"{name} is {saved[name]['dtype']}{saved[name]['shape']} there, "
                               f"{here['dtype']}{here['shape']} here")
    if differences:
        error = CheckpointError(f"checkpoint {path} holds another model: " + _listed(differences))
        if saved.keys() == model_state.keys():
            error.shapes = {name: (tuple(saved[name]["shape"]), tuple(tensor.shape))
                            for name, tensor in model_state.items() if list(tensor.shape) != saved[name]["shape"]}
        raise error
    partition = _partition(model)
    if partition is not None and info["partition"] is not None and partition != info["partition"]:
        first = next(k for k in range(max(len(partition), len(info["partition"])))
                     if k >= len(partition) or k >= len(info["partition"]) or partition[k] != info["partition"][k])
        raise CheckpointError(
            f"checkpoint {path} was saved from a model cut into {len(info['partition'])} slices, this one has "
            f"{len(partition)}; slice {first} differs ({_slice(info['partition'], first)} there, "
            f"{_slice(partition, first)} here). Build the OffloadModel with the saved run's num_slices.")


def _packed_alike(saved: dict[str, Any], tensor: torch.Tensor, name: str) -> bool:
    """A 4-bit weight's packed state, whose length varies with its values: its format is compared
    once it is read (Note: [Packed quantisation state] in ``quant_states.py``)."""
    return is_packed(name) and saved["dtype"] == _describe(tensor)["dtype"] and len(saved["shape"]) == tensor.dim()


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
            # Groups are matched by position: a group added before the load has no saved one. It can
            # be added after the load only if it holds none of the saved groups' parameters
            # (add_param_group() refuses a parameter that is already in a group).
            saved = {name: k for k, names in enumerate(info["groups"]) for name in names}
            added = here[len(info["groups"]):]
            counts = (f"checkpoint {path} holds {len(info['groups'])} parameter group(s), the optimizer has "
                      f"{len(here)}")
            build = "Build the optimizer with the saved run's groups (the same parameters in each, in the same order)"
            if added and not any(name in saved for names in added for name in names):
                raise CheckpointError(f"{counts}. {build}, load, then add the new group(s) with add_param_group().")
            moved = _moved(saved, here)
            raise CheckpointError(f"{counts}{', and parameters changed group: ' if moved else ''}"
                                  f"{_listed(moved)}. {build}, load.")
        k = next(k for k, (a, b) in enumerate(zip(info["groups"], here)) if a != b)
        raise CheckpointError(f"parameter group {k} of checkpoint {path} holds other parameters than the "
                              f"optimizer's: {_listed(info['groups'][k], 4, ', ')} there, {_listed(here[k], 4, ', ')} here")
    return groups


def _moved(saved: dict[str, int], here: list[list[str]]) -> list[str]:
    """Each parameter in another group of the optimizer than of the checkpoint (or in one only),
    and where it is in each; ``saved`` maps the checkpoint's parameters to their groups."""
    now = {name: k for k, names in enumerate(here) for name in names}

    def where(groups: dict[str, int], name: str) -> str:
        return f"group {groups[name]}" if name in groups else "no group"

    return [f"{name} ({where(saved, name)} there, {where(now, name)} here)"
            for name in [*saved, *(name for name in now if name not in saved)] if saved.get(name) != now.get(name)]


def _listed(items: list[str], limit: int = 5, separator: str = "; ") -> str:
    more = f" (and {len(items) - limit} more)" if len(items) > limit else ""
    return separator.join(items[:limit]) + more


def _slice(partition: list[list[str]], k: int) -> str:
    if k >= len(partition):
        return "none"
    names = partition[k]
    return names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"
