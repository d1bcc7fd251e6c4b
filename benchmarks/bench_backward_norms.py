"""What clipping costs after backward, with the host gradients' norms computed in backward
(``OffloadOptimizer(norms_in_backward=True)``, Note: [Norms from backward] in
``offload/optimizing/backward_norms.py``), with those and the scaling run in each slice's update
(``scale_in_update=True`` too, Note: [Scaling in the update] in
``offload/optimizing/deferred_scaling.py``), and with neither (``offload.clip_grad_norm_`` reads
every gradient after backward, on several threads, and scales them).

Each step: forward, backward, ``offload.clip_grad_norm_``, ``step()``, ``zero_grad()``; the three
ways take turns by round on triplet models; medians of the timed steps of every round. Also checked:
the three ways give the same norms and parameters, bit for bit.

    python benchmarks/bench_backward_norms.py --json benchmarks/results/backward_norms_cpu_<date>.json
    python benchmarks/bench_backward_norms.py --quick     # a smoke test, a few seconds
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import offload  # noqa: E402
from offload import OffloadModel, OffloadOptimizer  # noqa: E402
from json_output import check_json_path  # benchmarks/json_output.py, next to this file


def network(dim: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)) for _ in range(layers)]
    return nn.Sequential(*blocks)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run(args: argparse.Namespace, model: OffloadModel, optimizer: OffloadOptimizer, x: torch.Tensor,
        samples: dict[str, list[float]], norms: list[torch.Tensor]) -> None:
    for step in range(args.warmup + args.steps):
        sync(args.device)
        start = time.perf_counter()
        loss = model(x).float().pow(2).mean()
        sync(args.device)
        forward_end = time.perf_counter()
        loss.backward()
        sync(args.device)
        backward_end = time.perf_counter()
        norms.append(offload.clip_grad_norm_(model.parameters(), args.clip))
        clip_end = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad()
        if step >= args.warmup:
            samples["forward_s"].append(forward_end - start)
            samples["backward_s"].append(backward_end - forward_end)
            samples["clip_s"].append(clip_end - backward_end)
            samples["step_s"].append(time.perf_counter() - start)
    optimizer.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8, help="blocks of two linear layers (4x wide inside)")
    parser.add_argument("--slices", type=int, default=8)
    parser.add_argument("--rows", type=int, default=256, help="rows in the batch")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--clip", type=float, default=1e-6, help="max_norm (small: the scaling runs every step)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    check_json_path(parser, args.json)
    if args.quick:
        args.dim, args.layers, args.slices, args.rows, args.steps, args.warmup, args.rounds = 64, 2, 2, 8, 2, 2, 1
    base = network(args.dim, args.layers)
    x = torch.randn(args.rows, args.dim, generator=torch.Generator().manual_seed(1)).to(args.device)
    ways = {"after_backward": {}, "in_backward": {"norms_in_backward": True},
            "scaled_in_update": {"norms_in_backward": True, "scale_in_update": True}}
    pairs = {}
    for name, options in ways.items():
        model = OffloadModel(copy.deepcopy(base), device=args.device, num_slices=args.slices)
        pairs[name] = (model, OffloadOptimizer(model, torch.optim.AdamW, lr=1e-4, fused=True, **options))
    samples = {name: {"forward_s": [], "backward_s": [], "clip_s": [], "step_s": []} for name in ways}
    norms: dict[str, list[torch.Tensor]] = {name: [] for name in ways}
    names = list(ways)
    for round_ in range(args.rounds):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:  # each goes first in turn
            run(args, *pairs[name], x, samples[name], norms[name])
    first = names[0]
    same_norms = all(torch.equal(a, b) for name in names[1:] for a, b in zip(norms[first], norms[name]))
    same_parameters = all(torch.equal(a, b) for name in names[1:]
                          for a, b in zip(pairs[first][0].parameters(), pairs[name][0].parameters()))
    result = {
        "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "machine": {"processor": platform.machine(), "threads": torch.get_num_threads(), "torch": torch.__version__},
        "sizes": {"dim": args.dim, "layers": args.layers, "slices": args.slices, "rows": args.rows,
                  "parameters": sum(p.numel() for p in base.parameters()), "steps": args.steps,
                  "warmup": args.warmup, "rounds": args.rounds},
        "medians": {name: {k: statistics.median(v) for k, v in s.items()} for name, s in samples.items()},
        "samples": samples,
        "norms": {name: [float(n) for n in values] for name, values in norms.items()},
        "scaled_every_step": all(float(n) > args.clip for values in norms.values() for n in values),
        "same_norms": same_norms,
        "same_parameters": same_parameters,
    }
    for name, medians in result["medians"].items():
        print(f"{name:17s} " + "  ".join(f"{k} {v * 1e3:8.1f} ms" for k, v in medians.items()))
    print(f"same norms: {same_norms}, same parameters: {same_parameters}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    if not (same_norms and same_parameters):
        sys.exit(1)


if __name__ == "__main__":
    main()
