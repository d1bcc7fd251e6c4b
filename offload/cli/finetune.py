"""``offload-finetune``: fine-tune a Hugging Face causal LM with OffloadModel and OffloadOptimizer, end to end.

The model is a small random-initialised one built from a config (bytes as tokens, nothing
downloaded) or a local ``save_pretrained`` directory (``--model``), loaded slice by slice into the
host copies (``load_causal_lm``; LoRA's adapters are injected there), or with ``from_pretrained``
for ``--untie-embeddings``.
The data (``--data``) is read and tokenised lazily and packed into ``--seq-len`` blocks
(:mod:`offload.integrations.data`); an eval split, a learning-rate schedule with warm-up,
gradient accumulation and clipping, or the update during backward, are options. The trained model is written a slice at a time
(:func:`~offload.integrations.transformers_saving.save_causal_lm`), or the adapter with LoRA.

Note: [Never lose a run]
    1. Every directory the run writes (``--out``, its checkpoints, ``--disk-tier``) is made and
       written to before the model is built, and each disk is checked for the room the run's
       writes need once the model's size is known (the export's whole: its tensors with their
       headers, its config and tokenizer files, less the previous model's files it replaces;
       ``outputs.planned_writes``): both before the first step.
    2. After the first step, a run that stops says how far it got, where its last checkpoint is
       and the command that resumes from it: one line for Ctrl-C (exit status 130) and for SIGTERM,
       a scheduler's or ``kill``'s stop (exit status 143; :class:`Terminated`), that line
       and the error's message for a checkpoint that could not be saved, that line and the
       reader's message for data it refuses (with the advice to mend the data first: the resume
       reads the same stream to the same record), that line and the error's traceback for any
       other error.
    3. Batches are a function of the data options and the step alone (the block stream replayed),
       so a resumed run draws the batches the stopped one would have. Every checkpoint records
       those options and the evaluation's (``finetune_resume.DATA_OPTIONS``); a resume with other
       training-stream options (``TRAIN_STREAM_OPTIONS``) is refused after the load, before anything
       trains, and one with other evaluation options (``EVAL_OPTIONS``: ``--eval-file``,
       ``--eval-batches``) goes on with a note that its evaluation figures are not the saved run's;
       a checkpoint without the record is resumed as it is.
    4. A finished model in ``--out`` is never overwritten by a run that trained nothing. A resume
       from a checkpoint past ``--steps`` is refused before anything trains, and so is one from a
       checkpoint at ``--steps`` when ``--out`` holds a finished model (its export record, written
       after the model's last file, says so: ``outputs.mark_export``). A resume from a checkpoint at
       ``--steps`` into an unfinished ``--out`` trains nothing and runs what its run had left, the
       final evaluation and the export: so the command printed by a run stopped after its last
       checkpoint (an export that failed, Ctrl-C in the final evaluation) finishes it.
    5. A run that saves checkpoints without ``--resume`` into an ``--out`` whose checkpoints an
       earlier run saved is refused before anything is built: its saves would replace that run's
       of the same steps and ``--keep-checkpoints`` remove the others, its furthest among them
       (a job launched again without its ``--resume``).
    6. A run into an ``--out`` holding a finished model is refused before anything is built unless
       ``--overwrite``, or it resumes a checkpoint under ``--out`` to ``--steps`` at or past that model's
       (its run's, or a later run's that was to replace it: ``outputs.check_resume_keeps_finished_model``).
       Every export first removes the previous model's files there (``outputs.remove_model_files``: old
       shards and index, a full model's under an adapter, an adapter under a full model, the old
       tokenizer's files, a failed export's shards), so ``--out`` holds one model and its own
       tokenizer; an ``--out`` that is ``--model`` is refused, whose weights (a LoRA adapter's base)
       the export would remove.

The options and ``--help`` are in ``offload/cli/finetune_args.py``; the models in
``offload/cli/models.py``; the output checks in ``offload/cli/outputs.py``; the data in
``finetune_data.py``, the loss in ``finetune_loss.py`` and the resume in ``finetune_resume.py``.
"""

