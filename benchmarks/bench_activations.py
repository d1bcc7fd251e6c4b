"""Recompute, offload or keep each slice's activations: what a training step costs with each.

One transformer (``offload.planning.presets``, "transformer") is trained a few steps three ways
(Note: [Three ways to keep a slice's activations] in ``offload/walk/activation_policy.py``):

- ``recompute``: ``checkpoint_activation=True``, the default;
- ``offload``: every slice's saved activations to the host and back (``OffloadActivations(last=n)``);
- ``kept``: ``checkpoint_activation=False``, every graph on the device.

For each it records, per step: the wall time (forward and backward apart), the device FLOPs
(``torch.utils.flop_counter``: the recompute shows as a second forward), the bytes over the link
each way (parameters, boundary activations, saved activations), the host bytes held for backward
(``memory_footprint().host_activations`` after forward), and on CUDA the device peak above the model's
resting memory. The three must give the same loss and gradients bit for bit.

From those it derives the crossover (``docs/memory.md``): per slice, with ``T`` tokens, ``s``
saved bytes and ``f`` forward FLOPs per token, ``b`` backward FLOPs per token, ``P`` parameter
bytes loaded per pass and a device that computes ``R`` FLOP/s, the link (``bw`` each way, full
duplex) carries per slice

- forward:  recompute ``max(fT/R, P/bw)``;            offload ``max(fT/R, P/bw, sT/bw)``
- backward: recompute ``max((f+b)T/R, P/bw)``;        offload ``max(bT/R, (P+sT)/bw)``

(boundary activations and gradients are the same in both and small beside these). Offload wins
where its sum is the smaller; the script prints, for each link bandwidth, the fewest tokens per
slice from which it does, using the device rate it measured (``--device-tflops`` to assume another).

Usage::

    python benchmarks/bench_activations.py [--layers 4] [--d-model 256] [--seq-len 256] [--batch 8]
        [--steps 3] [--device-tflops R] [--link NAME=GBPS ...] [--json PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from offload import OffloadActivations, OffloadModel
from offload.model import engine_of
from offload.planning.presets import build_preset
from json_output import check_json_path  # benchmarks/json_output.py, next to this file

MODES = ("recompute", "offload", "kept")
#: Link bandwidths (GB/s, each way) the crossover is printed for: PCIe 4 and 5 x16 as measured
#: with pinned memory, and NVLink-C2C (GH200) as specified.
LINKS = {"pcie4": 25.0, "pcie5": 50.0, "nvlink-c2c": 450.0}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def model_kwargs(mode: str, num_slices: int) -> dict[str, Any]:
    if mode == "recompute":
        return {"checkpoint_activation": True}
    if mode == "kept":
        return {"checkpoint_activation": False}
    return {"checkpoint_activation": True, "offload_activations": OffloadActivations(last=num_slices, min_bytes=0)}


def step(model: torch.nn.Module, preset: Any, x: torch.Tensor, y: torch.Tensor, device: torch.device
         ) -> tuple[float, float, int, torch.Tensor]:
    """One forward and backward: their times, the host bytes held between them, the loss."""
    synchronize(device)
    start = time.perf_counter()
    loss = preset.loss(model(x), y)
    synchronize(device)
    forward_done = time.perf_counter()
    held = model.memory_footprint().host_activations if isinstance(model, OffloadModel) else 0
    loss.backward()
    synchronize(device)
    return forward_done - start, time.perf_counter() - forward_done, held, loss.detach()


def run_mode(mode: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    preset = build_preset("transformer", n_layers=args.layers, d_model=args.d_model, n_heads=args.heads,
                          seq_len=args.seq_len, vocab=args.vocab)
    x, y = preset.make_batch(args.batch, device)
    if mode == "plain":
        model: torch.nn.Module = preset.model.to(device)
    else:
        model = OffloadModel(preset.model, device=device, num_slices=args.slices,
                             compute_dtype=args.compute_dtype, **model_kwargs(mode, args.slices))
    # Warm-up: pooled host buffers, the allocator, kernels' first launches.
    for _ in range(args.warmup):
        step(model, preset, x, y, device)
        model.zero_grad(set_to_none=True)
    engine = engine_of(model) if isinstance(model, OffloadModel) else None
    before = (engine.copies.loaded_bytes, engine.copies.offloaded_bytes, engine.activations.offloaded_bytes,
              engine.activations.saved_bytes) if engine else (0, 0, 0, 0)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        resting = torch.cuda.memory_allocated(device)
    forwards, backwards, held = [], [], []
    for _ in range(args.steps):
        model.zero_grad(set_to_none=True)
        f, b, h, loss = step(model, preset, x, y, device)
        forwards.append(f)
        backwards.append(b)
        held.append(h)
    peak = torch.cuda.max_memory_allocated(device) - resting if device.type == "cuda" else None
    after = (engine.copies.loaded_bytes, engine.copies.offloaded_bytes, engine.activations.offloaded_bytes,
             engine.activations.saved_bytes) if engine else (0, 0, 0, 0)
    loaded, offloaded, activations, saved = [(a - b) // args.steps for a, b in zip(after, before)]
    model.zero_grad(set_to_none=True)
    with FlopCounterMode(display=False) as counter:
        out = preset.loss(model(x), y)
        forward_flops = counter.get_total_flops()
        out.backward()
        del out
    grads = [p.grad.detach().to("cpu", copy=True) for p in model.parameters() if p.grad is not None]
    result = {
        "forward_s": statistics.median(forwards),
        "backward_s": statistics.median(backwards),
        "step_s": statistics.median(f + b for f, b in zip(forwards, backwards)),
        "flops_per_step": counter.get_total_flops(),
        "forward_flops_per_step": forward_flops,
        "loaded_bytes_per_step": loaded,
        "offloaded_bytes_per_step": offloaded,
        "saved_activation_bytes_per_step": saved,
        "boundary_activation_bytes_per_step": activations - saved,
        "host_activation_bytes_after_forward": max(held),
        "device_peak_bytes": peak,
        "loss": float(loss),
    }
    if engine is not None:
        result["parameter_bytes_per_load"] = sum(s.storage.load_nbytes for s in engine.slices)
    return result | {"_grads": grads}


def crossover(rate: float, s: float, f: float, b: float, params: float, bandwidth: float,
              max_tokens: int = 1 << 24) -> int | None:
    """The fewest tokens per slice from which offload's step is shorter than recompute's (the
    model in this file's docstring), or None if it never is below ``max_tokens``."""

    def offload_wins(tokens: int) -> bool:
        compute_f, compute_b, link_s, link_p = f * tokens / rate, b * tokens / rate, s * tokens / bandwidth, \
            params / bandwidth
        recompute = max(compute_f, link_p) + max(compute_f + compute_b, link_p)
        offload = max(compute_f, link_p, link_s) + max(compute_b, link_p + link_s)
        return offload < recompute

    tokens = 1
    while tokens <= max_tokens and not offload_wins(tokens):
        tokens *= 2
    if tokens > max_tokens:
        return None
    low = tokens // 2  # refine between the last power of two that lost and this one
    while low + 1 < tokens:
        middle = (low + tokens) // 2
        if offload_wins(middle):
            tokens = middle
        else:
            low = middle
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--slices", type=int, default=None, help="default: one per block, plus two")
    parser.add_argument("--compute-dtype", choices=["bfloat16", "float16"], default=None)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--device-tflops", type=float, default=None,
                        help="device rate for the crossover (default: measured on the plain model)")
    parser.add_argument("--link", action="append", default=[], metavar="NAME=GBPS",
                        help="another link bandwidth (GB/s each way) to find the crossover for")
    parser.add_argument("--json")
    args = parser.parse_args()
    check_json_path(parser, args.json)
    args.slices = args.slices or args.layers + 2
    args.compute_dtype = getattr(torch, args.compute_dtype) if args.compute_dtype else None
    device = torch.device(args.device)

    results = {mode: run_mode(mode, args, device) for mode in (*MODES, "plain")}
    grads = {mode: results[mode].pop("_grads") for mode in results}
    identical = all(results[m]["loss"] == results["recompute"]["loss"] and len(grads[m]) == len(grads["recompute"])
                    and all(torch.equal(a, b) for a, b in zip(grads[m], grads["recompute"])) for m in MODES)

    tokens = args.batch * args.seq_len
    plain = results.pop("plain")
    rate = args.device_tflops * 1e12 if args.device_tflops else plain["flops_per_step"] / plain["step_s"]
    # Per slice and token, averaged over the slices: forward and backward FLOPs of the plain model,
    # saved bytes over the slices that offloaded them (all but the last, which keeps its graph).
    forward_flops = plain["forward_flops_per_step"] / args.slices / tokens
    backward_flops = (plain["flops_per_step"] - plain["forward_flops_per_step"]) / args.slices / tokens
    saved_per_token = results["offload"]["saved_activation_bytes_per_step"] / max(1, args.slices - 1) / tokens
    params_per_slice = results["offload"]["parameter_bytes_per_load"] / args.slices
    # Compute-bound, offload wins while moving a run's saved bytes takes less than min(2F, F + B/2)
    # (the sum of the phases in the docstring with the parameters' loads hidden): the link floor.
    floor = saved_per_token * rate / (forward_flops * min(2.0, 1.0 + backward_flops / (2 * forward_flops))) / 1e9
    links = dict(LINKS)
    for given in args.link:
        name, _, gbps = given.partition("=")
        links[name] = float(gbps)
    if device.type == "cuda":
        host = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)
        target = torch.empty_like(host, device=device)
        target.copy_(host, non_blocking=True)
        synchronize(device)
        start = time.perf_counter()
        for _ in range(5):
            target.copy_(host, non_blocking=True)
        synchronize(device)
        links["measured"] = 5 * host.numel() / (time.perf_counter() - start) / 1e9
    crossovers = {name: crossover(rate, saved_per_token, forward_flops, backward_flops, params_per_slice, gbps * 1e9)
                  for name, gbps in links.items()}

    report = {
        "command": "python " + " ".join(sys.argv),
        "date": datetime.date.today().isoformat(),
        "machine": {"processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                    "torch_threads": torch.get_num_threads(), "torch": torch.__version__},
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "model": {"layers": args.layers, "d_model": args.d_model, "heads": args.heads, "seq_len": args.seq_len,
                  "vocab": args.vocab, "batch": args.batch, "slices": args.slices,
                  "compute_dtype": str(args.compute_dtype) if args.compute_dtype else None},
        "tokens_per_slice": tokens,
        "modes": results,
        "plain_model": plain,
        "identical_results": identical,
        "per_slice_and_token": {"saved_bytes": saved_per_token, "forward_flops": forward_flops,
                                "backward_flops": backward_flops},
        "parameter_bytes_per_slice_load": params_per_slice,
        "device_flops_per_s": rate,
        "device_rate": "given (--device-tflops)" if args.device_tflops else "measured on the plain model",
        "link_floor_gb_per_s": floor,
        "link_gb_per_s": links,
        "crossover_tokens_per_slice": crossovers,
    }
    for mode, r in results.items():
        peak = f", device peak {r['device_peak_bytes'] / 2**20:.1f} MiB" if r["device_peak_bytes"] is not None else ""
        print(f"{mode:>9}: step {r['step_s'] * 1e3:7.1f} ms (forward {r['forward_s'] * 1e3:.1f}, backward "
              f"{r['backward_s'] * 1e3:.1f}), {r['flops_per_step'] / 1e9:.2f} GFLOP, link in "
              f"{r['loaded_bytes_per_step'] / 2**20:.1f} MiB out {r['offloaded_bytes_per_step'] / 2**20:.1f} MiB "
              f"(saved activations {r['saved_activation_bytes_per_step'] / 2**20:.1f} MiB), host held "
              f"{r['host_activation_bytes_after_forward'] / 2**20:.1f} MiB{peak}")
    print(f"identical loss and gradients: {identical}")
    print(f"per slice and token: {saved_per_token:.0f} saved bytes, {forward_flops / 1e6:.2f} MFLOP forward, "
          f"{backward_flops / 1e6:.2f} MFLOP backward; device {rate / 1e12:.2f} TFLOP/s")
    print(f"offload can beat recompute only over a link of more than {floor:.1f} GB/s each way")
    for name, gbps in links.items():
        found = crossovers[name]
        print(f"  {name} ({gbps:.0f} GB/s): offload beats recompute from "
              f"{found if found is not None else 'never (below 16M)'} tokens per slice")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
