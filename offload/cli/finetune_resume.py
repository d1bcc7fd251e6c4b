"""``offload-finetune --resume``: a checkpoint loaded into the run, its schedule brought to the
step, and the line for a checkpoint that cannot be loaded, or one saved by a run that read its
data otherwise, in the command's flags."""

from __future__ import annotations

import argparse
import re
import shlex
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import load_checkpoint
from ..checkpoint.checkpoint_files import CheckpointError
from ..model import OffloadModel
from ..optimizer import OffloadOptimizer
from .finetune_args import DEFAULT_TEXT, SCHEDULES, fail, no_steps_left, resume_directory_advice
from .outputs import holds_finished_model

__all__ = ["DATA_OPTIONS", "EVAL_OPTIONS", "TRAIN_STREAM_OPTIONS", "data_options", "lr_scheduler", "resume",
           "resume_failure"]

#: The options that decide which blocks each step trains on (``finetune_data.Batches.train``;
#: ``--eval-fraction`` holds blocks out of that stream): a resume replays the block stream to the
#: checkpoint's step (Note: [Never lose a run], rule 3, in ``finetune.py``), which holds only if it
#: reads the stream the saved run read, so a resume with others is refused.
TRAIN_STREAM_OPTIONS = ("data", "text_field", "seq_len", "seed", "batch_size", "grad_accum", "shuffle_buffer",
                        "eval_fraction")
#: The options that decide only what an evaluation reads: a resume with others trains on the same
#: batches, and is let through with a note that its evaluation figures are not the saved run's.
EVAL_OPTIONS = ("eval_file", "eval_batches")
#: Both, saved in every checkpoint's ``extra`` under ``"data"``. ``--eval-every`` and ``--steps``
#: say when, not what: not here.
DATA_OPTIONS = TRAIN_STREAM_OPTIONS + EVAL_OPTIONS