from __future__ import annotations

import argparse
import itertools
import math
import signal
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# PyTorch warns at import when NumPy is not installed, though nothing here needs NumPy.
warnings.filterwarnings("ignore", "Failed to initialize NumPy", UserWarning)

import torch

from ..checkpoint import save_checkpoint
from ..checkpoint.checkpoint_files import CheckpointError
from ..clipping import clip_grad_norm_
from ..integrations import install_hint
from ..tiers.disk_tier import DiskTier
from ..model import OffloadModel
from ..optimizer import OffloadOptimizer
from .finetune_args import DTYPES, PROG, fail, parse_args
from .finetune_data import Batches, check_data_readable
from .finetune_loss import batch_loss, evaluate, router_coefficient
from .finetune_resume import data_options, lr_scheduler, resume
from .models import (four_bit_settings, pretrained_model, pretrained_tokenizer, quantized_random_model, random_model,
                     with_lora)
from .invocation import invoked_as
from .outputs import (OutputError, RunRecord, check_outputs_writable, check_room, mark_export, planned_writes,
                      remove_model_files, saved_as)
from .quantize import bnb_config

__all__ = ["main", "parse_args"]

def main(argv: list[str] | None = None, program: str | None = None) -> None:
    """Run ``offload-finetune`` on ``argv`` (default: the command line's). ``program``: the command
    that started it, which its usage, errors and resume line name (default: as this process was
    started when ``argv`` is the command line's, else ``offload-finetune``)."""
    if program is None:
        program = PROG if argv is not None else invoked_as(PROG)
    argv = sys.argv[1:] if argv is None else list(argv)
    record = RunRecord(argv, program)
    try:
        with _terminated_on_sigterm():
            run(argv, record)
    except SystemExit as stop:
        # fail()'s lines name the program as the parser's do: as it was started.
        if isinstance(stop.code, str) and stop.code.startswith(f"{PROG}: ") and program != PROG:
            raise SystemExit(program + stop.code.removeprefix(PROG)) from None
        raise
    except KeyboardInterrupt as stop:
        # Note: [Never lose a run], rule 2: one line, no traceback.
        terminated = isinstance(stop, Terminated)
        print(f"\n{record.stopped('terminated' if terminated else 'interrupted')}", file=sys.stderr, flush=True)
        raise SystemExit(128 + (signal.SIGTERM if terminated else signal.SIGINT)) from None


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread as Ctrl-C's ``KeyboardInterrupt`` is: whatever lets an
    interrupt through (a checkpoint half written is discarded, the last one stays ``latest``)
    does the same for it, and the run ends with the line that says how to resume."""


@contextmanager
def _terminated_on_sigterm() -> Iterator[None]:
    """SIGTERM raises :class:`Terminated` while the run lasts, unless someone else handles it
    (a caller's handler, or an ignored one, is left alone) or this is not the main thread, where
    Python cannot set handlers."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return

    def terminate(signum: int, frame: Any) -> None:
        raise Terminated

    signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _schedule(args: argparse.Namespace) -> dict[str, Any]:
    """The optimizer's options for when its work runs: the update in backward, or the norms the
    clipping takes computed there and its scaling in the update (Notes: [Norms from backward],
    [Scaling in the update]: this loop writes no gradient between backward and the clipping, and
    reads none between the clipping and ``step()``); ``accumulation_steps`` says which backward."""
    if args.update_in_backward:
        return {"update_in_backward": True, "accumulation_steps": args.grad_accum}
    if args.max_grad_norm is not None:
        return {"norms_in_backward": True, "scale_in_update": True, "accumulation_steps": args.grad_accum}
    return {}


def run(argv: list[str], record: RunRecord) -> None:
    """The whole run; ``record`` follows its steps and checkpoints for the line that ends it early."""
    args = parse_args(argv, record.program or PROG)
    record.save_every, record.checkpoint = args.save_every, args.resume  # a stop while loading names it too
    tqdm, DataFormatError, causal_lm_sequential, load_causal_lm = _start(args)
    torch.manual_seed(args.seed)
    tier = None if args.disk_tier is None else DiskTier(args.disk_tier)
    # A 4-bit base is loaded in the compute dtype and computes in it: no shadow (models.four_bit_settings).
    options = {"num_slices": args.num_slices, "num_microbatches": args.microbatches,
               "compute_dtype": None if args.load_in_4bit else DTYPES[args.compute_dtype],
               "masters": tier if args.masters_on_disk else None,
               "shadows": "disk" if args.shadows_on_disk else "ram",
               "resident_slices": args.resident_slices}
    model, hf, tokenizer, peft_model = _build_model(args, options, causal_lm_sequential, load_causal_lm)
    _check_vocabulary(args, hf, tokenizer)
    # None (no load-balancing loss) or its coefficient, from here on (Note: [A router loss in the command]).
    args.router_aux_loss_coef = router_coefficient(args, hf)
    trained = hf if peft_model is None else peft_model
    trainable = [p for p in trained.parameters() if p.requires_grad]
    try:
        check_room(planned_writes(args, model, trained, tokenizer))  # Note: [Never lose a run], rule 1
        batches = Batches(args, tokenizer)
        evaluation = batches.evaluation()
    except OutputError as error:
        raise fail(str(error)) from None
    except DataFormatError as error:
        raise fail(str(error)) from None
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=args.lr, weight_decay=0.0, fused=True, disk_tier=tier,
                                 **_schedule(args))
    scheduler = lr_scheduler(args, optimizer)
    print(_summary(args, model, hf))

    done = resume(args, model, optimizer, scheduler)
    train_batches: Iterator[torch.Tensor] = iter(())  # none when nothing is left to train (rule 4)
    try:
        if done < args.steps:
            # The first batch read now: data that cannot be read stops the run before its first step.
            stream = batches.train(skip=done)
            train_batches = itertools.chain([next(stream)], stream)
    except DataFormatError as error:
        raise fail(str(error)) from None
    record.step, record.checkpoint = done, args.resume
    with _stop_lines(args, record, DataFormatError):
        loss_value, seen, elapsed = train(args, model, hf, optimizer, scheduler, trainable, train_batches, evaluation,
                                          record, done, tqdm)
    _save(args, model, hf, peft_model, tokenizer, optimizer, record)
    print(_last_line(args, done, loss_value, seen, elapsed))


