"""A small training loop with OffloadModel: runs on CUDA when present, else on the CPU.

Usage::

    python scripts/demo.py [--steps 30] [--device cuda|cpu]
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from offload import OffloadModel, OffloadOptimizer
from offload.cli.device_argument import device_argument


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--steps", type=int, default=30, help="training steps")
    parser.add_argument("--device", type=device_argument, default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the layers compute (cuda when present)")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    found = "" if args.device.type != "cpu" or torch.cuda.is_available() else " (no CUDA device found)"
    print(f"device: {args.device}{found}")

    torch.manual_seed(0)
    # A regression task the model can learn: y = tanh(x @ w).
    teacher = torch.randn(32, 4)
    layers: list[nn.Module] = [nn.Linear(32, 256), nn.GELU()]
    for _ in range(6):
        layers += [nn.Linear(256, 256), nn.GELU(), nn.Dropout(0.05)]
    layers.append(nn.Linear(256, 4))
    model = OffloadModel(nn.Sequential(*layers), device=args.device, num_slices=4, num_microbatches=2)
    print(model)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=3e-3, fused=True)

    for step in range(1, args.steps + 1):
        x = torch.randn(128, 32)
        y = torch.tanh(x @ teacher / 4)
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x.to(args.device)), y.to(args.device))
        loss.backward()
        optimizer.step()
        if step == 1 or step % 5 == 0 or step == args.steps:
            print(f"step {step:3d}  loss {loss.item():.4f}")
    print("parameters live on:", {str(p.device) for p in model.parameters()})


if __name__ == "__main__":
    main()
