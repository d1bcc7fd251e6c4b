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
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..planning.choose import Candidate, Limits, Plan, choose
from ..planning.presets import build_preset, preset_from_factory, preset_names
from ..planning.rates import GPU_DEFAULTS, HOST_DEFAULT, MachineRates, default_rates_path, load_rates
from ..planning.shapes import ModelProfile, profile_layers
from ..planning.timing import SCHEDULES
from .quiet_imports import import_transformers

DTYPES = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}
GIB = 2**30


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="offload plan", description=__doc__.split("\n\n")[0])
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
                            "left after the slots, gradient buffers and activations, with the margin")
    parser.add_argument("--top", type=int, default=8, help="rows of the table (the fastest that fit)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = parser.parse_args(argv)
    sources = [name for name in ("hf_config", "preset", "model") if getattr(args, name)]
    if len(sources) != 1:
        parser.error("give the model as one of --hf-config, --preset or --model")
    if args.model and not args.input_shape:
        parser.error("--model needs --input-shape")
    if args.resident_slices != "auto" and args.num_slices is not None and args.resident_slices > args.num_slices:
        parser.error(f"--resident-slices {args.resident_slices} is more than --num-slices {args.num_slices}")
    if args.schedule == "in-backward" and args.max_grad_norm is not None:
        parser.error("--schedule in-backward cannot clip: each slice's update starts in backward, before the "
                     "gradients' total norm is known. Leave out --max-grad-norm, or use another --schedule")
    return args


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
                 finetune: list[str] | None = None) -> None:
        self.layers = layers
        self.make_input = make_input
        self.batch_size = batch_size
        self.build = build
        self.finetune = finetune
        self._profiles: dict[Any, ModelProfile] = {}

    def profile(self, compute_dtype: torch.dtype | None) -> ModelProfile:
        if compute_dtype not in self._profiles:
            self._profiles[compute_dtype] = profile_layers(self.layers, self.make_input, compute_dtype=compute_dtype)
        return self._profiles[compute_dtype]


def workload(args: argparse.Namespace) -> Workload:
    if args.hf_config:
        return hf_workload(args)
    # Built on the meta device: the planner needs shapes and dtypes, not weights.
    with torch.device("meta"):
        if args.preset:
            overrides = dict(_setting(item) for item in args.set)
            preset = build_preset(args.preset, **overrides)
            build = f"build_preset({args.preset!r}{''.join(f', {k}={v!r}' for k, v in overrides.items())}).model"
        else:
            preset = preset_from_factory(args.model, args.input_shape, args.vocab, batch_size=args.batch_size)
            build = f"{args.model.replace(':', '.')}()"
    rows = args.batch_size

    def make_input() -> Any:
        return preset.make_batch(rows, "cpu")[0]

    return Workload(preset.model, make_input, rows, build)


def _setting(item: str) -> tuple[str, Any]:
    key, sep, value = item.partition("=")
    if not sep:
        raise SystemExit(f"--set takes KEY=VALUE, got {item!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def hf_config(spec: str) -> Any:
    """A transformers config from a ``config.json``, its directory, or the JSON text."""
    import transformers

    path = Path(spec)
    if spec.lstrip().startswith("{"):
        data = json.loads(spec)
    elif path.is_dir():
        return transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    elif path.is_file():
        data = json.loads(path.read_text())
    else:
        raise SystemExit(f"--hf-config {spec}: no such file or directory, and not JSON")
    model_type = data.pop("model_type", None)
    if model_type is None:
        raise SystemExit(f"--hf-config {spec}: the config has no model_type")
    return transformers.AutoConfig.for_model(model_type, **data)


def hf_workload(args: argparse.Namespace) -> Workload:
    """The config's causal LM built on the meta device, cut into stages as OffloadModel gets it."""
    try:
        transformers = import_transformers()  # without torchao's import notes (offload/cli/quiet_imports.py)
    except ImportError as error:
        raise SystemExit(f'{error}. --hf-config needs transformers: pip install "offload[transformers]"') from error
    from ..integrations.transformers import causal_lm_sequential

    config = hf_config(args.hf_config)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        if args.lora_r:
            import peft

            hf = peft.get_peft_model(hf, peft.LoraConfig(r=args.lora_r, target_modules="all-linear",
                                                         task_type="CAUSAL_LM"))
    chunk = args.loss_chunk_tokens or None
    layers = causal_lm_sequential(hf, loss_chunk_tokens=chunk)
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


def machine_rates(args: argparse.Namespace) -> MachineRates:
    """The GPU's defaults with the calibrated host where there is a calibration, or the calibration."""
    path = args.rates or default_rates_path()
    calibrated = load_rates(path) if path.exists() else None
    if args.rates is not None and calibrated is None:
        load_rates(args.rates)  # raises, saying how to make it
    if args.gpu:
        gpu = GPU_DEFAULTS[args.gpu]
        return gpu.with_host(calibrated) if calibrated is not None else gpu
    if calibrated is not None:
        return calibrated
    if args.device == "cpu":
        return HOST_DEFAULT
    raise SystemExit(f"no rates: run `python -m offload calibrate` on the machine (writes {path}), or pass "
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


def run_plan(args: argparse.Namespace) -> tuple[Plan, Workload, MachineRates, Limits]:
    work = workload(args)
    rates = machine_rates(args)
    limits = machine_limits(args, rates)
    fixed: dict[str, Any] = {} if args.schedule == "auto" else {"schedule": args.schedule}
    if args.num_slices:
        fixed["num_slices"] = args.num_slices
    if args.microbatches:
        fixed["num_microbatches"] = args.microbatches
    if args.compute_dtype != "auto":
        fixed["compute_dtype"] = DTYPES[args.compute_dtype]
    if args.resident_slices != "auto":
        fixed["resident_slices"] = args.resident_slices
    plan = choose(work.layers, work.profile, rates, limits, device=args.device, optimizer=args.optimizer,
                  batch_size=work.batch_size, fixed=fixed, clips_gradients=args.max_grad_norm is not None)
    return plan, work, rates, limits


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


def report(plan: Plan, work: Workload, rates: MachineRates, limits: Limits, args: argparse.Namespace) -> str:
    params = sum(p.numel() for p in work.layers.parameters())
    limit = ", ".join(f"{name} {_gib(value) if value is not None else 'no limit'}" for name, value in
                      (("device", limits.device_memory), ("host", limits.host_memory), ("disk", limits.disk)))
    lines = [f"model: {params / 1e9:.3f} B parameters, {len(work.layers)} layers, batch {work.batch_size}",
             f"rates: {rates.name}", f"limits: {limit}", ""]
    fitting = sorted((c for c in plan.candidates if c.fits), key=lambda c: c.time.step)[:args.top]
    if plan.chosen is None:
        lines += ["nothing fits: " + plan.missing]
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


def as_json(plan: Plan, work: Workload, rates: MachineRates, limits: Limits, args: argparse.Namespace) -> dict[str, Any]:
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
        "clips_gradients": args.max_grad_norm is not None,
        "candidates": [_row(c) for c in plan.candidates],
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    plan, work, rates, limits = run_plan(args)
    if args.json:
        json.dump(as_json(plan, work, rates, limits, args), sys.stdout, indent=2)
        print()
    else:
        print(report(plan, work, rates, limits, args))
    if plan.chosen is None:
        raise SystemExit(1)


def _gib(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / GIB:.2f} GiB"


def _seconds(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


if __name__ == "__main__":
    main()