@contextmanager
def _stop_lines(args: argparse.Namespace, record: RunRecord, data_format_error: type[Exception]) -> Iterator[None]:
    """Around the steps: an error ends the run with the line that says how far it got and how to
    resume, then the error (Note: [Never lose a run], rule 2)."""
    try:
        yield
    except CheckpointError as error:
        # A save the library refused or undid (a full disk, say) explains itself: its message and
        # the stop line, no traceback.
        print(record.stopped("stopped: a checkpoint could not be saved"), file=sys.stderr, flush=True)
        raise fail(str(error).replace(" and save again.", " and resume with the command above.")) from None
    except data_format_error as error:
        # The reader's message says what is wrong where; the printed resume alone would replay the
        # stream into the same record and stop there again, so the data is mended first.
        print(record.stopped("stopped by a data error"), file=sys.stderr, flush=True)
        finding = str(error).rstrip(". ")
        if record.checkpoint is None:
            raise fail(f"{finding}. Fix it in --data {args.data}, then run again") from None
        raise fail(f"{finding}. Fix it in --data {args.data} itself, then resume with the command above: the resume "
                   "reads the same stream again, to the checkpoint's step and on, and would stop at this record "
                   "again") from None
    except Exception as error:
        print(record.stopped(f"stopped by {type(error).__name__}"), file=sys.stderr, flush=True)
        raise


