"""``offload plan``: will this model fit on this machine, how fast will a step be, and with what
configuration.

The model is one of the benchmark presets (``--preset``), an ``nn.Sequential`` from a factory
(``--model package.module:factory --input-shape ...``) or a Hugging Face causal LM's config
(``--hf-config``: a ``config.json``, a directory holding one, or the JSON itself), which is built
on the meta device: no weights are read or allocated. Its shapes are profiled on fake tensors for
the batch (``offload/planning/shapes.py``); the machine's rates come from ``offload calibrate``'s
file or a GPU's defaults (``--gpu``); its memory from flags, or detected (host RAM available,
free disk under ``--disk-dir``, the device's memory from the rates: ``plan_machine.py``).
``offload/planning/choose.py`` picks the configuration, among the compute dtypes ``OffloadModel``
builds the model under; this file reads arguments and prints.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..planning.choose import DEVICE_MARGIN, HOST_MARGIN, Candidate, Limits, Plan, choose
from ..planning.estimate_settings import check_dtypes
from ..planning.presets import MAX_SIZE, preset_names
from ..planning.rates import GPU_DEFAULTS, MachineRates, default_rates_path
from ..planning.timing import SCHEDULES
from ..streams.disk import file_above
from .finetune_args import user_path
from .plan_alternatives import Alternative, alternatives
from .plan_machine import GIB, check_disk_rates, machine_limits, machine_rates
from .plan_models import (DEFAULT_LOSS_CHUNK_TOKENS, DEFAULT_SEQ_LEN, DTYPES, PlanInputError, Workload, hf_config,
                          workload)
from .quantize import QUANT_TYPES
from .quiet_imports import import_transformers

PROG = "offload plan"


class OneLineParser(argparse.ArgumentParser):
    """Argument errors as one line, ``offload plan: error: ...``, without the usage block."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0])
    model = parser.add_argument_group("the model (one of)")
    model.add_argument("--hf-config", metavar="PATH|JSON", help="a Hugging Face config.json, its directory, or the JSON")
    model.add_argument("--preset", choices=preset_names(), help="a benchmark preset")
    model.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="the preset's settings")
    model.add_argument("--model", metavar="MODULE:FACTORY", help="a function returning an nn.Sequential")
    model.add_argument("--input-shape", type=_size, nargs="+", help="one sample's shape, for --model")
    model.add_argument("--vocab", type=_size, help="--model takes token ids below this")
    # No default here: a --lora-r given without --hf-config, 0 included, is refused (check_model_args).
    model.add_argument("--lora-r", type=_size, help="LoRA adapters of this rank (peft), on a frozen base (default: none)")
    add_four_bit_arguments(model)
    model.add_argument("--loss-chunk-tokens", type=_size, help="--hf-config's, as offload-finetune's: the head "
                       "computes the loss this many tokens at a time (0: logits; default 1024)")
    work = parser.add_argument_group("the step")
    work.add_argument("--batch-size", type=_size, default=8, help="rows per step")
    work.add_argument("--seq-len", type=_size, help=f"tokens per row (--hf-config; default {DEFAULT_SEQ_LEN}, GPT-2's fewer)")
    work.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd-momentum", "sgd"])
    work.add_argument("--max-grad-norm", type=float, metavar="NORM",
                      help="the training clips the gradients' total norm (as offload-finetune's flag): the update "
                           "cannot then start in backward, so the in-backward schedule is not chosen")
    machine = parser.add_argument_group("the machine")
    machine.add_argument("--gpu", choices=sorted(GPU_DEFAULTS), help="device and link rates of a common GPU")
    machine.add_argument("--rates", type=user_path, help=f"rates from `offload calibrate` (default: {default_rates_path()})")
    machine.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="the compute device")
    machine.add_argument("--device-memory", type=float, metavar="GiB", help="device memory (default: from the rates)")
    machine.add_argument("--host-memory", type=float, metavar="GiB", help="host RAM to use (default: available now)")
    machine.add_argument("--pinned-memory", type=float, metavar="GiB",
                         help="the most host memory the platform lets the GPU driver pin, where it is below the RAM "
                              "(WSL2, some containers); ulimit -l does not limit it (default: no limit of its own)")
    machine.add_argument("--disk-dir", type=os.path.expanduser, metavar="DIR", help="where a disk tier may live (default: no disk tier)")
    machine.add_argument("--disk", type=float, metavar="GiB", help="disk space there (default: free space now)")
    fixed = parser.add_argument_group("keep fixed (default: the planner chooses)")
    fixed.add_argument("--num-slices", type=_size)
    fixed.add_argument("--microbatches", type=_size)
    fixed.add_argument("--compute-dtype", choices=["auto", *DTYPES], default="auto")
    fixed.add_argument("--schedule", choices=["auto", *SCHEDULES], default="auto",
                       help="when the host update runs. overlapped: behind the next forward (OffloadOptimizer's "
                            "default); in-backward: started in backward (update_in_backward=True; no clipping); "
                            "serial: after the step; auto: the faster of the first two")
    fixed.add_argument("--resident-slices", type=_resident_slices, default="auto", metavar="N|auto",
                       help="how many of the first slices stay on the device with their gradients and optimizer "
                            "state (OffloadModel(..., resident_slices=N)): no link traffic or host update for "
                            "them, an update on the device instead; auto: the most that fit the device memory "
                            "left after the slots, gradient buffers and activations, with the margin (on a CPU "
                            "device, none where they are predicted to save less than 0.1%% of the step)")
    parser.add_argument("--top", type=_size, default=8, help="rows of the table (the fastest that fit)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = parser.parse_args(argv)
    check_model_args(parser, args)
    check_step_args(parser, args)
    check_machine_args(parser, args)
    return args


def add_four_bit_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--quantize", choices=QUANT_TYPES,
                       help="the base's linear layers but the head in 4 bits (bitsandbytes, QLoRA), under --lora-r's "
                            "adapters: their codes and quantisation state are counted; the rest of the base in "
                            "--compute-dtype's dtype (auto: bf16, or float32 with --device cpu), with no "
                            "OffloadModel compute_dtype (a shadow would copy the codes)")
    group.add_argument("--bnb-4bit-use-double-quant", action=argparse.BooleanOptionalAction, default=True,
                       help="with --quantize: the blocks' scales quantised again (QLoRA's double quantisation)")


