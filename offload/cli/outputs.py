"""Where a fine-tuning run writes, checked before its first step, and what it had saved when it stopped.

A run that trains for hours and then cannot write its result has lost those hours. So every
directory a run writes (the output, the checkpoints, the disk tier) is made and probed with a
small file before anything trains, and each file system is asked for the room the run's writes
need (:func:`check_room`). Once training has started, :class:`RunRecord` knows the last
checkpoint saved, so a run that stops, by an error or Ctrl-C, says where it is and the command
that continues from it. It does not save the model itself; :func:`mark_export` records in the
output directory whether the model there is finished, which a resume that has nothing left to
train reads before it exports over it.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint import CheckpointError, latest_checkpoint
# A small disk's figures in the unit that shows them (MiB, not "0.00 GiB"), as a checkpoint's and
# the disk tier's room checks word theirs.
from ..tiers.disk_tier import size_text

__all__ = ["EXPORT_RECORD", "OutputError", "RunRecord", "Write", "check_no_earlier_run", "check_room", "check_writable",
           "holds_finished_model", "mark_export", "resume_command"]

#: The file in the output directory that says whether the model there is finished: written as an
#: export starts and again once its last file is written (Note: [Never lose a run], rule 4).
EXPORT_RECORD = "offload_finetune.json"


class OutputError(RuntimeError):
    """A directory the run writes is not writable or lacks room; raised before the first step."""


@dataclass(frozen=True)
class Write:
    """``nbytes`` the run will write under ``path``, for ``what`` (named in the error)."""

    path: Path
    nbytes: int
    what: str


def check_writable(path: Path, flag: str) -> None:
    """Make ``path`` (and its parents) and write and remove a probe file in it.

    Raises:
        OutputError: it cannot be made or written, naming ``flag`` and the reason.
    """
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".offload-probe-"):
            pass
    except OSError as error:
        reason = error.strerror or str(error)
        raise OutputError(f"{flag} {path}: cannot write there ({reason}); choose a directory you can write, "
                          "before anything trains") from error


def check_no_earlier_run(checkpoints: Path) -> None:
    """Refuse checkpoints saved into ``checkpoints`` by an earlier run, which a run that does not
    resume from them would replace or remove (Note: [Never lose a run], rule 5, in ``finetune.py``).

    Raises:
        OutputError: the earlier run's last checkpoint, and what to pass instead.
    """
    try:
        last = latest_checkpoint(checkpoints)
    except CheckpointError:
        return None  # not a directory of checkpoints: check_writable says what is wrong with it
    if last is not None:
        raise OutputError(f"--out {checkpoints.parent}: an earlier run saved checkpoints in {checkpoints} (the last: "
                          f"{last.name}), which this run's saves would replace or remove. Continue that run with "
                          "--resume latest, or choose another --out, or remove that directory first.")
    return None


def _device_of(path: Path) -> tuple[int, Path]:
    """The file system holding ``path`` (its nearest existing ancestor's)."""
    existing = path.resolve()
    while not existing.exists():
        existing = existing.parent
    return os.stat(existing).st_dev, existing


def check_room(writes: Sequence[Write]) -> None:
    """Check that each file system has room for the writes that land on it, added up.

    Raises:
        OutputError: a file system's free bytes fall short, listing the writes that need them.
    """
    by_device: dict[int, tuple[Path, list[Write]]] = {}
    for write in writes:
        device, existing = _device_of(write.path)
        by_device.setdefault(device, (existing, []))[1].append(write)
    for existing, group in by_device.values():
        free = shutil.disk_usage(existing).free
        needed = sum(w.nbytes for w in group)
        if needed > free:
            items = "; ".join(f"{w.what} in {w.path}: {size_text(w.nbytes)}" for w in group)
            raise OutputError(f"not enough room on the disk holding {existing}: {size_text(free)} free, the run "
                              f"writes {size_text(needed)} there ({items}). Free some space or choose other "
                              "directories, before anything trains")


def mark_export(out: Path, step: int, *, finished: bool) -> None:
    """Record in ``out`` that the model of ``step`` is being written there, or is written whole.

    The record is replaced in one rename, so it is never half-written: a run stopped mid-export
    leaves the "being written" one, whatever the model's files are by then.
    """
    partial = out / f".{EXPORT_RECORD}.partial"
    partial.write_text(json.dumps({"step": step, "finished": finished}) + "\n", encoding="utf-8")
    os.replace(partial, out / EXPORT_RECORD)


def holds_finished_model(out: Path, step: int) -> bool:
    """Whether ``out`` holds a finished model that a resume from checkpoint ``step`` with nothing
    to train must not overwrite.

    Its export record says so: a finished model of ``step`` or later. One of an earlier step is an
    earlier run's (a run into the same ``--out`` with fewer steps), which the run that saved this
    later checkpoint was going to overwrite when it exported: resuming it does what that run had
    left. An older checkpoint resumed by mistake is refused. Without a record, any weights there
    are taken for a finished model (written
    before the record existed, or by something else), and an unreadable record for one too:
    overwriting a model that was unfinished costs a ``--out`` elsewhere, one that was finished
    costs the run.
    """
    try:
        record = json.loads((out / EXPORT_RECORD).read_text(encoding="utf-8"))
        return bool(record["finished"]) and int(record["step"]) >= step
    except (FileNotFoundError, NotADirectoryError):
        return any(out.glob("*.safetensors")) or any(out.glob("*.bin"))
    except (OSError, ValueError, TypeError, KeyError):
        return True


def resume_command(argv: Sequence[str], checkpoint: Path, program: str | None = None) -> str:
    """The command line that continues from ``checkpoint``: the run's own, ``--resume`` replaced."""
    args: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--resume":
            skip = True
        elif not arg.startswith("--resume="):
            args.append(arg)
    if program is None:
        program = sys.argv[0]
        program = f"python {program}" if program.endswith(".py") else Path(program).name
    return " ".join([program, *map(shlex.quote, [*args, "--resume", str(checkpoint)])])


@dataclass
class RunRecord:
    """What a run has saved so far, for the line it prints when it stops early."""

    argv: list[str]
    step: int = 0  # the last step done
    checkpoint: Path | None = None  # the last checkpoint saved, or the one the run resumed from

    def stopped(self, why: str) -> str:
        """One line: how far the run got, where its last checkpoint is and how to continue."""
        if self.step == 0 and self.checkpoint is None:
            return f"{why} before the first step; nothing was trained"
        if self.checkpoint is None:
            where = "no checkpoint was saved (--save-every N saves one every N steps)"
            return f"{why} after step {self.step}; {where}"
        return (f"{why} after step {self.step}; last checkpoint: {self.checkpoint}; "
                f"resume with: {resume_command(self.argv, self.checkpoint)}")