def _check_vocabulary(args: argparse.Namespace, hf: Any, tokenizer: Any) -> None:
    """Refuse a tokenizer whose ids run past the model's input embeddings, before the first step:
    the first batch holding such an id would stop the run in the embedding (a device-side assert on
    CUDA), hours in when those ids are rare. Fewer ids than rows is usual (a vocabulary padded to a
    multiple of 64, say) and goes on."""
    embeddings = hf.get_input_embeddings()
    rows = getattr(embeddings, "num_embeddings", None)
    if rows is None or len(tokenizer) <= rows:
        return
    raise fail(f"--model {args.model}: its tokenizer has {len(tokenizer)} ids and the model's input embeddings "
               f"{rows} rows, so ids {rows} and up have none: save the model with the tokenizer it was trained "
               f"with, or grow its embeddings to the tokenizer (model.resize_token_embeddings({len(tokenizer)}), "
               "then save_pretrained) and pass that")


def _last_line(args: argparse.Namespace, done: int, loss_value: float, seen: int, elapsed: float) -> str:
    """The line a finished run ends with: the last step's loss and the speed, after ``done`` steps resumed."""
    if done == args.steps:
        return f"nothing left to train after step {done}; saved to {args.out}"
    # The loss in full (repr): a resumed run's last line equals the uninterrupted run's.
    return (f"final loss {loss_value!r}; {seen / elapsed:,.0f} tokens/s over {args.steps - done} steps; "
            f"saved to {args.out}")


def _summary(args: argparse.Namespace, model: OffloadModel, hf: Any) -> str:
    """The line a run opens with: the model, how it is cut and where it computes, the data."""
    from ..streams.quantized import is_4bit_weight

    params = sum(p.quant_state.shape.numel() if is_4bit_weight(p) else p.numel() for p in model.parameters())
    resident = f" ({model.resident_slices} resident)" if model.resident_slices else ""
    base = f", {args.bnb_4bit_quant_type} 4-bit base" if args.load_in_4bit else ""
    router = "" if args.router_aux_loss_coef is None else f", load-balancing loss x {args.router_aux_loss_coef:g}"
    return (f"{type(hf).__name__}: {params / 1e6:.1f} M parameters in {model.num_slices} slices{resident} on "
            f"{args.device}, compute dtype {args.compute_dtype}{base}{router}; data {args.data}")


def _save(args: argparse.Namespace, model: OffloadModel, hf: Any, peft_model: Any, tokenizer: Any,
          optimizer: OffloadOptimizer, record: RunRecord) -> None:
    """After the last step: the model saved to ``--out`` once the last update is done (a failed
    save prints the line that ends the run early, then raises), and the disk tier's files removed."""
    try:
        optimizer.synchronize()  # the last update runs beside the loop: let it finish before saving
        # Unfinished from the first file written to the last (Note: [Never lose a run], rule 4): a
        # resume from the last checkpoint may then export again over what this one left.
        mark_export(args.out, args.steps, finished=False)
        remove_model_files(args.out)  # rule 6: the previous model's files, whichever the new one writes
        save_output(args, model, hf, peft_model, tokenizer)
        mark_export(args.out, args.steps, finished=True)
    except Exception as error:
        print(record.stopped(f"saving to {args.out} failed ({type(error).__name__})"), file=sys.stderr, flush=True)
        raise
    optimizer.close()  # a disk tier's files go


def _start(args: argparse.Namespace) -> tuple[Any, Any, Any, Any]:
    """The extra's imports the run needs (tqdm, DataFormatError, causal_lm_sequential,
    load_causal_lm), once the outputs are found writable and the text data UTF-8; exits saying
    what is missing or wrong."""
    try:
        from tqdm import tqdm

        from .quiet_imports import import_transformers

        # Before the modules below: transformers' models import torchao, which logs notes as it loads.
        transformers = import_transformers()
        from ..integrations.data import DataFormatError
        from ..integrations.transformers import causal_lm_sequential
        from ..integrations.transformers_loading import load_causal_lm
    except ImportError as error:
        raise SystemExit(f"{error}. Install the extra: {install_hint('transformers')}") from error
    if args.no_progress:
        transformers.utils.logging.disable_progress_bar()  # the bar of loading checkpoint shards
    try:
        check_outputs_writable(args)  # Note: [Never lose a run], rule 1
        check_data_readable(args)  # before the model is built: a bad byte or row stops the run in seconds
    except (OutputError, DataFormatError) as error:
        raise fail(str(error)) from None
    return tqdm, DataFormatError, causal_lm_sequential, load_causal_lm


