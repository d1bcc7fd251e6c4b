"""What a causal LM's boundary activations cost the thread that launches the forward, with the leaves
that pass through every slice unchanged (the rotary tables) offloaded once, against once at every
boundary (Note: [Leaves that pass through] in ``offload/autograd/records.py``).

A Hugging Face Llama with many thin layers, so that the per-slice work of the walk shows beside
the layers' own, is trained through ``OffloadedCausalLM`` with one slice per layer. Two variants
alternate in one process, so that machine noise hits both alike:

- ``shared``: as the library runs;
- ``every boundary``: each checkpoint offloads every leaf, as before.

Per variant: the median forward and backward time, the activation offloads and their bytes per
step, and the loads back. Both must give the same loss and gradients bit for bit.

Usage::

    python benchmarks/bench_boundaries.py [--layers 16] [--hidden 64] [--seq-len 64] [--batch 2] \\
        [--rounds 9] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from typing import Any

import torch

from offload.autograd import records
from offload.integrations.causal_lm import OffloadedCausalLM
from offload.streams.activations import ActivationOffloader
from json_output import check_json_path  # benchmarks/json_output.py, next to this file

SHARED = records.ForwardRecords._saved_leaf


def every_boundary(self: records.ForwardRecords, leaf: Any) -> records.SavedLeaf:
    """A checkpoint's leaf offloaded at every boundary, whether an earlier one offloaded it or not."""
    if not isinstance(leaf, torch.Tensor):
        return records.SavedLeaf(value=leaf)
    if leaf.device != self.engine.device:
        return records.SavedLeaf(stash=self._save(leaf))
    host, ticket = self.engine.activations.offload(leaf)
    return records.SavedLeaf(stash=self._save(host), ticket=ticket)


VARIANTS = {"shared": SHARED, "every boundary": every_boundary}


def thin_llama(args: argparse.Namespace) -> Any:
    """A Hugging Face Llama of ``args.layers`` layers of width ``args.hidden``, seeded alike each call."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                                      num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=256, max_position_embeddings=max(args.seq_len, 64))
    return transformers.LlamaForCausalLM(config)


def token_ids(args: argparse.Namespace) -> torch.Tensor:
    return torch.randint(0, 256, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(1))


def thin_llama_options(description: str, *, layers: int, seq_len: int, rounds: int) -> argparse.ArgumentParser:
    """The options of the benchmarks that alternate variants of :func:`thin_llama` in one process."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=seq_len)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=rounds, help="alternated rounds; each times one step a variant")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json")
    return parser


def build(args: argparse.Namespace, device: str) -> tuple[OffloadedCausalLM, torch.Tensor]:
    return OffloadedCausalLM(thin_llama(args), device=device, num_slices=args.layers + 2), token_ids(args)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def step(model: OffloadedCausalLM, ids: torch.Tensor, device: str) -> tuple[float, float, torch.Tensor]:
    """One forward and backward: their seconds and the loss."""
    sync(device)
    start = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    sync(device)
    middle = time.perf_counter()
    loss.backward()
    sync(device)
    return middle - start, time.perf_counter() - middle, loss.detach()


def main() -> None:
    parser = thin_llama_options(__doc__.split("\n\n")[0], layers=16, seq_len=64, rounds=9)
    args = parser.parse_args()
    check_json_path(parser, args.json)
    if args.rounds < 2:
        parser.error("--rounds: at least 2 (the first timed round is the counted one)")

    models = {name: build(args, args.device) for name in VARIANTS}
    counts: dict[str, dict[str, int]] = {name: {"offloads": 0, "offloaded_bytes": 0, "loads": 0} for name in VARIANTS}
    offload, load = ActivationOffloader.offload, ActivationOffloader.load
    current = {"name": ""}

    def counted_offload(self: ActivationOffloader, tensor: torch.Tensor) -> Any:
        counts[current["name"]]["offloads"] += 1
        counts[current["name"]]["offloaded_bytes"] += tensor.numel() * tensor.element_size()
        return offload(self, tensor)

    def counted_load(self: ActivationOffloader, ticket: Any, host: torch.Tensor) -> Any:
        counts[current["name"]]["loads"] += 1
        return load(self, ticket, host)

    times: dict[str, list[tuple[float, float]]] = {name: [] for name in VARIANTS}
    losses: dict[str, torch.Tensor] = {}
    for round_ in range(args.warmup + args.rounds):
        order = list(VARIANTS.items())
        for name, saved_leaf in order if round_ % 2 == 0 else order[::-1]:  # neither always first
            model, ids = models[name]
            records.ForwardRecords._saved_leaf = saved_leaf
            counting = round_ == args.warmup  # one step of each counted, outside the timed ones
            if counting:
                current["name"] = name
                ActivationOffloader.offload, ActivationOffloader.load = counted_offload, counted_load
            try:
                forward, backward, loss = step(model, ids, args.device)
            finally:
                records.ForwardRecords._saved_leaf = SHARED
                ActivationOffloader.offload, ActivationOffloader.load = offload, load
            if round_ == 0:
                losses[name] = loss
            if round_ >= args.warmup and not counting:
                times[name].append((forward, backward))

    grads = {name: [p.grad for p in models[name][0].parameters()] for name in VARIANTS}
    same = (torch.equal(losses["shared"], losses["every boundary"])
            and all(torch.equal(a, b) for a, b in zip(grads["shared"], grads["every boundary"])))
    results = {}
    for name in VARIANTS:
        forward = statistics.median(t[0] for t in times[name])
        backward = statistics.median(t[1] for t in times[name])
        results[name] = {"forward_ms": forward * 1e3, "backward_ms": backward * 1e3, **counts[name]}
    report = {"command": " ".join(["python", *sys.argv]), "date": datetime.date.today().isoformat(), "device": args.device, "machine": platform.processor() or
              platform.machine(), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "config": vars(args), "same_loss_and_gradients": same, "variants": results,
              "forward_ratio": results["shared"]["forward_ms"] / results["every boundary"]["forward_ms"]}
    print(f"{args.layers} layers of {args.hidden}, {args.batch} x {args.seq_len} tokens, {args.device}, medians of "
          f"{args.rounds - 1} alternated steps; same loss and gradients: {same}")
    print("| variant | forward ms | backward ms | offloads a step | offloaded bytes | loads a step |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        print(f"| {name} | {r['forward_ms']:.2f} | {r['backward_ms']:.2f} | {r['offloads']} | {r['offloaded_bytes']} "
              f"| {r['loads']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
