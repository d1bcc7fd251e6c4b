"""Host memory per parameter: what an OffloadModel trained by OffloadOptimizer holds, byte by byte.

Builds an MLP of ``--params`` parameters (16 square ``nn.Linear`` layers with ReLUs between them),
wraps it in ``--slices`` slices, trains it three steps with
``OffloadOptimizer(torch.optim.AdamW, fused=True)`` and ``zero_grad(set_to_none=False)`` on a
small batch (``--backwards K``: K backwards a step, gradients accumulated over them, zeroed with
``zero_grad()`` after each step as the Hugging Face Trainer does), and reports host bytes per
parameter two ways:

- by category, from ``memory_footprint()`` after the last step (masters, shadows, gradients,
  optimizer state, the pool of gradient and activation buffers);
- from the process's resident set: its growth from before the model was built to after the last
  step, and its peak growth (the peak, ``VmHWM``, over the baseline taken before the model was
  built), both divided by the number of parameters;
- as ``offload.estimate_memory`` predicts it, before anything is built.

A tiny model trains one step first, so that what PyTorch sets up once per process (kernels,
thread pools, the host worker's thread) is in the baseline and not counted per parameter. The
batch is small so that activations are a rounding error: what is left is what the layout costs
per parameter. The device is the CPU, so the device slots are host memory too: the RSS figures
include them (``device_bytes``).

Usage::

    python benchmarks/bench_host_memory.py                                   # 10 M parameters (CI)
    python benchmarks/bench_host_memory.py --params 100e6 --json benchmarks/results/host_memory_fp32.json
    python benchmarks/bench_host_memory.py --params 100e6 --compute-dtype bfloat16 --json out.json
    python benchmarks/bench_host_memory.py --params 100e6 --backwards 4   # accumulation over backwards
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import platform
import sys

import torch
from torch import nn

from offload import OffloadModel, OffloadOptimizer, estimate_memory
from offload.kernels import host_kernel
from json_output import check_json_path  # benchmarks/json_output.py, next to this file

LAYERS = 16
BATCH = 8


def rss_bytes() -> tuple[int, int]:
    """The resident set now and its peak so far (``VmRSS``, ``VmHWM`` of ``/proc/self/status``)."""
    fields = {}
    with open("/proc/self/status") as status:
        for line in status:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                fields[name] = int(value.split()[0]) * 1024
    return fields["VmRSS"], fields["VmHWM"]


def build_mlp(params: float) -> nn.Sequential:
    width = max(8, round(math.sqrt(params / LAYERS)))
    layers: list[nn.Module] = []
    for k in range(LAYERS):
        layers.append(nn.Linear(width, width))
        if k + 1 < LAYERS:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def train(params: float, slices: int, compute_dtype: torch.dtype | None, steps: int, backwards: int = 1
          ) -> OffloadModel:
    plain = build_mlp(params)
    model = OffloadModel(plain, device="cpu", num_slices=slices, compute_dtype=compute_dtype)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-3, fused=True)
    x = torch.randn(BATCH, plain[0].in_features)
    for _ in range(steps):
        for _ in range(backwards):
            model(x).float().square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=backwards > 1)
    optimizer.synchronize()
    model._bench_optimizer = optimizer  # type: ignore[attr-defined]  # its state counts while the model lives
    return model


def measure(params: float, slices: int, compute_dtype: torch.dtype | None, steps: int = 3, backwards: int = 1
            ) -> dict:
    torch.manual_seed(0)
    warm = train(1e4, slices, compute_dtype, 1)  # what a process sets up once
    host_kernel(wait=True)  # the one-pass update's kernel, too: loaded on a thread of its own
    del warm
    gc.collect()
    baseline, _ = rss_bytes()
    estimate = estimate_memory([_layer_params(params)] * LAYERS, num_slices=slices,
                               compute_dtype=compute_dtype, device="cpu")
    model = train(params, slices, compute_dtype, steps, backwards)
    count = sum(p.numel() for p in model.parameters())
    gc.collect()
    rss, peak = rss_bytes()
    footprint = model.memory_footprint()
    categories = footprint.host_categories()
    return {
        "parameters": count,
        "slices": slices,
        "compute_dtype": None if compute_dtype is None else str(compute_dtype).removeprefix("torch."),
        "steps": steps,
        "backwards_per_step": backwards,
        "host_bytes": categories,
        "host_bytes_per_param": {name: nbytes / count for name, nbytes in categories.items()},
        "host_bytes_per_param_total": footprint.host_total / count,
        "rss_growth_bytes_per_param": (rss - baseline) / count,
        "rss_peak_growth_bytes_per_param": (peak - baseline) / count,
        "device_bytes": footprint.device_categories(),
        "rss_growth_bytes": rss - baseline,
        "rss_peak_growth_bytes": peak - baseline,
        "estimate": {"host_bytes": estimate.host_categories(), "host_total": estimate.host_total,
                     "device_total": estimate.device_total, "disk": estimate.disk},
        "estimate_vs_footprint": estimate.host_total / footprint.host_total,
        # On the CPU the slots are host memory: the process holds host and device categories.
        "estimate_vs_rss": (estimate.host_total + estimate.device_total) / (rss - baseline),
        "footprint": str(footprint),
    }


def _layer_params(params: float) -> int:
    width = max(8, round(math.sqrt(params / LAYERS)))
    return width * width + width


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=10e6, help="parameters of the MLP (default: 10e6)")
    parser.add_argument("--slices", type=int, default=8, help="slices (default: 8)")
    parser.add_argument("--compute-dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                        help="dtype the layers compute in; float32 (the default) keeps no shadow")
    parser.add_argument("--backwards", type=int, default=1,
                        help="backwards a step, accumulating gradients (default: 1)")
    parser.add_argument("--json", metavar="PATH", help="write the figures to this JSON file")
    args = parser.parse_args(argv)
    check_json_path(parser, args.json)
    if args.backwards < 1:
        parser.error("--backwards must be at least 1")
    compute_dtype = None if args.compute_dtype == "float32" else getattr(torch, args.compute_dtype)
    result = measure(args.params, args.slices, compute_dtype, backwards=args.backwards)
    print(result["footprint"])
    print(f"parameters: {result['parameters']:,}")
    for name, value in result["host_bytes_per_param"].items():
        print(f"  {name:<18} {value:6.2f} B/param")
    print(f"footprint total      {result['host_bytes_per_param_total']:6.2f} B/param")
    print(f"RSS growth           {result['rss_growth_bytes_per_param']:6.2f} B/param "
          f"(peak {result['rss_peak_growth_bytes_per_param']:.2f}; host and the CPU's device slots)")
    print(f"estimate_memory      host {result['estimate_vs_footprint']:.3f} x the footprint, "
          f"host + device {result['estimate_vs_rss']:.3f} x the RSS growth")
    if args.json:
        record = {
            "command": "python " + " ".join(["benchmarks/bench_host_memory.py", *sys.argv[1:]]),
            "date": datetime.date.today().isoformat(),
            "machine": {"platform": platform.platform(), "python": platform.python_version(),
                        "torch": torch.__version__, "threads": torch.get_num_threads()},
            **result,
        }
        with open(args.json, "w") as out:
            json.dump(record, out, indent=2)
            out.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
