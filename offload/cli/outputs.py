"""Where a fine-tuning run writes, checked before its first step, and what it had saved when it stopped.

A run that trains for hours and then cannot write its result has lost those hours. So every
directory a run writes (the output, the checkpoints, the disk tier) is made and probed with a
small file before anything trains, and each file system is asked for the room the run's writes
need (:func:`check_room`). Once training has started, :class:`RunRecord` knows the last
checkpoint saved, so a run that stops, by an error or Ctrl-C, says where it is and the command
that continues from it, started the way the run was (:mod:`offload.cli.invocation`). It does not
save the model itself; :func:`mark_export` records in the output directory whether the model there
is finished, which a new run (:func:`check_no_finished_model`), a resume
(:func:`check_resume_keeps_finished_model`) and a resume that has nothing left to train read before
they export over it; without that record, a model's or a tokenizer's files there are no run's of
this command, and a run refuses to replace them unasked (:func:`check_no_foreign_files`).
:func:`remove_model_files` clears the previous model's files, its tokenizer's among them, before an
export writes its own, so that the directory holds one model and its own tokenizer.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import CheckpointError, latest_checkpoint
from ..model import OffloadModel
# A small disk's figures in the unit that shows them (MiB, not "0.00 GiB"), as a checkpoint's and
# the disk tier's room checks word theirs.
from ..tiers.disk_tier import size_text
from .invocation import invoked_as

__all__ = ["CHAT_TEMPLATES_DIR", "EXPORT_RECORD", "MODEL_FILES", "OutputError", "RunRecord", "TOKENIZER_FILES",
           "Write", "check_no_earlier_run", "check_no_finished_model", "check_no_foreign_files",
           "check_outputs_writable", "check_resume_keeps_finished_model", "check_room", "check_writable",
           "export_size", "finished_step", "holds_finished_model", "mark_export", "planned_writes",
           "remove_model_files", "replaced_bytes", "replaced_files", "resume_command"]

#: The file in the output directory that says whether the model there is finished: written as an
#: export starts and again once its last file is written (Note: [Never lose a run], rule 4).
EXPORT_RECORD = "offload_finetune.json"
#: The files of a saved model or adapter (``save_pretrained``'s weights, their index, their config,
#: and the shards a failed export left under ``save_causal_lm``'s working names, its ``PARTIAL_STEM``):
#: an export removes those of the previous model first, or a LoRA adapter would sit beside a full
#: model's shards (``from_pretrained`` reads them together), a model of fewer shards beside the old
#: ones its index no longer names.
MODEL_FILES = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "pytorch_model*.bin.index.json",
               "adapter_model.bin", "adapter_config.json", "config.json", "generation_config.json",
               "model.safetensors.partial-*")
#: The directory a tokenizer's ``save_pretrained`` writes its chat templates but the default into.
CHAT_TEMPLATES_DIR = "additional_chat_templates"
#: The names a tokenizer's ``save_pretrained`` writes under (a fast tokenizer's file and config, a slow
#: one's vocabulary, the chat templates). An export removes the previous tokenizer's first, as the
#: model's: ``save_pretrained`` writes only the files its tokenizer has, and a file of the previous
#: one left beside them is read with it (a chat template the new tokenizer does not have, say).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "spiece.model",
                   "sentencepiece.bpe.model", "chat_template.jinja", "chat_template.json",
                   f"{CHAT_TEMPLATES_DIR}/*.jinja")


class OutputError(RuntimeError):
    """A directory the run writes is not writable or lacks room; raised before the first step."""


@dataclass(frozen=True)
class Write:
    """``nbytes`` the run will write under ``path``, for ``what`` (named in the error), in ``files``
    files, each of which may take up to a block more than its bytes (``0``: not counted); ``frees``:
    the bytes of the files there it removes before it writes (the previous model an export replaces)."""

    path: Path
    nbytes: int
    what: str
    files: int = 0
    frees: int = 0


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
    except CheckpointError as error:
        if (checkpoints / "latest").is_file():  # damaged or unreadable: still an earlier run's
            raise OutputError(f"--out {checkpoints.parent}: an earlier run saved checkpoints in {checkpoints}, which "
                              f"this run's saves would replace or remove, and {error} Continue that run with "
                              "--resume and one of its checkpoints, or choose another --out, or remove that "
                              "directory first.") from error
        return None  # not a directory of checkpoints: check_writable says what is wrong with it
    if last is not None:
        raise OutputError(f"--out {checkpoints.parent}: an earlier run saved checkpoints in {checkpoints} (the last: "
                          f"{last.name}), which this run's saves would replace or remove. Continue that run with "
                          "--resume latest, or choose another --out, or remove that directory first.")
    return None


def check_no_finished_model(out: Path, *, overwrite: bool) -> None:
    """Refuse a new run (no ``--resume``) into an ``out`` that holds a finished model, which its
    export would replace, unless ``overwrite`` (Note: [Never lose a run], rule 6, in ``finetune.py``).

    Raises:
        OutputError: what is there, and what to pass instead.
    """
    if not overwrite and holds_finished_model(out, 0):
        raise OutputError(f"--out {out} holds a finished model, which this run's export would replace: choose another "
                          "--out, or pass --overwrite to replace it")


def check_no_foreign_files(out: Path, *, overwrite: bool) -> None:
    """Refuse an ``out`` without the export record whose files an export would remove or replace
    (:func:`replaced_files`: a ``config.json``, an ``adapter_config.json``, a tokenizer's), unless
    ``overwrite`` (Note: [Never lose a run], rule 6, in ``finetune.py``).

    The command writes nothing directly in ``out`` before its export, and the export writes the
    record before its first file: without the record, such files are the user's or another tool's
    (weights among them count as a finished model, which :func:`check_no_finished_model` refuses
    first). With it they are a model this command wrote, which the checks of a finished model rule.
    An empty ``out``, one holding only checkpoints (a resume into its own ``--out``) or other files
    passes.

    Raises:
        OutputError: the files, and what to pass instead.
    """
    if overwrite or (out / EXPORT_RECORD).exists():
        return
    replaced = replaced_files(out)
    if replaced:
        names = ", ".join(str(path.relative_to(out)) for path in replaced)
        raise OutputError(f"--out {out} holds {names}, which this run's export would remove or replace, and no model "
                          "this command wrote: choose another --out, or move those files elsewhere, or pass "
                          "--overwrite to replace them")


def check_resume_keeps_finished_model(args: argparse.Namespace) -> None:
    """Refuse a ``--resume`` whose export would replace a finished model in ``--out`` that its run
    was not going to replace, unless ``--overwrite`` (Note: [Never lose a run], rule 6, in ``finetune.py``).

    A checkpoint under ``--out``'s checkpoints with ``--steps`` at or past the finished model's step
    is its run's, continued: that model is this run's own (a resume to train on past it) or an
    earlier one of fewer steps, which the run that saved the checkpoint was going to overwrite
    (:func:`holds_finished_model`). Any other is not: a checkpoint of another ``--out``'s run, or an
    older checkpoint of the run that finished, whose export of fewer steps would replace it.

    Raises:
        OutputError: what is there, and what to pass instead.
    """
    if args.overwrite or not holds_finished_model(args.out, 0):
        return
    checkpoints = (args.out / "checkpoints").resolve()
    if not args.resume.resolve().is_relative_to(checkpoints):
        raise OutputError(f"--out {args.out} holds a finished model, which this run's export would replace, and "
                          f"--resume {args.resume} is not one of its checkpoints (under {args.out / 'checkpoints'}): "
                          "choose another --out, or pass --overwrite to replace it")
    if holds_finished_model(args.out, args.steps + 1):  # of a later step than this run's, or of an unknown one
        step = finished_step(args.out)
        if step is None:
            raise OutputError(f"--out {args.out} holds a finished model, which this run's export would replace: "
                              "choose another --out, or pass --overwrite to replace it")
        raise OutputError(f"--out {args.out} holds a finished model of step {step}, which this run's export of step "
                          f"{args.steps} would replace: pass --steps N > {step} to train on past it, or choose "
                          "another --out, or pass --overwrite to replace it")


def finished_step(out: Path) -> int | None:
    """The step of the model the export record in ``out`` says is there, else ``None``."""
    try:
        return int(json.loads((out / EXPORT_RECORD).read_text(encoding="utf-8"))["step"])
    except (OSError, ValueError, TypeError, KeyError):
        return None


def saved_as(path: Path) -> tuple[int, int] | None:
    """Which directory ``path`` is while ``latest`` names it (its device and inode), else ``None``.
    Compared before and after a save, it tells whether that save committed, also when it raised:
    a commit renames a new directory into the name (Note: [Atomic save] in ``offload/checkpoint/commit.py``)."""
    try:
        if latest_checkpoint(path.parent) != path:
            return None
        identity = path.stat()
    except (CheckpointError, OSError):
        return None
    return identity.st_dev, identity.st_ino


def replaced_files(out: Path) -> list[Path]:
    """The files in ``out`` that an export removes before it writes its own: a model's
    (:data:`MODEL_FILES`) and a tokenizer's (:data:`TOKENIZER_FILES`), sorted."""
    return sorted({path for pattern in (*MODEL_FILES, *TOKENIZER_FILES) for path in out.glob(pattern)
                   if path.is_file()})


def remove_model_files(out: Path) -> list[Path]:
    """Remove the previous model's and its tokenizer's files in ``out`` (:func:`replaced_files`)
    before an export writes its own, and return them, so that ``out`` holds the new model and its
    own tokenizer alone. Checkpoints, the export record and other files are left."""
    removed = replaced_files(out)
    for path in removed:
        path.unlink()
    with contextlib.suppress(OSError):  # absent, or holding files of someone else's: left
        (out / CHAT_TEMPLATES_DIR).rmdir()
    return removed


def replaced_bytes(out: Path) -> int:
    """The bytes an export gets back removing the previous model's files from ``out``
    (:func:`remove_model_files`), a failed export's shards among them: a file's bytes, or the
    blocks it holds when fewer (a sparse file); a file with another link frees nothing."""
    freed = 0
    for path in replaced_files(out):
        with contextlib.suppress(OSError):  # gone meanwhile: nothing to count
            found = path.stat()
            blocks = getattr(found, "st_blocks", None)  # in 512-byte units; none on Windows
            held = found.st_size if blocks is None else min(found.st_size, 512 * blocks)
            freed += held if found.st_nlink == 1 else 0
    return freed


def _device_of(path: Path) -> tuple[int, Path]:
    """The file system holding ``path`` (its nearest existing ancestor's)."""
    existing = path.resolve()
    while not existing.exists():
        existing = existing.parent
    return os.stat(existing).st_dev, existing


def _block_size(path: Path) -> int:
    """The unit in which ``path``'s file system gives a file room (4096 bytes where it cannot say)."""
    try:
        return os.statvfs(path).f_frsize or 4096
    except (AttributeError, OSError):  # no statvfs (Windows)
        return 4096


def check_room(writes: Sequence[Write]) -> None:
    """Check that each file system has room for the writes that land on it, added up.

    A write's ``frees`` offset its own bytes alone: the export removes the previous model just
    before it writes, after every other write of the run (the checkpoints, the disk tier's files),
    which that room cannot hold meanwhile.

    Raises:
        OutputError: a file system's free bytes fall short, listing the writes that need them.
    """
    by_device: dict[int, tuple[Path, list[Write]]] = {}
    for write in writes:
        device, existing = _device_of(write.path)
        by_device.setdefault(device, (existing, []))[1].append(write)
    for existing, group in by_device.values():
        free = shutil.disk_usage(existing).free
        block = _block_size(existing)
        sizes = [w.nbytes + w.files * block for w in group]
        needed = sum(max(0, size - w.frees) for size, w in zip(sizes, group))
        if needed > free:
            items = "; ".join(f"{w.what} in {w.path}: {size_text(size)}"
                              + (f", less {size_text(w.frees)} of files there it replaces" if w.frees else "")
                              for size, w in zip(sizes, group))
            raise OutputError(f"not enough room on the disk holding {existing}: {size_text(free)} free, the run "
                              f"writes {size_text(needed)} there ({items}). Free some space or choose other "
                              "directories, before anything trains")


def check_outputs_writable(args: argparse.Namespace) -> None:
    """The run's directories made and probed, no earlier run's checkpoints in ``--out`` for a run
    that does not resume, and no finished model there, nor model or tokenizer files the command did
    not write, that the run's export would replace unasked (Note: [Never lose a run], rules 1, 5 and 6).

    Raises:
        OutputError: the first that fails, naming the flag and what to do.
    """
    check_writable(args.out, "--out")
    if args.save_every and args.resume is None:
        check_no_earlier_run(args.out / "checkpoints")
    if args.model is not None and args.out.resolve() == args.model.resolve():
        raise OutputError(f"--out {args.out} is --model, whose weights the export would remove (a LoRA adapter's "
                          "base among them): choose another --out")
    if args.resume is None:
        check_no_finished_model(args.out, overwrite=args.overwrite)
    else:
        check_resume_keeps_finished_model(args)
    check_no_foreign_files(args.out, overwrite=args.overwrite)
    if args.save_every:
        check_writable(args.out / "checkpoints", "--save-every: the checkpoints' directory")
    if args.disk_tier is not None:
        check_writable(args.disk_tier, "--disk-tier")


def planned_writes(args: argparse.Namespace, model: OffloadModel, trained: Any, tokenizer: Any) -> list[Write]:
    """What the run will write where: the export in full (:func:`export_size`), less the previous
    model's files in ``--out`` that it replaces (:func:`replaced_bytes`: a failed export's shards
    among them, so that its retry is not refused for room the command holds itself), and the kept
    checkpoints' and the disk tier's tensors (their files' headers aside). ``trained``: the model
    whose parameters train, the ``PeftModel`` under ``--lora-r``.

    Raises:
        OutputError: the export's small files could not be measured (:func:`export_size`).
    """
    every = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    learned = sum(p.numel() for p in trained.parameters() if p.requires_grad)
    state = 8 * learned  # AdamW's two float32 moments
    nbytes, files = export_size(args, model, trained, tokenizer, every)
    writes = [Write(args.out, nbytes, "the trained model", files=files, frees=replaced_bytes(args.out))]
    if args.save_every:
        saves = args.steps // args.save_every
        # keep_last removes the oldest once the newest is written: one more than kept at a time.
        kept = saves if args.keep_checkpoints is None else min(saves, args.keep_checkpoints + 1)
        writes.append(Write(args.out / "checkpoints", kept * (every + state), f"{kept} checkpoint(s)"))
    if args.disk_tier is not None:
        masters = 4 * sum(p.numel() for p in model.parameters()) if args.masters_on_disk else 0
        writes.append(Write(args.disk_tier, state + masters, "the disk tier's files"))
    return writes


#: A bound on a safetensors file's bytes besides its tensors' data and their entries: the header's
#: length, its metadata (``{"format": "pt"}``) and its padding to 8 bytes.
_SHARD_FRAME_BYTES = 64
#: A bound on a tensor's line in the index besides its name: the indent, the quotes and the shard's
#: name (``model-00001-of-00004.safetensors``).
_INDEX_ENTRY_BYTES = 64
#: A bound on what a small file of the export holds beyond the file saved before training: the
#: config's ``dtype`` and ``architectures``, which the export sets, an adapter's base path; the
#: index's frame, and the export record, are counted as one each.
_SMALL_FILE_SLACK = 1024


def export_size(args: argparse.Namespace, model: OffloadModel, trained: Any, tokenizer: Any,
                tensor_bytes: int) -> tuple[int, int]:
    """The bytes the export writes into ``--out``, and how many files, at most (Note: [Never lose a
    run], rule 1, in ``finetune.py``).

    The tensors (``tensor_bytes``, the whole model's; the trainable ones under ``--lora-r``), each
    with its entries in its shard's header and in the index, and the small files: the tokenizer's,
    the config and generation config (an adapter's config and model card under ``--lora-r``), saved
    from the model before training into a temporary directory and measured there. A tokenizer alone
    is some MiB (Llama 3's ``tokenizer.json`` 9, Gemma's 33): leaving it out let a run pass the check,
    train, and fail at its export.

    Raises:
        OutputError: the temporary directory could not be written, naming it.
    """
    if args.lora_r:  # one adapter_model.safetensors, no index
        learned = [(name, p) for name, p in trained.named_parameters() if p.requires_grad]
        tensor_bytes = sum(p.numel() * p.element_size() for _, p in learned)
        stored = {name: tuple(p.shape) for name, p in learned}
        shards = 1
    else:
        stored = _stored_shapes(trained)
        shards = model.num_slices + 1  # one a slice, and one for what no slice holds
    small, small_files = _small_files_size(args, trained, tokenizer)
    entries = sum(_entry_bytes(name, shape) for name, shape in stored.items())
    others = small_files + 2  # and the index, the export record
    framing = shards * _SHARD_FRAME_BYTES + others * _SMALL_FILE_SLACK
    return tensor_bytes + entries + small + framing, shards + others


def _stored_shapes(hf: Any) -> dict[str, tuple[int, ...]]:
    """The names and shapes ``save_causal_lm`` stores ``hf``'s tensors under: its conversion mapping
    reverted (a mixture's stacked experts stored one by one, an entry each), on meta tensors, which
    hold no data."""
    from transformers.core_model_loading import revert_weight_conversion

    meta = {name: torch.empty(t.shape, dtype=t.dtype, device="meta") for name, t in hf.state_dict().items()}
    return {name: tuple(t.shape) for name, t in revert_weight_conversion(hf, meta).items()}


def _entry_bytes(name: str, shape: Sequence[int]) -> int:
    """A bound on a tensor's entries in its shard's header and in the index: the header's JSON at
    the longest dtype and offsets no file reaches, with the spaces safetensors leaves out, and the
    index's line."""
    header = json.dumps({name: {"dtype": "F8_E4M3", "shape": list(shape), "data_offsets": [2**64, 2**64]}})
    return len(header.encode()) + len(json.dumps(name).encode()) + _INDEX_ENTRY_BYTES


def _small_files_size(args: argparse.Namespace, trained: Any, tokenizer: Any) -> tuple[int, int]:
    """The bytes and count of the export's files but its tensors', saved into a temporary directory
    as the export saves them (:func:`export_size`)."""
    try:
        with tempfile.TemporaryDirectory(prefix="offload-finetune-export-") as folder:
            tokenizer.save_pretrained(folder)
            if args.lora_r:  # what PeftModel.save_pretrained writes beside the adapter's tensors
                trained.peft_config[trained.active_adapter].save_pretrained(folder)
                trained.create_or_update_model_card(folder)
            else:  # what save_causal_lm writes beside the shards and their index
                trained.config.save_pretrained(folder)
                if trained.can_generate() and getattr(trained, "generation_config", None) is not None:
                    trained.generation_config.save_pretrained(folder)
            sizes = [path.stat().st_size for path in Path(folder).rglob("*") if path.is_file()]
    except OSError as error:  # a full or missing temporary directory: the error names it
        raise OutputError(f"cannot measure the files the export writes beside the weights (its tokenizer's, its "
                          f"config) by saving them into a temporary directory: {error}. Free some space there or set "
                          "TMPDIR to a directory with room, before anything trains") from error
    return sum(sizes), len(sizes)


def mark_export(out: Path, step: int, *, finished: bool) -> None:
    """Record in ``out`` that the model of ``step`` is being written there, or is written whole.

    The record is replaced in one rename, so it is never half-written: a run stopped mid-export
    leaves the "being written" one, whatever the model's files are by then.
    """
    partial = out / f".{EXPORT_RECORD}.partial"
    partial.write_text(json.dumps({"step": step, "finished": finished}) + "\n", encoding="utf-8")
    os.replace(partial, out / EXPORT_RECORD)


def holds_finished_model(out: Path, step: int) -> bool:
    """Whether ``out`` holds a finished model of ``step`` or later (``0``: of any step).

    A resume from checkpoint ``step`` with nothing to train must not export over one (rule 4), nor
    a resume that trains to ``--steps`` over one past it (``step`` is ``--steps`` + 1 there:
    :func:`check_resume_keeps_finished_model`).

    Its export record says so: a finished model of ``step`` or later. One of an earlier step is an
    earlier run's (a run into the same ``--out`` with fewer steps), which the run that saved this
    later checkpoint was going to overwrite when it exported: resuming it does what that run had
    left. An older checkpoint resumed by mistake is refused. Without a record, any weights there
    are taken for a finished model (written before the record existed, or by something else), and
    an unreadable record for one too: overwriting a model that was unfinished costs a ``--out``
    elsewhere, one that was finished costs the run.
    """
    try:
        record = json.loads((out / EXPORT_RECORD).read_text(encoding="utf-8"))
        return bool(record["finished"]) and int(record["step"]) >= step
    except (FileNotFoundError, NotADirectoryError):
        return any(out.glob("*.safetensors")) or any(out.glob("*.bin"))
    except (OSError, ValueError, TypeError, KeyError):
        return True


def resume_command(argv: Sequence[str], checkpoint: Path, program: str | None = None) -> str:
    """The command line that continues from ``checkpoint``: the run's own, ``--resume`` replaced,
    after ``program``, the command that started it (default: as this process was started)."""
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
        program = invoked_as("offload-finetune")
    return " ".join([program, *map(shlex.quote, [*args, "--resume", str(checkpoint)])])


@dataclass
class RunRecord:
    """What a run has saved so far, for the line it prints when it stops early."""

    argv: list[str]
    program: str | None = None  # the command that started the run, for its resume command
    save_every: int = 0  # --save-every: the step of the first checkpoint (0: none is saved)
    step: int = 0  # the last step done
    checkpoint: Path | None = None  # the last checkpoint saved, or the one the run resumed from

    def stopped(self, why: str) -> str:
        """One line: how far the run got, where its last checkpoint is and how to continue."""
        if self.step == 0 and self.checkpoint is None:
            return f"{why} before the first step; nothing was trained"
        if self.step == 0:  # a resume stopped before its load told the step: no checkpoint is at step 0
            return (f"{why} before the first step of this run; nothing was trained, and the checkpoint it resumes, "
                    f"{self.checkpoint}, is as it was; resume with: "
                    f"{resume_command(self.argv, self.checkpoint, self.program)}")
        if self.checkpoint is None and self.save_every and self.step >= self.save_every:
            # Its step was done and its save under way: a save that raises leaves nothing new.
            where = (f"no checkpoint was saved: the first, step-{self.save_every}, was being saved and did not "
                     "complete, so none was kept")
            return f"{why} after step {self.step}; {where}"
        if self.checkpoint is None:
            where = "no checkpoint was saved (--save-every N saves one every N steps)"
            return f"{why} after step {self.step}; {where}"
        return (f"{why} after step {self.step}; last checkpoint: {self.checkpoint}; "
                f"resume with: {resume_command(self.argv, self.checkpoint, self.program)}")