def check_model_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The model's flags: one source, and the flags that go with it."""
    sources = [name for name in ("hf_config", "preset", "model") if getattr(args, name)]
    if len(sources) != 1:
        parser.error("give the model as one of --hf-config, --preset or --model")
    if args.model and not args.input_shape:
        parser.error("--model needs --input-shape (one sample's shape, e.g. 1024 or 3 224 224)")
    if not args.model and (args.input_shape or args.vocab is not None):
        parser.error("--input-shape and --vocab describe --model's input; presets and --hf-config make their own")
    if args.input_shape and min(args.input_shape) < 1:
        parser.error(f"--input-shape must be sizes of at least 1, got {' '.join(map(str, args.input_shape))}")
    if args.vocab is not None and args.vocab < 1:
        parser.error("--vocab must be at least 1")
    if args.set and not args.preset:
        parser.error("--set sets a --preset's settings; give --preset NAME")
    if args.lora_r is not None and not args.hf_config:
        parser.error("--lora-r adapts a Hugging Face model: give it with --hf-config")
    if args.lora_r is None:
        args.lora_r = 0
    if args.lora_r < 0:
        parser.error("--lora-r must be 0 (off) or a positive rank")
    if args.seq_len is not None and not args.hf_config:
        # Left unchecked it would be ignored: the plan would be for another sequence than typed.
        parser.error("--seq-len is --hf-config's tokens per row: --model's input is --input-shape, a preset's "
                     "--set seq_len=N (where it has that setting)")
    if args.quantize and not args.lora_r:
        parser.error(f"--quantize {args.quantize} freezes the base in 4 bits, which has no gradient: train LoRA "
                     "adapters over it with --lora-r R (and --hf-config)")
    if args.loss_chunk_tokens is not None and not args.hf_config:
        # As --seq-len: left unchecked it would be ignored, the plan not the one typed.
        parser.error("--loss-chunk-tokens chunks --hf-config's loss; the head of a preset or --model is not chunked")
    if args.hf_config and args.loss_chunk_tokens is None:
        args.loss_chunk_tokens = DEFAULT_LOSS_CHUNK_TOKENS
    if args.loss_chunk_tokens is not None and args.loss_chunk_tokens < 0:
        parser.error("--loss-chunk-tokens must be 0 (logits) or a number of tokens")
    spec = args.hf_config
    if not spec or spec.lstrip().startswith("{"):
        return  # JSON text (a long one is no path: asking the file system would fail)
    if not Path(spec).exists():
        parser.error(f"--hf-config {spec}: no such file or directory, and not JSON: give a config.json, the folder "
                     "holding it, or its JSON text (a Hub id is not fetched: download the model's config.json)")
    if Path(spec).is_dir() and not (Path(spec) / "config.json").is_file():
        parser.error(f"--hf-config {spec}: the directory holds no config.json")


