"""Which layer of ``tests/test_layouts.py``'s layout-sensitive model gives other bits offloaded than
plain, for a strided and a channels_last input: each layer alone, plain against itself (the
device's own determinism) and against ``OffloadModel`` of that layer, forward and backward.

Usage::

    python benchmarks/diagnose_layouts.py [--device cuda]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from offload import OffloadModel  # noqa: E402
from tests.test_layouts import channels_last, layout_sensitive, strided  # noqa: E402


def run(net: nn.Module, x: torch.Tensor, prepare) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    x = x.clone().requires_grad_()
    y = net(prepare(x))
    y.backward(torch.ones_like(y))
    grads = [p.grad.detach().cpu().clone() for p in net.parameters()]
    for p in net.parameters():
        p.grad = None
    return y.detach().cpu(), x.grad.cpu(), grads


def differs(a, b) -> str:
    (ya, xa, ga), (yb, xb, gb) = a, b
    parts = [f"out {(ya - yb).abs().max().item():.1e}" if not torch.equal(ya, yb) else "",
             f"input grad {(xa - xb).abs().max().item():.1e}" if not torch.equal(xa, xb) else "",
             "param grads" if any(not torch.equal(p, q) for p, q in zip(ga, gb)) else ""]
    return ", ".join(p for p in parts if p) or "identical"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--deterministic", action="store_true", help="cuDNN's deterministic algorithms only")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.backends.cudnn.deterministic = args.deterministic
    layers = layout_sensitive()
    x0 = torch.randn(4, 6, 7, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).to(device)
    for prepare in (strided, channels_last):
        plain = copy.deepcopy(layers).to(device)
        first, second = run(plain, x0, prepare), run(copy.deepcopy(layers).to(device), x0, prepare)
        for num_slices in (1, 2):
            model = OffloadModel(copy.deepcopy(layers).to(device), device=device, num_slices=num_slices)
            print(f"== {prepare.__name__}, whole model, {num_slices} slices: plain vs plain {differs(first, second)}; "
                  f"offloaded vs plain {differs(run(model, x0, prepare), first)}")
        x = x0
        print(f"== {prepare.__name__}")
        for index, layer in enumerate(layers):
            plain = nn.Sequential(copy.deepcopy(layer)).to(device)
            with torch.no_grad():
                inputs = x.clone()
            first, second = run(plain, inputs, prepare), run(plain, inputs, prepare)
            model = OffloadModel(nn.Sequential(copy.deepcopy(layer)).to(device), device=device, num_slices=1)
            ours = run(model, inputs, prepare)
            print(f"{index} {type(layer).__name__}: plain vs plain {differs(first, second)}; "
                  f"offloaded vs plain {differs(ours, first)}")
            with torch.no_grad():
                x = plain(prepare(x))


if __name__ == "__main__":
    main()