def _build_model(args: argparse.Namespace, options: dict[str, Any], causal_lm_sequential: Any,
                 load_causal_lm: Any) -> tuple[OffloadModel, Any, Any, Any]:
    """The OffloadModel the run trains, the Hugging Face model behind it, its tokenizer, and the
    PEFT model around it (``None`` without LoRA)."""
    peft_model = None
    four_bit = four_bit_settings(args, DTYPES[args.compute_dtype])
    if args.model is not None and not args.untie_embeddings:
        # Slice by slice into the host copies (or the masters' files), each linear weight quantised
        # as it is read under --load-in-4bit: the model is never whole in RAM beside them, as
        # from_pretrained would have it.
        loading = {} if four_bit is None else {"dtype": four_bit["compute_dtype"],
                                               "quantization_config": bnb_config(**four_bit)}
        if args.resident_slices:
            _check_resident_slices(args, _stage_count(args.model, causal_lm_sequential))
        try:
            model, hf = load_causal_lm(args.model, args.device, loss_chunk_tokens=args.loss_chunk_tokens or None,
                                       router_logits=None, **loading, **options)
        except FileNotFoundError as error:  # weights it does not read (pytorch_model.bin): it says which
            raise fail(f"--model {error}") from None
        except ValueError as error:  # a checkpoint that does not fit the model, a family it cannot quantise
            raise fail(f"--model {args.model}: {error}") from None
        tokenizer = pretrained_tokenizer(args.model)
        print(f"loaded {args.model} slice by slice")
        # The adapters go into the loaded host modules, as into from_pretrained's model: the same
        # random draws in the same order give the same initial values. The slices are laid out
        # again with them before the first forward (Note: [PEFT models], rule 5).
        peft_model = with_lora(hf, args)
    else:
        if args.model is None:
            hf, tokenizer = random_model(args.arch, args.size, 256, args.seq_len)
            if four_bit is not None:
                try:
                    hf = quantized_random_model(hf, four_bit)
                except ValueError as error:  # a family without nn.Linear layers
                    raise fail(f"--load-in-4bit: {error}") from None
        else:
            hf, tokenizer = pretrained_model(args.model, four_bit)
        peft_model = with_lora(hf, args)
        layers = causal_lm_sequential(hf if peft_model is None else peft_model,
                                      untie_embeddings=args.untie_embeddings,
                                      loss_chunk_tokens=args.loss_chunk_tokens or None, router_logits=None)
        _check_resident_slices(args, len(layers))
        model = OffloadModel(layers, device=args.device, **options)
    return model, hf, tokenizer, peft_model


def _check_resident_slices(args: argparse.Namespace, stages: int | None) -> None:
    """Refuse ``--resident-slices`` above the slices the model is cut into, as the parser refuses a
    bad flag (one line, exit status 2): ``OffloadModel`` cuts no more slices than the model has
    stages (a ``--num-slices`` above them warns and takes one a stage), and the parser could check
    the flag only against the ``--num-slices`` typed. ``stages``: ``None`` when unknown."""
    if stages is None or args.resident_slices <= min(args.num_slices, stages):
        return
    print(f"{args.prog}: error: --resident-slices {args.resident_slices} is more than the model's {stages} stages (a "
          f"slice holds at least one: --num-slices {args.num_slices} makes {stages} slices); pass "
          f"--resident-slices {stages} or fewer", file=sys.stderr)
    raise SystemExit(2)


def _stage_count(folder: Path, causal_lm_sequential: Any) -> int | None:
    """The stages of the model in ``folder``, cut from its config on the meta device (nothing read
    but config.json), before ``load_causal_lm`` builds it with ``--resident-slices``; ``None`` for
    a config that does not build, which the load reports in its own words."""
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(folder)
        with torch.device("meta"):
            return len(causal_lm_sequential(transformers.AutoModelForCausalLM.from_config(config), router_logits=None))
    except Exception:  # noqa: BLE001 (the load says what is wrong with the folder)
        return None