def check_step_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The step's flags and the choices kept fixed."""
    # Left out: the default, lowered to a learned position table's size (plan_models._check_positions).
    args.seq_len_default = args.seq_len is None
    if args.seq_len is None:
        args.seq_len = DEFAULT_SEQ_LEN
    for name in ("batch_size", "seq_len", "top"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.hf_config and args.seq_len < 2:  # as offload-finetune refuses it: the printed command must run
        parser.error("--seq-len must be at least 2: a row's loss scores each token against the next")
    for name in ("num_slices", "microbatches"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1 (leave it out to let the planner choose)")
    if args.microbatches and args.batch_size % args.microbatches:
        parser.error(f"--microbatches {args.microbatches} does not divide --batch-size {args.batch_size}")
    if args.max_grad_norm is not None and not 0 < args.max_grad_norm < math.inf:
        # As offload-finetune refuses it: the printed command must run.
        parser.error(f"--max-grad-norm must be a finite number above 0, got {args.max_grad_norm:g} (leave it out "
                     "for no clipping)")
    if args.resident_slices != "auto" and args.num_slices is not None and args.resident_slices > args.num_slices:
        parser.error(f"--resident-slices {args.resident_slices} is more than --num-slices {args.num_slices}")
    if args.schedule == "in-backward" and args.max_grad_norm is not None:
        parser.error("--schedule in-backward cannot clip: each slice's update starts in backward, before the "
                     "gradients' total norm is known. Leave out --max-grad-norm, or use another --schedule")


def check_machine_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The machine's flags: sizes above 0, and paths that are what they name."""
    for name in ("device_memory", "host_memory", "disk", "pinned_memory"):
        value = getattr(args, name)
        # Below 2**33 GiB: its bytes fit in 64 bits (a larger figure overflowed later, with a traceback).
        if value is not None and not 0 < value < 2 ** 33:
            parser.error(f"--{name.replace('_', '-')} must be a positive number of GiB, got {value:g} (below "
                         f"{2 ** 33} GiB; leave it out for the default)")
    if args.device_memory is not None and args.device == "cpu":  # else a limit shown, and never checked
        parser.error("--device-memory with --device cpu: a CPU device's memory is the host's: use --host-memory")
    if args.disk is not None and args.disk_dir is None:
        parser.error("--disk is the space under --disk-dir: give --disk-dir DIR too")
    if args.disk_dir is not None:
        check_disk_dir(parser, Path(args.disk_dir))
    if args.rates is not None and not args.rates.is_file():
        what = "a directory, not a rates file" if args.rates.is_dir() else "no such file"
        instead = "leave out --rates: --gpu alone needs no calibration" if args.gpu else "pass --gpu NAME"
        parser.error(f"--rates {args.rates}: {what}; run `python -m offload calibrate --out {args.rates}` "
                     f"or {instead}")


def check_disk_dir(parser: argparse.ArgumentParser, path: Path, flag: str = "--disk-dir") -> None:
    """Refuse a ``--disk-dir`` that :class:`~offload.DiskTier` would refuse (``make_directory`` in
    ``offload/streams/disk.py``), without making it: the printed code must run. ``flag``: the option
    that named it, for the message (``offload calibrate --dir`` measures where a tier would live)."""
    if path.exists() and not path.is_dir():
        parser.error(f"{flag} {path}: not a directory")
    if path.exists():
        if not os.access(path, os.W_OK | os.X_OK):
            parser.error(f"{flag} {path}: not writable by this process; choose a directory you can write to")
        return
    parent = path.absolute().parent
    above = file_above(path)
    if above is not None:
        parser.error(f"{flag} {path}: {above} is a file, not a directory; choose another path")
    if not parent.is_dir():
        parser.error(f"{flag} {path}: its parent directory {parent} does not exist; create it first (a disk "
                     "tier creates only the last level, so that a mistyped path does not put the files on another "
                     "disk)")
    if not os.access(parent, os.W_OK | os.X_OK):
        parser.error(f"{flag} {path}: cannot be created, {parent} is not writable by this process; choose a "
                     "directory you can write to")


def _size(text: str) -> int:
    """An integer flag, at most :data:`MAX_SIZE`: torch takes no larger size (it fails in C++)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value > MAX_SIZE:
        raise argparse.ArgumentTypeError(f"{value} is more than 2**63-1, the largest size torch takes")
    return value


def _resident_slices(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a count of slices or 'auto', got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a count of slices >= 0 or 'auto', got {value}")
    return value


class Planner:
    """Plans for the arguments on one machine, keeping each model built for a batch: a re-plan
    with other limits or fixed choices (:mod:`offload.cli.plan_alternatives`) reuses its profiles."""

    def __init__(self, rates: MachineRates) -> None:
        self.rates = rates
        self._workloads: dict[tuple[Any, ...], Workload] = {}

    def workload(self, args: argparse.Namespace) -> Workload:
        # A 4-bit base is built in --compute-dtype's dtype (plan_models.four_bit_dtype).
        base = (args.quantize, args.bnb_4bit_use_double_quant, args.compute_dtype) if args.quantize else None
        key = (args.batch_size, args.seq_len, args.lora_r, base)
        if key not in self._workloads:
            work = workload(args)
            # Under its key as it is now too: a default --seq-len lowered to the model's positions.
            self._workloads[key] = self._workloads[(args.batch_size, args.seq_len, args.lora_r, base)] = work
        return self._workloads[key]

    def plan(self, args: argparse.Namespace, limits: Limits) -> Plan:
        work = self.workload(args)
        stages = len(work.layers)
        for flag, count in (("--num-slices", args.num_slices), ("--resident-slices", args.resident_slices)):
            if isinstance(count, int) and count > stages:
                raise PlanInputError(f"{flag} {count} is more than the model's {stages} stages (a slice holds at "
                                     f"least one)")
        fixed: dict[str, Any] = {} if args.schedule == "auto" else {"schedule": args.schedule}
        if args.num_slices:
            fixed["num_slices"] = args.num_slices
        if args.microbatches:
            fixed["num_microbatches"] = args.microbatches
        if args.compute_dtype != "auto":
            fixed["compute_dtype"] = DTYPES[args.compute_dtype]
        param_dtype = torch.float32
        if work.four_bit is not None:
            # The base computes in its own dtype: a compute_dtype would give every slice with an
            # adapter a shadow, the 4-bit codes copied in it (docs/lora.md, QLoRA's bytes).
            fixed["compute_dtype"], param_dtype = None, work.four_bit.dtype
        elif (refusal := refused_compute_dtype(work, args)) is not None:
            # The printed OffloadModel(...) must build: a dtype the model refuses is no plan.
            if args.compute_dtype != "auto":
                raise PlanInputError(f"--compute-dtype {args.compute_dtype}: OffloadModel refuses the model under it: "
                                     f"{refusal}; or plan with --compute-dtype none")
            fixed["compute_dtype"] = None  # the other dtype choose() tries: the model's own, never refused
        if args.resident_slices != "auto":
            fixed["resident_slices"] = args.resident_slices
        return choose(work.layers, work.profile, self.rates, limits, device=args.device, optimizer=args.optimizer,
                      param_dtype=param_dtype, batch_size=work.batch_size, fixed=fixed,
                      clips_gradients=args.max_grad_norm is not None)


def refused_compute_dtype(work: Workload, args: argparse.Namespace) -> str | None:
    """Why :class:`~offload.OffloadModel` would refuse the model under the compute dtype the plan
    takes (``--compute-dtype``'s, or bfloat16, the one ``choose()`` tries beside none): a batch or
    instance norm in neither float32 nor that dtype, a parameter narrower than it (its words:
    :func:`~offload.planning.estimate_settings.check_dtypes`); ``None`` where it builds. A 4-bit
    base plans without one."""
    if work.four_bit is not None or args.compute_dtype == "none":
        return None
    dtype = torch.bfloat16 if args.compute_dtype == "auto" else DTYPES[args.compute_dtype]
    try:
        # Whether it refuses does not depend on the cut; one slice names the whole model's.
        check_dtypes(work.layers, dtype, args.num_slices or 1)
    except ValueError as error:
        return str(error)
    return None


def run_plan(args: argparse.Namespace) -> tuple[Plan, Workload, MachineRates, Limits]:
    plan, planner, limits = _planned(args)
    return plan, planner.workload(args), planner.rates, limits


def check_hf_config(args: argparse.Namespace) -> None:
    """Read ``--hf-config`` before the rates: a text that is not a config (not JSON, no
    ``model_type``, a family offload does not cut) is the mistake to answer first. After the rates,
    it showed only once a calibration existed, and the user was told to calibrate instead. Reading
    it builds nothing; the workload reads it again, as cheaply.

    Raises:
        PlanInputError: what is wrong with the config, as the workload would say it.
    """
    if not args.hf_config:
        return
    try:
        import_transformers()  # quietly, as the workload imports it
    except ImportError:
        return  # the workload says what to install, and it needs the rates to be of use
    hf_config(args.hf_config)


def _planned(args: argparse.Namespace) -> tuple[Plan, Planner, Limits]:
    check_hf_config(args)
    # Then the rates: a missing calibration is answered before the model is built.
    planner = Planner(machine_rates(args))
    check_disk_rates(args, planner.rates)
    planner.workload(args)
    limits = machine_limits(args, planner.rates)
    return planner.plan(args, limits), planner, limits


def code(candidate: Candidate, work: Workload, args: argparse.Namespace) -> str:
    """The ``OffloadModel(...)``/``OffloadOptimizer(...)`` calls that build the candidate."""
    config = candidate.config
    model_args = [f'device="{args.device}"', f"num_slices={config.num_slices}"]
    if config.num_microbatches > 1:
        model_args.append(f"num_microbatches={config.num_microbatches}")
    if config.compute_dtype is not None:
        model_args.append(f"compute_dtype=torch.{str(config.compute_dtype).removeprefix('torch.')}")
    tier = f"DiskTier({args.disk_dir!r})"  # repr: a path with a quote or a backslash stays one string
    if config.masters == "disk":
        model_args.append(f"masters={tier}")
    if config.shadows == "disk":
        model_args.append('shadows="disk"')
    if config.resident_slices:
        model_args.append(f"resident_slices={config.resident_slices}")
    optimizer = {"adamw": "torch.optim.AdamW, lr=1e-4, fused=True",
                 "sgd-momentum": "torch.optim.SGD, lr=1e-2, momentum=0.9, fused=True",
                 "sgd": "torch.optim.SGD, lr=1e-2, fused=True"}[args.optimizer]
    if config.optimizer_state == "disk":
        optimizer += f", disk_tier={tier}"
    if config.schedule == "in-backward":
        # accumulation_steps is 1: num_microbatches splits the batch within one backward.
        optimizer += ",\n                             update_in_backward=True"
    elif config.norms_in_backward:
        optimizer += ",\n                             norms_in_backward=True"
        if config.scale_in_update:
            optimizer += ", scale_in_update=True"
    setup = "" if work.four_bit is None else work.four_bit.code()
    # The planned clip is offload's (the norms on several threads), not torch.nn.utils' (on one).
    clip = (f"\n# before each optimizer.step(): offload.clip_grad_norm_(model.parameters(), {args.max_grad_norm:g})"
            f"\n# (a transformers or TRL trainer: parallel_clipping(trainer), from offload.integrations.transformers)"
            if config.clips_gradients else "")
    return (f"{setup}model = OffloadModel({work.build}, {', '.join(model_args)})\n"
            f"optimizer = OffloadOptimizer(model, {optimizer}){clip}")


def finetune_flags(candidate: Candidate, work: Workload, args: argparse.Namespace) -> str | None:
    if work.finetune is None or args.optimizer != "adamw":
        return None
    config = candidate.config
    # A 4-bit base's dtype is the fine-tune's --compute-dtype (it loads the base in it).
    computes = config.compute_dtype if work.four_bit is None else work.four_bit.dtype
    dtype = {None: "none", torch.float32: "none", torch.bfloat16: "bf16", torch.float16: "fp16"}[computes]
    flags = [*work.finetune, "--num-slices", str(config.num_slices), "--microbatches", str(config.num_microbatches),
             "--compute-dtype", dtype]
    if config.optimizer_state == "disk":
        flags += ["--disk-tier", shlex.quote(str(args.disk_dir))]  # a shell command: a space stays in the path
    if config.masters == "disk":
        flags.append("--masters-on-disk")
    if config.shadows == "disk":
        flags.append("--shadows-on-disk")
    if config.schedule == "in-backward":
        flags.append("--update-in-backward")
    if config.resident_slices:
        flags += ["--resident-slices", str(config.resident_slices)]
    if args.max_grad_norm is not None:
        flags += ["--max-grad-norm", f"{args.max_grad_norm:g}"]
    # offload-finetune's default is cuda where present: the CPU plan's run must say so.
    return "offload-finetune " + " ".join(flags + (["--device", "cpu"] if args.device == "cpu" else []))


def _row(c: Candidate) -> dict[str, Any]:
    config = c.config
    return {
        "num_slices": config.num_slices, "num_microbatches": config.num_microbatches,
        "compute_dtype": None if config.compute_dtype is None else str(config.compute_dtype).removeprefix("torch."),
        "optimizer_state": config.optimizer_state, "masters": config.masters, "shadows": config.shadows,
        "schedule": config.schedule,
        "resident_slices": config.resident_slices,
        "device_bytes": c.memory.device_total, "host_bytes": c.memory.host_total, "pinned_bytes": c.memory.pinned_bytes,
        "disk_bytes": c.memory.disk, "step_s": c.time.step, "efficiency": c.time.efficiency, "fits": c.fits,
        "over": c.over,
    }


def table(candidates: list[Candidate], own: str = "float32") -> str:
    """The candidates' rows; ``own``: the dtype shown where there is no compute dtype (the model's own)."""
    header = (f"{'slices':>6} {'res':>3} {'mb':>3} {'dtype':>8} {'state':>5} {'masters':>7} {'shadows':>7} "
              f"{'schedule':>11} "
              f"{'device':>9} {'host':>9} {'disk':>9} {'step':>9} {'eff':>5}")
    lines = [header]
    for c in candidates:
        r = _row(c)
        lines.append(f"{r['num_slices']:>6} {r['resident_slices']:>3} {r['num_microbatches']:>3} "
                     f"{r['compute_dtype'] or own:>8} {r['optimizer_state']:>5} {r['masters']:>7} {r['shadows']:>7} "
                     f"{r['schedule']:>11} {_gib(r['device_bytes']):>9} "
                     f"{_gib(r['host_bytes']):>9} {_gib(r['disk_bytes']):>9} {_seconds(r['step_s']):>9} "
                     f"{r['efficiency']:>5.2f}")
    return "\n".join(lines)


def report(plan: Plan, work: Workload, rates: MachineRates, limits: Limits, args: argparse.Namespace,
           alternatives: Sequence[Alternative] = ()) -> str:
    limit = ", ".join(f"{name} {_gib(value) if value is not None else 'no limit'}" for name, value in
                      (("device", limits.device_memory), ("host", limits.host_memory), ("disk", limits.disk))
                      + ((("pinned", limits.pinned_memory),) if limits.pinned_memory is not None else ()))
    lines = [f"model: {work.parameters / 1e9:.3f} B parameters, {len(work.layers)} layers, batch {work.batch_size}"]
    own = "float32"
    if work.four_bit is not None:
        lines.append(work.four_bit.describe(sum(p.numel() for p in work.layers.parameters() if p.requires_grad)))
        own = str(work.four_bit.dtype).removeprefix("torch.")
    if (refusal := refused_compute_dtype(work, args)) is not None:  # auto: a fixed one refused is an error
        lines.append(f"compute dtype: none, the model's own: OffloadModel refuses it under bfloat16 ({refusal})")
    lines += [f"rates: {rates.name}", f"limits: {limit}", ""]
    fitting = sorted((c for c in plan.candidates if c.fits), key=lambda c: c.time.step)[:args.top]
    if plan.chosen is None:
        lines += ["nothing fits: " + plan.missing,
                  f"(the figures include the planner's margin: {1 - HOST_MARGIN:.0%} of the host's and "
                  f"{1 - DEVICE_MARGIN:.0%} of the device's memory stay free)"]
        if alternatives:
            width = max(len(a.flags) for a in alternatives)
            lines += ["", "what would change the answer (planned again with that one change):",
                      *(f"  {a.flags:<{width}}  {a.describe()}" for a in alternatives)]
        return "\n".join(lines)
    lines += [f"the fastest that fit ({sum(c.fits for c in plan.candidates)} of {len(plan.candidates)}):",
              table(fitting, own), "", "chosen:", table([plan.chosen], own), ""]
    t = plan.chosen.time
    lines.append(f"step {_seconds(t.step)}: forward {_seconds(t.forward)}, backward {_seconds(t.backward)}, "
                 f"update {_seconds(t.update)} of which exposed {_seconds(t.exposed_update)}; device compute "
                 f"{_seconds(t.forward_compute + t.backward_compute)}, link {_seconds(t.load)} in + "
                 f"{_seconds(t.offload)} out, disk {_seconds(t.disk_read)} read + {_seconds(t.disk_write)} "
                 f"write"
                 + (f" (and the loads' reads of the masters {_seconds(t.staging)})" if t.staging else "")
                 + f"; resident slices' update on the device {_seconds(t.device_update)}"
                 + (f"; clipping the gradients on the host {_seconds(t.clip)}" if t.clip else "")
                 + f"; efficiency {t.efficiency:.2f}")
    if plan.chosen.memory.pinned_bytes:
        lines.append(f"pinned host memory: {_gib(plan.chosen.memory.pinned_bytes)} of the host's "
                     f"{_gib(plan.chosen.host_need)} (WSL2 and some containers pin less than their RAM: "
                     f"--pinned-memory)")
    if plan.chosen.config.schedule == "in-backward":
        lines.append("update_in_backward: nothing may change the gradients between backward and step() (no "
                     "clip_grad_norm_, no GradScaler); if the training clips them, plan with --max-grad-norm")
    lines += ["", code(plan.chosen, work, args)]
    flags = finetune_flags(plan.chosen, work, args)
    if flags:
        lines += ["", flags + "  # and --model DIR (the weights), --out DIR, --data PATH"]
    return "\n".join(lines)


def as_json(plan: Plan, work: Workload, rates: MachineRates, limits: Limits, args: argparse.Namespace,
            alternatives: Sequence[Alternative] = ()) -> dict[str, Any]:
    chosen = plan.chosen
    refusal = refused_compute_dtype(work, args)  # auto: a fixed one refused is an error
    return {
        "parameters": work.parameters,
        "four_bit": None if work.four_bit is None else work.four_bit.to_json(),
        "rates": rates.to_json(),
        "limits": {"device_memory": limits.device_memory, "host_memory": limits.host_memory, "disk": limits.disk,
                   "disk_dir": limits.disk_dir, "pinned_memory": limits.pinned_memory},
        "chosen": None if chosen is None else _row(chosen) | {
            "time": chosen.time.to_json(), "memory": chosen.memory.host_categories() | {
                f"device_{k}": v for k, v in chosen.memory.device_categories().items()},
            "code": code(chosen, work, args), "finetune": finetune_flags(chosen, work, args)},
        "missing": plan.missing,
        "alternatives": [a.to_json() for a in alternatives],
        "clips_gradients": args.max_grad_norm is not None,
        # Why no bfloat16 candidate was tried (OffloadModel refuses the model under it), or null.
        "refused_compute_dtype": None if refusal is None else {"compute_dtype": "bfloat16", "reason": refusal},
        "candidates": [_row(c) for c in plan.candidates],
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        plan, planner, limits = _planned(args)
        found = [] if plan.chosen is not None else alternatives(args, plan, limits, planner)
    except PlanInputError as error:
        sys.stderr.write(f"{PROG}: error: {error}\n")
        raise SystemExit(2) from None
    work, rates = planner.workload(args), planner.rates
    if args.json:
        json.dump(as_json(plan, work, rates, limits, args, found), sys.stdout, indent=2)
        print()
    else:
        print(report(plan, work, rates, limits, args, found))
    if plan.chosen is None:
        raise SystemExit(1)


def _gib(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / GIB:.2f} GiB"


def _seconds(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


if __name__ == "__main__":
    main()
