"""``offload plan``: will this model fit on this machine, how fast will a step be, and with what
configuration.

The model is one of the benchmark presets (``--preset``), an ``nn.Sequential`` from a factory
(``--model package.module:factory --input-shape ...``) or a Hugging Face causal LM's config
(``--hf-config``: a ``config.json``, a directory holding one, or the JSON itself), which is built
on the meta device: no weights are read or allocated. Its shapes are profiled on fake tensors for
the batch (``offload/planning/shapes.py``); the machine's rates come from ``offload calibrate``'s
file or a GPU's defaults (``--gpu``); its memory from flags, or detected (host RAM available,
free disk under ``--disk-dir``, the device's memory from the rates). ``offload/planning/choose.py``
picks the configuration; this file reads arguments and prints.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..planning.choose import DEVICE_MARGIN, HOST_MARGIN, Candidate, Limits, Plan, choose
from ..planning.presets import build_preset, preset_from_factory, preset_names
from ..planning.rates import GPU_DEFAULTS, MachineRates, default_rates_path, load_rates
from ..planning.shapes import ModelProfile, profile_layers
from ..planning.timing import SCHEDULES
from .plan_alternatives import Alternative, alternatives
from .quiet_imports import import_transformers

DTYPES = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}
GIB = 2**30
PROG = "offload plan"


class PlanInputError(ValueError):
    """A bad input found after parsing (a config, a factory, a rates file, the model's size):
    :func:`main` answers it as the parser answers a bad flag, in one line."""


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
    model.add_argument("--input-shape", type=int, nargs="+", help="one sample's shape, for --model")
    model.add_argument("--vocab", type=int, help="--model takes token ids below this")
    model.add_argument("--lora-r", type=int, default=0, help="LoRA adapters of this rank (peft), on a frozen base")
    model.add_argument("--loss-chunk-tokens", type=int, default=1024,
                       help="as offload-finetune: the head computes the loss this many tokens at a time (0: logits)")
    work = parser.add_argument_group("the step")
    work.add_argument("--batch-size", type=int, default=8, help="rows per step")
    work.add_argument("--seq-len", type=int, default=2048, help="tokens per row (--hf-config)")
    work.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd-momentum", "sgd"])
    work.add_argument("--max-grad-norm", type=float, metavar="NORM",
                      help="the training clips the gradients' total norm (as offload-finetune's flag): the update "
                           "cannot then start in backward, so the in-backward schedule is not chosen")
    machine = parser.add_argument_group("the machine")
    machine.add_argument("--gpu", choices=sorted(GPU_DEFAULTS), help="device and link rates of a common GPU")
    machine.add_argument("--rates", type=Path, help=f"rates from `offload calibrate` (default: {default_rates_path()})")
    machine.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="the compute device")
    machine.add_argument("--device-memory", type=float, metavar="GiB", help="device memory (default: from the rates)")
    machine.add_argument("--host-memory", type=float, metavar="GiB", help="host RAM to use (default: available now)")
    machine.add_argument("--disk-dir", metavar="DIR", help="where a disk tier may live (default: no disk tier)")
    machine.add_argument("--disk", type=float, metavar="GiB", help="disk space there (default: free space now)")
    fixed = parser.add_argument_group("keep fixed (default: the planner chooses)")
    fixed.add_argument("--num-slices", type=int)
    fixed.add_argument("--microbatches", type=int)
    fixed.add_argument("--compute-dtype", choices=["auto", *DTYPES], default="auto")
    fixed.add_argument("--schedule", choices=["auto", *SCHEDULES], default="auto",
                       help="when the host update runs. overlapped: behind the next forward (OffloadOptimizer's "
                            "default); in-backward: started in backward (update_in_backward=True; no clipping); "
                            "serial: after the step; auto: the faster of the first two")
    fixed.add_argument("--resident-slices", type=_resident_slices, default="auto", metavar="N|auto",
                       help="how many of the first slices stay on the device with their gradients and optimizer "
                            "state (OffloadModel(..., resident_slices=N)): no link traffic or host update for "
                            "them, an update on the device instead; auto: the most that fit the device memory "
                            "left after the slots, gradient buffers and activations, with the margin, or none "
                            "where that is predicted no slower (a CPU device)")
    parser.add_argument("--top", type=int, default=8, help="rows of the table (the fastest that fit)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = parser.parse_args(argv)
    check_model_args(parser, args)
    check_step_args(parser, args)
    check_machine_args(parser, args)
    return args


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
    if args.lora_r and not args.hf_config:
        parser.error("--lora-r adapts a Hugging Face model: give it with --hf-config")
    if args.lora_r < 0:
        parser.error("--lora-r must be 0 (off) or a positive rank")
    if args.loss_chunk_tokens < 0:
        parser.error("--loss-chunk-tokens must be 0 (logits) or a number of tokens")
    spec = args.hf_config
    if spec and not spec.lstrip().startswith("{") and not Path(spec).exists():
        parser.error(f"--hf-config {spec}: no such file or directory, and not JSON")
    if spec and Path(spec).is_dir() and not (Path(spec) / "config.json").is_file():
        parser.error(f"--hf-config {spec}: the directory holds no config.json")


def check_step_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The step's flags and the choices kept fixed."""
    for name in ("batch_size", "seq_len", "top"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("num_slices", "microbatches"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1 (leave it out to let the planner choose)")
    if args.microbatches and args.batch_size % args.microbatches:
        parser.error(f"--microbatches {args.microbatches} does not divide --batch-size {args.batch_size}")
    if args.max_grad_norm is not None and not args.max_grad_norm > 0:
        parser.error("--max-grad-norm must be positive (leave it out for no clipping)")
    if args.resident_slices != "auto" and args.num_slices is not None and args.resident_slices > args.num_slices:
        parser.error(f"--resident-slices {args.resident_slices} is more than --num-slices {args.num_slices}")
    if args.schedule == "in-backward" and args.max_grad_norm is not None:
        parser.error("--schedule in-backward cannot clip: each slice's update starts in backward, before the "
                     "gradients' total norm is known. Leave out --max-grad-norm, or use another --schedule")


def check_machine_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The machine's flags: sizes above 0, and paths that are what they name."""
    for name in ("device_memory", "host_memory", "disk"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            parser.error(f"--{name.replace('_', '-')} must be a positive number of GiB, got {value:g}")
    if args.disk is not None and args.disk_dir is None:
        parser.error("--disk is the space under --disk-dir: give --disk-dir DIR too")
    if args.disk_dir is not None and Path(args.disk_dir).exists() and not Path(args.disk_dir).is_dir():
        parser.error(f"--disk-dir {args.disk_dir}: not a directory")
    if args.rates is not None and not args.rates.is_file():
        what = "a directory, not a rates file" if args.rates.is_dir() else "no such file"
        parser.error(f"--rates {args.rates}: {what}; run `python -m offload calibrate --out {args.rates}` "
                     f"or pass --gpu NAME")


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


class Workload:
    """The model as the planner sees it: its layers, a profile per compute dtype, the batch, and
    how to build it (for the printed code)."""

    def __init__(self, layers: nn.Sequential, make_input: Callable[[], Any], batch_size: int, build: str,
                 finetune: list[str] | None = None, input_flags: str | None = None) -> None:
        self.layers = layers
        self.make_input = make_input
        self.batch_size = batch_size
        self.build = build
        self.finetune = finetune
        #: The flags that describe a user's input (``--input-shape ...``): a forward that fails on
        #: it is their input's error, not the planner's.
        self.input_flags = input_flags
        self._profiles: dict[Any, ModelProfile] = {}

    def profile(self, compute_dtype: torch.dtype | None) -> ModelProfile:
        if compute_dtype not in self._profiles:
            try:
                profile = profile_layers(self.layers, self.make_input, compute_dtype=compute_dtype)
            except RuntimeError as error:
                if self.input_flags is None:
                    raise
                raise PlanInputError(f"{self.input_flags}: {_one_line(error)}") from error
            self._profiles[compute_dtype] = profile
        return self._profiles[compute_dtype]


def workload(args: argparse.Namespace) -> Workload:
    if args.hf_config:
        return hf_workload(args)
    input_flags = None
    if args.model:
        input_flags = " ".join(["--input-shape", *map(str, args.input_shape)]
                               + ([] if args.vocab is None else ["--vocab", str(args.vocab)]))
        input_flags += f" for --model {args.model}"
        # A console script's sys.path starts with the script's own directory, not the one the
        # user is in (`python -m offload` starts with that one): put it first for the factory's
        # module, as uvicorn and gunicorn do for their APP argument.
        if "" not in sys.path and os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
    # Built on the meta device: the planner needs shapes and dtypes, not weights.
    with torch.device("meta"):
        try:
            if args.preset:
                overrides = dict(_setting(item) for item in args.set)
                preset = build_preset(args.preset, **overrides)
                build = f"build_preset({args.preset!r}{''.join(f', {k}={v!r}' for k, v in overrides.items())}).model"
            else:
                preset = preset_from_factory(args.model, args.input_shape, args.vocab, batch_size=args.batch_size)
                build = f"{args.model.replace(':', '.')}()"
        except (TypeError, ValueError) as error:
            # The preset's checks and the factory's import, name and return value.
            raise PlanInputError(_one_line(error)) from error
    rows = args.batch_size

    def make_input() -> Any:
        return preset.make_batch(rows, "cpu")[0]

    return Workload(preset.model, make_input, rows, build, input_flags=input_flags)


def _setting(item: str) -> tuple[str, Any]:
    key, sep, value = item.partition("=")
    if not sep:
        raise PlanInputError(f"--set takes KEY=VALUE, got {item!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def hf_config(spec: str) -> Any:
    """A transformers config from a ``config.json``, its directory, or the JSON text."""
    import transformers

    path = Path(spec)
    try:
        if path.is_dir() and not spec.lstrip().startswith("{"):
            return transformers.AutoConfig.from_pretrained(path, local_files_only=True)
        text = spec if spec.lstrip().startswith("{") else path.read_text()
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise PlanInputError(f"--hf-config {spec}: not valid JSON: {error}") from error
    except (OSError, ValueError) as error:  # unreadable, or a config transformers refuses
        raise PlanInputError(f"--hf-config {spec}: {_one_line(error)}") from error
    if not isinstance(data, dict) or data.get("model_type") is None:
        raise PlanInputError(f"--hf-config {spec}: the config has no model_type (a config.json names its family, "
                             f'e.g. "model_type": "llama")')
    model_type = data.pop("model_type")
    _check_family(spec, model_type)  # before transformers lists every family it knows
    try:
        return transformers.AutoConfig.for_model(model_type, **data)
    except Exception as error:  # noqa: BLE001 (a config's checks raise huggingface_hub's own classes too)
        raise PlanInputError(f"--hf-config {spec}: {_one_line(error)}") from error


def _check_family(spec: str, model_type: str) -> None:
    from ..integrations.transformers import SUPPORTED_MODEL_TYPES

    if model_type not in SUPPORTED_MODEL_TYPES:
        raise PlanInputError(f"--hf-config {spec}: model_type {model_type!r} is not a causal LM that offload cuts "
                             f"into stages; it plans {', '.join(SUPPORTED_MODEL_TYPES)}")


def hf_workload(args: argparse.Namespace) -> Workload:
    """The config's causal LM built on the meta device, cut into stages as OffloadModel gets it."""
    try:
        transformers = import_transformers()  # without torchao's import notes (offload/cli/quiet_imports.py)
    except ImportError as error:
        raise PlanInputError(f'{error}. --hf-config needs transformers: pip install "offload[transformers]"') from error
    from ..integrations.transformers import causal_lm_sequential

    config = hf_config(args.hf_config)
    _check_family(args.hf_config, config.model_type)
    chunk = args.loss_chunk_tokens or None
    try:
        with torch.device("meta"):
            # Sizes the model refuses (a negative one fails making its tensor: RuntimeError).
            hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            if args.lora_r:
                hf = _with_lora(hf, args.lora_r)
            layers = causal_lm_sequential(hf, loss_chunk_tokens=chunk)
    except (ValueError, TypeError, AttributeError, RuntimeError) as error:
        raise PlanInputError(f"--hf-config {args.hf_config}: {_one_line(error)}") from error
    rows, tokens = args.batch_size, args.seq_len

    def make_input() -> Any:
        ids = torch.zeros(rows, tokens, dtype=torch.long)
        return {"input_ids": ids, "labels": ids} if chunk else ids

    hf_model = "get_peft_model(hf_model, LoraConfig(...))" if args.lora_r else "hf_model"
    build = f"causal_lm_sequential({hf_model}{', loss_chunk_tokens=' + str(chunk) if chunk else ''})"
    flags = ["--batch-size", str(rows), "--seq-len", str(tokens), "--loss-chunk-tokens", str(args.loss_chunk_tokens)]
    if args.lora_r:
        flags += ["--lora-r", str(args.lora_r)]
    return Workload(layers, make_input, rows, build, finetune=flags)


def _with_lora(hf: nn.Module, rank: int) -> nn.Module:
    try:
        import peft
    except ImportError as error:
        raise PlanInputError(f'{error}. --lora-r needs peft: pip install "offload[peft]"') from error
    with warnings.catch_warnings():
        # peft asks the meta model a deprecated transformers question; the note is theirs, not the user's.
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return peft.get_peft_model(hf, peft.LoraConfig(r=rank, target_modules="all-linear", task_type="CAUSAL_LM"))


def machine_rates(args: argparse.Namespace) -> MachineRates:
    """The GPU's defaults with the calibrated host where there is a calibration, or the calibration."""
    path = args.rates or default_rates_path()
    try:
        calibrated = load_rates(path) if path.is_file() else None
    except (TypeError, ValueError) as error:  # not JSON, or fields of another version
        flag = "--rates" if args.rates is not None else "the rates file"
        reason = _one_line(error)
        if "calibrate" not in reason:
            reason += "; run `python -m offload calibrate` again, or pass --gpu NAME"
        raise PlanInputError(f"{flag} {path}: {reason}") from error
    if args.gpu:
        gpu = GPU_DEFAULTS[args.gpu]
        return gpu.with_host(calibrated) if calibrated is not None else gpu
    if calibrated is not None:
        return calibrated
    if args.device == "cpu":
        # The host's defaults have no compute rate: a CPU's own must be measured.
        raise PlanInputError(f"--device cpu needs this CPU's compute rates: run `python -m offload calibrate "
                             f"--device cpu` (writes {path}), or pass --rates FILE")
    raise PlanInputError(f"no rates: run `python -m offload calibrate` on the machine (writes {path}), or pass "
                         f"--gpu {{{','.join(sorted(GPU_DEFAULTS))}}}")


def machine_limits(args: argparse.Namespace, rates: MachineRates) -> Limits:
    import psutil

    device = args.device_memory * GIB if args.device_memory is not None else rates.device_memory
    host = args.host_memory * GIB if args.host_memory is not None else psutil.virtual_memory().available
    disk = None
    if args.disk_dir is not None:
        disk = args.disk * GIB if args.disk is not None else shutil.disk_usage(_existing(Path(args.disk_dir))).free
    return Limits(device_memory=None if device is None else int(device), host_memory=int(host),
                  disk=None if disk is None else int(disk), disk_dir=args.disk_dir)


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


class Planner:
    """Plans for the arguments on one machine, keeping each model built for a batch: a re-plan
    with other limits or fixed choices (:mod:`offload.cli.plan_alternatives`) reuses its profiles."""

    def __init__(self, rates: MachineRates) -> None:
        self.rates = rates
        self._workloads: dict[tuple[int, int, int], Workload] = {}

    def workload(self, args: argparse.Namespace) -> Workload:
        key = (args.batch_size, args.seq_len, args.lora_r)
        if key not in self._workloads:
            self._workloads[key] = workload(args)
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
        if args.resident_slices != "auto":
            fixed["resident_slices"] = args.resident_slices
        return choose(work.layers, work.profile, self.rates, limits, device=args.device, optimizer=args.optimizer,
                      batch_size=work.batch_size, fixed=fixed, clips_gradients=args.max_grad_norm is not None)


def run_plan(args: argparse.Namespace) -> tuple[Plan, Workload, MachineRates, Limits]:
    plan, planner, limits = _planned(args)
    return plan, planner.workload(args), planner.rates, limits


def _planned(args: argparse.Namespace) -> tuple[Plan, Planner, Limits]:
    # The rates first: a missing calibration is answered before the model is built.
    planner = Planner(machine_rates(args))
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
    tier = f'DiskTier("{args.disk_dir}")'
    if config.masters == "disk":
        model_args.append(f"masters={tier}")
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
    return (f"model = OffloadModel({work.build}, {', '.join(model_args)})\n"
            f"optimizer = OffloadOptimizer(model, {optimizer})")


def finetune_flags(candidate: Candidate, work: Workload, args: argparse.Namespace) -> str | None:
    if work.finetune is None or args.optimizer != "adamw":
        return None
    config = candidate.config
    dtype = {None: "none", torch.bfloat16: "bf16", torch.float16: "fp16"}[config.compute_dtype]
    flags = [*work.finetune, "--num-slices", str(config.num_slices), "--microbatches", str(config.num_microbatches),
             "--compute-dtype", dtype]
    if config.optimizer_state == "disk":
        flags += ["--disk-tier", str(args.disk_dir)]
    if config.masters == "disk":
        flags.append("--masters-on-disk")
    if config.schedule == "in-backward":
        flags.append("--update-in-backward")
    if config.resident_slices:
        flags += ["--resident-slices", str(config.resident_slices)]
    if args.max_grad_norm is not None:
        flags += ["--max-grad-norm", f"{args.max_grad_norm:g}"]
    return "offload-finetune " + " ".join(flags)


def _row(c: Candidate) -> dict[str, Any]:
    config = c.config
    return {
        "num_slices": config.num_slices, "num_microbatches": config.num_microbatches,
        "compute_dtype": None if config.compute_dtype is None else str(config.compute_dtype).removeprefix("torch."),
        "optimizer_state": config.optimizer_state, "masters": config.masters, "schedule": config.schedule,
        "resident_slices": config.resident_slices,
        "device_bytes": c.memory.device_total, "host_bytes": c.memory.host_total, "pinned_bytes": c.memory.pinned_bytes,
        "disk_bytes": c.memory.disk, "step_s": c.time.step, "efficiency": c.time.efficiency, "fits": c.fits,
        "over": c.over,
    }


def table(candidates: list[Candidate]) -> str:
    header = (f"{'slices':>6} {'res':>3} {'mb':>3} {'dtype':>8} {'state':>5} {'masters':>7} {'schedule':>11} "
              f"{'device':>9} {'host':>9} {'disk':>9} {'step':>9} {'eff':>5}")
    lines = [header]
    for c in candidates:
        r = _row(c)
        lines.append(f"{r['num_slices']:>6} {r['resident_slices']:>3} {r['num_microbatches']:>3} "
                     f"{r['compute_dtype'] or 'float32':>8} {r['optimizer_state']:>5} {r['masters']:>7} "
                     f"{r['schedule']:>11} {_gib(r['device_bytes']):>9} "
                     f"{_gib(r['host_bytes']):>9} {_gib(r['disk_bytes']):>9} {_seconds(r['step_s']):>9} "
                     f"{r['efficiency']:>5.2f}")
    return "\n".join(lines)


def report(plan: Plan, work: Workload, rates: MachineRates, limits: Limits, args: argparse.Namespace,
           alternatives: Sequence[Alternative] = ()) -> str:
    params = sum(p.numel() for p in work.layers.parameters())
    limit = ", ".join(f"{name} {_gib(value) if value is not None else 'no limit'}" for name, value in
                      (("device", limits.device_memory), ("host", limits.host_memory), ("disk", limits.disk)))
    lines = [f"model: {params / 1e9:.3f} B parameters, {len(work.layers)} layers, batch {work.batch_size}",
             f"rates: {rates.name}", f"limits: {limit}", ""]
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
              table(fitting), "", "chosen:", table([plan.chosen]), ""]
    t = plan.chosen.time
    lines.append(f"step {_seconds(t.step)}: forward {_seconds(t.forward)}, backward {_seconds(t.backward)}, "
                 f"update {_seconds(t.update)} of which exposed {_seconds(t.exposed_update)}; device compute "
                 f"{_seconds(t.forward_compute + t.backward_compute)}, link {_seconds(t.load)} in + "
                 f"{_seconds(t.offload)} out, disk {_seconds(t.disk_read)} read + {_seconds(t.disk_write)} "
                 f"write; resident slices' update on the device {_seconds(t.device_update)}; efficiency "
                 f"{t.efficiency:.2f}")
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
    return {
        "parameters": sum(p.numel() for p in work.layers.parameters()),
        "rates": rates.to_json(),
        "limits": {"device_memory": limits.device_memory, "host_memory": limits.host_memory, "disk": limits.disk,
                   "disk_dir": limits.disk_dir},
        "chosen": None if chosen is None else _row(chosen) | {
            "time": chosen.time.to_json(), "memory": chosen.memory.host_categories() | {
                f"device_{k}": v for k, v in chosen.memory.device_categories().items()},
            "code": code(chosen, work, args), "finetune": finetune_flags(chosen, work, args)},
        "missing": plan.missing,
        "alternatives": [a.to_json() for a in alternatives],
        "clips_gradients": args.max_grad_norm is not None,
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


def _one_line(error: BaseException) -> str:
    """``error``'s message on one line (transformers' and huggingface_hub's span several)."""
    return " ".join(line.strip() for line in str(error).splitlines() if line.strip()) or type(error).__name__


def _gib(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / GIB:.2f} GiB"


def _seconds(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


if __name__ == "__main__":
    main()
