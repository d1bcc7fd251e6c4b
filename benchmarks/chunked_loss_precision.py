"""How the output projection's weight gradient loses precision when the loss is taken in chunks
under a half-precision compute dtype.

The chunked loss (``causal_lm_sequential(hf, loss_chunk_tokens=N)``) projects the hidden states a
chunk at a time, so the weight gradient ``sum_t g_t x_t^T`` arrives as one partial product per
chunk, and autograd adds the partials in the weight's dtype. This script measures that error
against a float64 reference, for one product over all tokens (what the unchunked model computes)
and for chunks of several sizes, on random bfloat16 data shaped like a head's gradient.

Usage::

    python benchmarks/chunked_loss_precision.py --json benchmarks/results/chunked_loss_precision_cpu.json
"""

from __future__ import annotations

import argparse
import json

import torch
from json_output import check_json_path  # benchmarks/json_output.py, next to this file


def relative_errors(got: torch.Tensor, reference: torch.Tensor) -> dict[str, float]:
    difference = got.double() - reference
    return {"max": (difference.abs().max() / reference.abs().max()).item(),
            "norm": (difference.norm() / reference.norm()).item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--chunks", type=int, nargs="+", default=[4096, 1024, 256, 64], help="tokens per chunk")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    check_json_path(parser, args.json)
    if min(args.tokens, args.hidden, args.vocab, *args.chunks) < 1:
        parser.error("--tokens, --hidden, --vocab and each of --chunks must be at least 1")
    dtype = getattr(torch, args.dtype)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, generator=generator).to(dtype)
    grad_logits = (torch.randn(args.tokens, args.vocab, generator=generator) * 1e-3).to(dtype)
    reference = grad_logits.double().T @ hidden.double()
    rows = [{"tokens_per_chunk": args.tokens, "chunks": 1, **relative_errors(grad_logits.T @ hidden, reference)}]
    for size in args.chunks:
        total = None
        for start in range(0, args.tokens, size):
            part = grad_logits[start:start + size].T @ hidden[start:start + size]
            total = part if total is None else total + part  # as autograd accumulates: in the weight's dtype
        rows.append({"tokens_per_chunk": size, "chunks": -(-args.tokens // size), **relative_errors(total, reference)})
    print(f"weight gradient of a {args.vocab} x {args.hidden} head over {args.tokens} tokens, {args.dtype}, "
          "error relative to float64:")
    for row in rows:
        print(f"  {row['chunks']:4d} chunk(s) of {row['tokens_per_chunk']:5d} tokens: "
              f"max {row['max']:.2e}, norm {row['norm']:.2%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python benchmarks/chunked_loss_precision.py " + " ".join(
                f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                for k, v in vars(args).items() if k != "json"), "torch": torch.__version__, "rows": rows}, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