def lr_scheduler(args: argparse.Namespace, optimizer: OffloadOptimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """transformers' schedule with linear warm-up (``get_scheduler``); built before a resume loads
    the optimizer, so its base learning rate is ``--lr``."""
    import transformers

    return transformers.get_scheduler(SCHEDULES[args.lr_schedule], optimizer, num_warmup_steps=args.warmup_steps,
                                      num_training_steps=args.steps)


def resume(args: argparse.Namespace, model: OffloadModel, optimizer: OffloadOptimizer,
           scheduler: torch.optim.lr_scheduler.LRScheduler) -> int:
    """Load ``--resume`` into the model and the optimizer and bring the schedule to its step; the steps done."""
    if args.resume is None:
        return 0
    try:
        extra = load_checkpoint(args.resume, model, optimizer)
    except CheckpointError as error:
        raise fail(resume_failure(args, error)) from None
    _check_same_data(args, extra)
    refusal = no_steps_left(extra["step"], args.steps, args.out)  # Note: [Never lose a run], rule 4
    if refusal is not None:
        raise fail(refusal)
    with warnings.catch_warnings():
        # The schedule is a function of the step: stepping it without optimizer steps replays it.
        # The filter's message is a regular expression matched at the start of the warning's.
        warnings.filterwarnings("ignore", re.escape("Detected call of `lr_scheduler.step()`"), UserWarning)
        for _ in range(extra["step"]):
            scheduler.step()
    print(f"resumed from {args.resume} after step {extra['step']}")
    if extra["step"] == args.steps:
        left = "the final evaluation and the export" if args.eval_file or args.eval_fraction else "the export"
        print(f"nothing left to train (--steps {args.steps}); running what the stopped run had left: {left} "
              f"into {args.out}")
    return extra["step"]


def resume_failure(args: argparse.Namespace, error: CheckpointError) -> str:
    """The line for a checkpoint ``--resume`` cannot load: what the library found, with advice in
    the command's flags where the library's is in terms of its API."""
    finding = str(error)
    for api_advice in (" Build the OffloadModel", " Nothing was loaded"):
        finding = finding.split(api_advice)[0]
    finding = finding.rstrip(". ")
    slices = re.search(r"saved from a model cut into (\d+) slices", finding)
    if slices is not None:
        advice = f"pass --num-slices {slices[1]}, as the run that saved it did"
    elif "the directory checkpoints were saved into" in finding:
        return resume_directory_advice(args.resume)
    elif "damaged" in finding or "incomplete" in finding or finding.startswith("no checkpoint"):
        checkpoints = args.out / "checkpoints"
        advice = f"pass --resume an earlier checkpoint (under {checkpoints}), or start over: {_start_over(args)}"
    elif (positions := _saved_positions(args, error)) is not None:
        seq_len = f"--seq-len {positions}" if positions > 64 else "--seq-len 64 or less"
        advice = (f"pass {seq_len}, as the run that saved it did (a random model's position table has "
                  "max(--seq-len, 64) rows), or leave out --resume to start over")
    else:
        advice = ("pass the options of the run that saved it (--model, or --arch and --size; --lora-r, "
                  "--lora-targets, --untie-embeddings; --compute-dtype, --load-in-4bit and the "
                  "--bnb-4bit-* options, which change how a quantized base is stored), or leave out --resume to "
                  "start over")
    return f"--resume: {finding}; {advice}"


def _start_over(args: argparse.Namespace) -> str:
    """What a new run into ``--out`` instead of the resume needs to be let through."""
    # A new run with --save-every is refused beside that run's checkpoints (check_no_earlier_run).
    start_over = (f"choose another --out, or remove {args.out / 'checkpoints'}, and leave out --resume"
                  if args.save_every else "leave out --resume")
    if holds_finished_model(args.out, 0):  # a new run's export would replace it (check_no_finished_model)
        start_over += " and pass --overwrite"
    return start_over


#: What a checkpoint records for the shipped sample text (``--data``'s default), which moves with
#: the installation: the same data wherever the package is.
SAMPLE = "the shipped sample.txt"


def data_options(args: argparse.Namespace) -> dict[str, Any]:
    """This run's :data:`DATA_OPTIONS`, a path made absolute: the same file named from another
    directory is the same data."""
    return {name: SAMPLE if name == "data" and value == DEFAULT_TEXT else
            str(value.resolve()) if isinstance(value, Path) else value
            for name, value in ((name, getattr(args, name)) for name in DATA_OPTIONS)}


def _check_same_data(args: argparse.Namespace, extra: dict[str, Any]) -> None:
    """Refuse a resume whose :data:`TRAIN_STREAM_OPTIONS` differ from those its checkpoint was saved
    with: the replay would skip another stream's blocks, some trained twice, others never. A change of
    :data:`EVAL_OPTIONS` gets a note. A checkpoint saved before they were recorded resumes unchecked."""
    saved = extra.get("data")
    if not isinstance(saved, dict):
        return
    here = data_options(args)
    changed = [name for name in DATA_OPTIONS if name in saved and saved[name] != here[name]]
    if "data" in changed and None not in (saved["data"], here["data"]):
        # Not refused: the file may have moved (another disk); its contents decide.
        print(f"note: --resume: checkpoint {args.resume} was saved by a run that read --data {_shown(saved['data'])}, "
              f"this one reads {_shown(here['data'])}: the batches are that run's only if the two hold the same data",
              file=sys.stderr, flush=True)
        changed.remove("data")
    refused = [name for name in changed if name in TRAIN_STREAM_OPTIONS]
    if refused:
        raise fail(f"--resume: checkpoint {args.resume} was saved by a run that read its data otherwise "
                   f"({_listed(refused, saved, here)}), so the batches would differ from those that run would have "
                   f"drawn (the resume replays its block stream to step {extra['step']}): pass the old values to "
                   f"resume it, or start a new run: {_start_over(args)}")
    if changed:  # the training batches are the saved run's: only what the evaluations read differs
        print(f"note: --resume: checkpoint {args.resume} was saved by a run that evaluated otherwise "
              f"({_listed(changed, saved, here)}): the evaluation figures are not comparable with that run's, "
              "the training batches are the same", file=sys.stderr, flush=True)


def _listed(names: list[str], saved: dict[str, Any], here: dict[str, Any]) -> str:
    return "; ".join(f"{_flag(name)} was {_shown(saved[name])}, now {_shown(here[name])}" for name in names)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _shown(value: Any) -> str:
    return "unset" if value is None else shlex.quote(str(value))


def _saved_positions(args: argparse.Namespace, error: CheckpointError) -> int | None:
    """The saved run's position-table rows, where ``error`` says that only --seq-len differs.

    A random model's position table (GPT-2's ``wpe``) has ``max(--seq-len, 64)`` rows
    (``models.random_model``): every tensor that differs does so in a dimension of that size here,
    and in that dimension only.
    """
    if args.model is not None or not error.shapes:
        return None  # a saved model's shapes are its own, whatever --seq-len; or other tensors differ
    here_rows = max(args.seq_len, 64)
    saved_rows = set()
    for there, here in error.shapes.values():
        differing = [k for k, (a, b) in enumerate(zip(there, here)) if a != b]
        if len(there) != len(here) or len(differing) != 1 or here[differing[0]] != here_rows:
            return None
        saved_rows.add(there[differing[0]])
    return saved_rows.pop() if len(saved_rows) == 1 else None
