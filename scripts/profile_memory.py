"""Show what offloading saves in device memory and what it costs in host memory and time.

Trains the same model on the same input in several modes, one after another in this process:
``resident`` (the plain model on the device) and OffloadModel configurations (every combination
of ``--slices``, ``--microbatches``, ``--checkpoint`` and ``--compute-dtype``). Prints a table per mode, per phase;
optionally writes JSON, the sampled timeline as CSV, and a PNG of memory over time. Without a GPU
or without NVML it still runs and says which figures are unavailable and why.

Usage::

    python scripts/profile_memory.py --preset mlp --steps 3
    python scripts/profile_memory.py --preset transformer --slices 2 4 8 --microbatches 1 4 --plot memory.png
    python scripts/profile_memory.py --model mypackage.models:build --input-shape 3,224,224 --batch-size 32
    python scripts/profile_memory.py --preset mlp --no-resident --expect-peak-below 2GiB   # a memory budget for CI

Exit status: 0, or 1 when ``--expect-peak-below`` is exceeded or a mode fails, 2 for bad arguments
(found before the first mode runs: the output paths, the device and the model among them).
The measuring code is ``offload/profiling/``; the models are ``offload/planning/presets.py``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import threading
from collections.abc import Callable

import torch

from offload.cli.device_argument import device_argument
from offload.planning.presets import Preset, build_preset, preset_from_factory, preset_names
from offload.profiling import (
    Mode,
    ModeFailed,
    PlotUnavailable,
    Profile,
    check_plotting,
    format_size,
    offload_modes,
    parse_size,
    profile_modes,
)
from offload.profiling.formatting import error_reason
from offload.profiling.outputs import check_output_path


class OneLineErrorParser(argparse.ArgumentParser):
    """Argument errors as one line, without the usage block."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


class FreshEachCall:
    """Builds a preset once now (so bad arguments fail before anything runs), hands that build to
    the first mode, and builds anew for every later one: no mode sees another's model."""

    def __init__(self, make: Callable[[], Preset]) -> None:
        self._make = make
        self._first: Preset | None = make()
        self.description = f"{self._first.name}: {self._first.description}"
        self.settings = dict(self._first.settings)
        self.parameter_bytes = self._first.parameter_bytes

    def __call__(self) -> Preset:
        first, self._first = self._first, None
        return first if first is not None else self._make()


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(description=__doc__.split("\n\n")[0], prog="profile_memory.py")
    what = parser.add_argument_group("model")
    what.add_argument("--preset", default="mlp", help=f"one of {', '.join(preset_names())} (default: mlp)")
    what.add_argument("--model", metavar="PACKAGE.MODULE:FACTORY",
                      help="your own model: a function returning an nn.Sequential (instead of --preset)")
    what.add_argument("--input-shape", type=shape, metavar="N[,N...]",
                      help="with --model: shape of one sample, without the batch dimension, e.g. 3,224,224")
    what.add_argument("--vocab", type=positive_int, help="with --model: the input is token ids below this")
    what.add_argument("--batch-size", type=positive_int, help="rows per step (default: the preset's)")

    how = parser.add_argument_group("modes")
    how.add_argument("--device", type=device_argument, default="cuda" if torch.cuda.is_available() else "cpu",
                     help="compute device: cpu, cuda or cuda:N (default: cuda when present, else cpu)")
    how.add_argument("--steps", type=positive_int, default=3, help="training steps per mode (default: 3)")
    how.add_argument("--slices", type=positive_int, nargs="+", default=[4], help="OffloadModel num_slices values (default: 4)")
    how.add_argument("--microbatches", type=positive_int, nargs="+", default=[1],
                     help="OffloadModel num_microbatches values (default: 1)")
    how.add_argument("--checkpoint", choices=["on", "off", "both"], default="both",
                     help="OffloadModel checkpoint_activation (default: both)")
    how.add_argument("--compute-dtype", choices=["none", "bf16", "fp16"], nargs="+", default=["none"],
                     help="OffloadModel compute_dtype values (default: none, the model's own dtype)")
    how.add_argument("--no-resident", action="store_true",
                     help="skip the resident mode (for a model that does not fit on the device)")
    how.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw",
                     help="what every mode steps over model.parameters(): torch.optim.AdamW or SGD, with "
                          "fused=True (default: adamw)")
    how.add_argument("--sample-interval", type=float, default=5.0, metavar="MS",
                     help="milliseconds between memory samples (default: 5)")

    out = parser.add_argument_group("output")
    out.add_argument("--json", metavar="PATH", help="write every figure, one entry per mode under 'runs'")
    out.add_argument("--csv", metavar="PATH", help="write the sampled memory timeline")
    out.add_argument("--plot", metavar="PATH", help="draw memory over time per mode as a PNG (needs matplotlib)")
    out.add_argument("--expect-peak-below", type=size, metavar="SIZE",
                     help="exit 1 if the offloaded peak exceeds SIZE (512MiB, 2GiB, 1.5GB, bytes): device "
                          "allocated on CUDA, host RSS on the CPU")
    out.add_argument("--debug", action="store_true", help="show the traceback when a mode fails")
    return parser


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What argparse cannot check by itself; each failure is a one-line error (exit status 2)."""
    if args.model is None and args.preset not in preset_names():
        parser.error(f"unknown preset {args.preset!r}; choose from {', '.join(preset_names())}")
    if args.model is not None and args.input_shape is None:
        parser.error("--model needs --input-shape (the shape of one sample, e.g. 1024 or 3,224,224)")
    if args.model is None and (args.input_shape is not None or args.vocab is not None):
        parser.error("--input-shape and --vocab describe the input of --model; presets make their own")
    # Written so that nan fails it too: the sampler's thread would spin on a wait of nan, and a
    # wait past TIMEOUT_MAX (inf) overflows in that thread.
    if not 0 < args.sample_interval / 1e3 <= threading.TIMEOUT_MAX:
        parser.error(f"--sample-interval must be a positive number of milliseconds, at most "
                     f"{threading.TIMEOUT_MAX * 1e3:.3g}; got {args.sample_interval}")
    if args.plot:
        try:
            check_plotting()  # now, not after a long run
        except PlotUnavailable as error:
            parser.error(f"--plot: {error}")
    check_outputs(parser, args)


def check_outputs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Make each output's directory and check the file can be written there, before the first
    mode runs: a path found wrong after the run would lose every measurement."""
    for flag, path in (("--json", args.json), ("--csv", args.csv), ("--plot", args.plot)):
        if not path:
            continue
        try:
            if os.path.dirname(path) and not os.path.lexists(os.path.dirname(path)):
                os.makedirs(os.path.dirname(path))
            check_output_path(path, flag)
        except OSError as error:
            # makedirs's own errors lack the flag; check_output_path's name it.
            parser.error(str(error) if str(error).startswith(flag) else f"{flag}: cannot write {path!r}: {error}")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def shape(text: str) -> tuple[int, ...]:
    return tuple(positive_int(part) for part in text.replace("x", ",").split(","))