def save_output(args: argparse.Namespace, model: OffloadModel, hf, peft_model, tokenizer) -> None:
    from ..integrations.transformers_saving import save_causal_lm

    if peft_model is not None:
        peft_model.save_pretrained(args.out)  # the adapter only
    else:
        save_causal_lm(model, hf, args.out)  # a slice at a time: with masters on disk, never all in RAM
    tokenizer.save_pretrained(args.out)





def train(args: argparse.Namespace, model: OffloadModel, hf: Any, optimizer: OffloadOptimizer,
          scheduler: torch.optim.lr_scheduler.LRScheduler, trainable: list[torch.Tensor],
          batches: Iterator[torch.Tensor], evaluation: list[torch.Tensor], record: RunRecord, done: int,
          tqdm: Any) -> tuple[float, int, float]:
    """The steps after ``done``: each accumulates ``--grad-accum`` batches, clips, steps and saves.

    Returns the last step's loss, the tokens trained on and the seconds taken."""
    from ..integrations.transformers import CausalLMSequential

    model.train()
    bar = tqdm(range(done + 1, args.steps + 1), desc="fine-tuning", unit="step", disable=args.no_progress,
               file=sys.stdout, initial=done, total=args.steps)
    start = time.perf_counter()
    seen = 0
    loss_value = math.nan
    for step in bar:
        micro = [next(batches) for _ in range(args.grad_accum)]
        tokens = sum(CausalLMSequential.count_loss_tokens(ids) for ids in micro)
        step_loss = None  # on the device: read once per step, below
        for ids in micro:
            loss = batch_loss(args, model, hf, ids.to(args.device), tokens, args.router_aux_loss_coef)
            loss.backward()
            step_loss = loss.detach() if step_loss is None else step_loss + loss.detach()
        if args.max_grad_norm is not None:
            clip_grad_norm_(trainable, args.max_grad_norm)  # torch's result; norms from backward, scaled in the update
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        record.step = step
        loss_value = step_loss.item()
        seen += sum(ids.numel() for ids in micro)
        rate = seen / (time.perf_counter() - start)
        if args.no_progress:
            print(f"step {step}/{args.steps}  loss {loss_value:.4f}  {rate:,.0f} tokens/s", flush=True)
        else:
            bar.set_postfix(loss=f"{loss_value:.4f}", tokens_per_s=f"{rate:,.0f}")
        if args.save_every and step % args.save_every == 0:
            path = args.out / "checkpoints" / f"step-{step}"
            before = saved_as(path)
            try:
                save_checkpoint(path, model, optimizer, extra={"step": step, "data": data_options(args)},
                                keep_last=args.keep_checkpoints)
            except BaseException:
                # An interrupt in the save's clean-up, once it committed, leaves it saved (latest names it).
                if saved_as(path) not in (None, before):
                    record.checkpoint = path
                raise
            record.checkpoint = path
        if evaluation and (step == args.steps or (args.eval_every and step % args.eval_every == 0)):
            _report_evaluation(args, model, hf, evaluation, step, bar)
    if evaluation and done == args.steps:
        # A resume with nothing left to train: the final evaluation, which its run may not have finished.
        _report_evaluation(args, model, hf, evaluation, done, bar)
    bar.close()
    return loss_value, seen, time.perf_counter() - start


def _report_evaluation(args: argparse.Namespace, model: OffloadModel, hf: Any, evaluation: list[torch.Tensor],
                       step: int, bar: Any) -> None:
    """Evaluate after ``step`` and print the loss and perplexity, beside the bar when there is one."""
    eval_loss = evaluate(args, model, hf, evaluation)
    line = f"eval step {step}/{args.steps}  loss {eval_loss:.4f}  perplexity {math.exp(min(eval_loss, 50)):.2f}"
    if args.no_progress:
        print(line, flush=True)
    else:
        bar.write(line, file=sys.stdout)


if __name__ == "__main__":
    main()
