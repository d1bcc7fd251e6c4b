"""The total norm of a Llama's float32 host gradients: PyTorch's ``get_total_norm`` (one thread a
tensor) against ``offload.clipping.total_grad_norm`` (the same norms on several threads, Note:
[Norms on several threads] in ``offload/clipping.py``), and the scaling after it; medians of
``--repeats``, with whether the two norms are the same bits.

    python benchmarks/bench_clipping.py --json benchmarks/results/clipping_cpu_<date>.json
    python benchmarks/bench_clipping.py --hidden 256 --layers 2 --vocab 1000 --repeats 2   # a quick look

The default shape is ``bench_peers.py``'s 0.886 B Llama (hidden 2048, 16 layers, intermediate 5632,
16 heads over 8 key/value heads, vocab 32000, untied): 3.54 GB of gradients, what its clipped runs
read on the GPU's host.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from offload.clipping import total_grad_norm  # noqa: E402
from json_output import check_json_path  # benchmarks/json_output.py, next to this file


def llama_gradients(hidden: int, layers: int, intermediate: int, vocab: int, kv_heads_ratio: int) -> list[torch.Tensor]:
    """A gradient per parameter of a Llama of this shape (untied head), in ``named_parameters`` order."""
    kv = hidden // kv_heads_ratio
    shapes = [(vocab, hidden)]
    for _ in range(layers):
        shapes += [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden),
                   (intermediate, hidden), (intermediate, hidden), (hidden, intermediate), (hidden,), (hidden,)]
    shapes += [(hidden,), (vocab, hidden)]
    generator = torch.Generator().manual_seed(0)
    return [torch.empty(shape).normal_(generator=generator) * 1e-3 for shape in shapes]


def median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--kv-ratio", type=int, default=2, help="attention heads per key/value head")
    parser.add_argument("--threads", type=int, default=None, help="the pool's threads (default: torch's)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    check_json_path(parser, args.json)

    grads = llama_gradients(args.hidden, args.layers, args.intermediate, args.vocab, args.kv_ratio)
    nbytes = sum(g.numel() * g.element_size() for g in grads)
    theirs = torch.nn.utils.get_total_norm(grads, 2.0)
    ours = total_grad_norm(grads, 2.0, num_threads=args.threads)
    torch_s = median_seconds(lambda: torch.nn.utils.get_total_norm(grads, 2.0), args.repeats)
    offload_s = median_seconds(lambda: total_grad_norm(grads, 2.0, num_threads=args.threads), args.repeats)
    largest = max(grads, key=torch.Tensor.numel)
    largest_s = median_seconds(lambda: torch.linalg.vector_norm(largest), args.repeats)
    # The scaling of a clip below one (PyTorch's foreach multiply): read and write every gradient.
    scale_s = median_seconds(lambda: torch._foreach_mul_(grads, torch.tensor(1.0 - 2.0**-20)), args.repeats)
    report = {
        "command": " ".join(sys.argv), "torch": torch.__version__, "intra_op_threads": torch.get_num_threads(),
        "pool_threads": args.threads or torch.get_num_threads(), "tensors": len(grads), "gradient_bytes": nbytes,
        "torch_norm_s": torch_s, "offload_norm_s": offload_s, "speedup": torch_s / offload_s,
        "torch_norm_bytes_per_s": nbytes / torch_s, "offload_norm_bytes_per_s": nbytes / offload_s,
        "largest_tensor_bytes": largest.numel() * largest.element_size(), "largest_tensor_norm_s": largest_s,
        "scale_s": scale_s, "same_bits": bool(torch.equal(theirs, ours)),
    }
    print(f"{len(grads)} gradients, {nbytes / 1e9:.2f} GB, {report['intra_op_threads']} threads: PyTorch's norm "
          f"{torch_s * 1e3:.1f} ms ({nbytes / torch_s / 1e9:.1f} GB/s), offload's {offload_s * 1e3:.1f} ms "
          f"({nbytes / offload_s / 1e9:.1f} GB/s, {report['speedup']:.2f}x); the largest tensor alone "
          f"{largest_s * 1e3:.1f} ms; scaling {scale_s * 1e3:.1f} ms; same bits: {report['same_bits']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