def size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_arguments(parser, args)
    build = preset_builder(parser, args)
    checkpoint = {"on": [True], "off": [False], "both": [True, False]}[args.checkpoint]
    dtypes = [{"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[name] for name in args.compute_dtype]
    modes = [] if args.no_resident else [Mode.resident()]
    modes += offload_modes(args.slices, args.microbatches, checkpoint, dtypes)
    print(f"profiling {build.description} ({format_size(build.parameter_bytes)} of parameters) on {args.device}: "
          f"{len(modes)} modes x {args.steps} step(s)", file=sys.stderr, flush=True)
    try:
        profile = profile_modes(build, modes, args.device, steps=args.steps, batch_size=args.batch_size,
                                optimizer=args.optimizer, sample_interval_s=args.sample_interval / 1e3,
                                progress=lambda line: print(line, file=sys.stderr, flush=True))
    except ModeFailed as error:
        if args.debug:
            raise
        print(f"{parser.prog}: error: {error} (--debug shows the traceback)", file=sys.stderr)
        return 1
    print(profile.table())

    expectation = None
    if args.expect_peak_below is not None:
        expectation = check_budget(profile, args.expect_peak_below)
    if args.json:
        result = {
            "tool": "profile_memory",
            "command": " ".join(["python", sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
            "model": {"description": build.description, "settings": build.settings,
                      "parameter_bytes": build.parameter_bytes},
            "environment": environment(args.device),
            "expect_peak_below": expectation,
            **profile.to_json(),
        }
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    if args.csv:
        profile.write_csv(args.csv)
    if args.plot:
        profile.plot(args.plot)
    return 0 if expectation is None or expectation["passed"] else 1


def preset_builder(parser: argparse.ArgumentParser, args: argparse.Namespace) -> FreshEachCall:
    if args.model is not None:
        # Run as a script, Python puts scripts/ first on the path, not the directory the user is in.
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())

        def make() -> Preset:
            return preset_from_factory(args.model, args.input_shape, args.vocab)
    else:
        def make() -> Preset:
            return build_preset(args.preset)
    try:
        return FreshEachCall(make)
    except (ValueError, TypeError) as error:  # the preset's checks, the factory's import, name and return value
        parser.error(str(error))
    except Exception as error:
        if args.model is None:
            raise  # a preset that fails to build is this project's bug: its traceback says where
        parser.error(f"--model {args.model}: the factory raised {error_reason(error)}")
    raise AssertionError("unreachable: parser.error exits")


def check_budget(profile: Profile, budget: int) -> dict[str, object]:
    """Print whether the offloaded peak is below ``budget``; returns the verdict for the JSON."""
    peak, what, label = profile.offloaded_peak()
    if peak is None:
        message = f"FAIL: cannot check --expect-peak-below {format_size(budget)}: offload mode '{label}' has no figure"
    elif peak > budget:
        message = f"FAIL: offloaded {what} {format_size(peak)} ({label}) exceeds {format_size(budget)}"
    else:
        message = f"OK: offloaded {what} {format_size(peak)} ({label}) is below {format_size(budget)}"
    passed = message.startswith("OK")
    print(message, file=sys.stdout if passed else sys.stderr)
    return {"budget_bytes": budget, "peak_bytes": peak, "measured": what, "mode": label, "passed": passed}


def environment(device: torch.device) -> dict[str, object]:
    info: dict[str, object] = {
        "date": datetime.date.today().isoformat(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    return info


if __name__ == "__main__":
    sys.exit(main())
