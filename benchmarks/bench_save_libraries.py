"""The host memory that saving a model with safetensors, ``torch.save`` and Accelerate adds, for a
plain ``nn.Sequential`` and the same layers under OffloadModel.

Each save runs in a child process of its own: it builds an MLP of ``--mib`` MiB of float32
parameters (``--layers`` square Linear layers), wraps it in ``OffloadModel`` (``--slices``) or
not, makes AdamW state for it where the save includes the optimizer, and saves into a temporary
directory. The peak host memory of the save is the kernel's high-water mark (``VmHWM``, reset
through ``/proc/self/clear_refs`` just before) above the resident memory before it; ``ratio`` is
that over the model's bytes. A save that copied the model would show a ratio of 1 or more.

Saves measured:

- ``safetensors``: ``safetensors.torch.save_file(model.state_dict(), path)``;
- ``torch_save``: ``torch.save(model.state_dict(), path)``;
- ``accelerate_save_model``: ``Accelerator.save_model`` of the prepared model;
- ``accelerate_save_state``: ``Accelerator.save_state`` (the model, AdamW's state and the RNG states);
- ``control_copy``: safetensors after cloning every tensor, which shows how a copy of the model
  reads here (a ratio near 1): the measurement can see one.

Usage::

    MALLOC_MMAP_THRESHOLD_=1048576 python benchmarks/bench_save_libraries.py --json /tmp/save_libraries.json

(the fixed mmap threshold returns each freed buffer to the kernel, so that the high-water mark
shows what a save held, not what the allocator kept).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from json_output import check_json_path  # benchmarks/json_output.py, next to this file

SAVES = ("safetensors", "torch_save", "accelerate_save_model", "accelerate_save_state", "control_copy")
ROOT = Path(__file__).resolve().parents[1]


def status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def measure(save: str, offloaded: bool, mib: int, layers: int, slices: int) -> dict[str, float]:
    """One save in this process: the model's bytes and the save's peak growth."""
    import tempfile

    import torch
    from torch import nn

    from offload import OffloadModel

    width = int((mib * 2**20 / 4 / layers) ** 0.5)
    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    nbytes = sum(p.nbytes for p in model.parameters())
    if offloaded:
        model = OffloadModel(model, device="cpu", num_slices=slices)
    with tempfile.TemporaryDirectory() as directory:
        if save.startswith("accelerate"):
            from accelerate import Accelerator

            accelerator = Accelerator(cpu=True)
            optimizer = torch.optim.AdamW(model.parameters())
            model, optimizer = accelerator.prepare(model, optimizer)
            if save == "accelerate_save_state":  # AdamW's state, as after a step
                for p in model.parameters():
                    p.grad = torch.zeros_like(p)
                optimizer.step()
                optimizer.zero_grad()
            run = {"accelerate_save_model": lambda: accelerator.save_model(model, directory),
                   "accelerate_save_state": lambda: accelerator.save_state(directory)}[save]
        elif save in ("safetensors", "control_copy"):
            import safetensors.torch

            def run() -> None:
                state = model.state_dict()
                if save == "control_copy":
                    state = {name: value.clone() for name, value in state.items()}
                safetensors.torch.save_file(state, f"{directory}/model.safetensors")
        else:
            def run() -> None:
                torch.save(model.state_dict(), f"{directory}/model.pt")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current resident set
        before = status("VmRSS:")
        run()
        growth = status("VmHWM:") - before
    return {"model_bytes": nbytes, "growth_bytes": growth, "ratio": growth / nbytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=96, help="MiB of float32 parameters")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--slices", type=int, default=3)
    parser.add_argument("--saves", nargs="+", choices=SAVES, default=list(SAVES))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", nargs=2, metavar=("SAVE", "MODEL"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    check_json_path(parser, args.json)
    if args.child:
        save, model = args.child
        print(json.dumps(measure(save, model == "offload", args.mib, args.layers, args.slices)))
        return
    results = []
    for save in args.saves:
        for model in ("plain", "offload"):
            command = [sys.executable, __file__, "--child", save, model, "--mib", str(args.mib),
                       "--layers", str(args.layers), "--slices", str(args.slices)]
            done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True)
            row = {"save": save, "model": model, **json.loads(done.stdout.splitlines()[-1])}
            results.append(row)
            print(f"{save:<24}{model:<9}model {row['model_bytes'] / 2**20:7.1f} MiB   "
                  f"save peak +{row['growth_bytes'] / 2**20:7.1f} MiB   ratio {row['ratio']:.3f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"mib": args.mib, "layers": args.layers, "slices": args.slices,
                                         "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
