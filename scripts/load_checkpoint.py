"""Load a Hugging Face causal LM folder into an ``OffloadModel`` and report how long it took and
how much memory it needed.

``--method slices`` (the default) uses ``load_causal_lm``: the model is built on the meta device
and the checkpoint is read tensor by tensor into the host copies (Note: [Loading slice by slice]
in ``offload/loading/sequential.py``). ``--method from_pretrained`` is the ordinary way, for comparison:
``from_pretrained``, then ``causal_lm_sequential`` and ``OffloadModel``.

Peak memory is the process's peak resident set (``ru_maxrss``) minus its resident set just before
loading (after imports), so it counts what loading adds, page-cache pages excluded.

Usage::

    python scripts/load_checkpoint.py PATH [--method slices|from_pretrained] [--device cpu]
        [--num-slices 8] [--dtype fp32|bf16|auto] [--compute-dtype none|bf16|fp16] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import torch

from offload.cli.device_argument import device_argument

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "none": None}


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", type=Path, help="a save_pretrained folder with safetensors weights")
    parser.add_argument("--method", choices=["slices", "from_pretrained"], default="slices",
                        help="slices: load_causal_lm, tensor by tensor; from_pretrained: the ordinary way, for "
                             "comparison (default: slices)")
    parser.add_argument("--device", type=device_argument, help="OffloadModel's device (default: cuda when present, else cpu)")
    parser.add_argument("--num-slices", type=int, default=8, help="OffloadModel num_slices (default: 8)")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "auto"], default="fp32",
                        help="dtype of the host copies; auto: the checkpoint's (default: fp32)")
    parser.add_argument("--compute-dtype", choices=["none", "bf16", "fp16"], default="none",
                        help="OffloadModel compute_dtype; none: the host copies' dtype (default: none)")
    parser.add_argument("--json", type=Path, help="write the figures here as well (default: printed only)")
    args = parser.parse_args(argv)
    args.path = args.path.expanduser()
    if args.num_slices < 1:
        parser.error(f"--num-slices must be at least 1, got {args.num_slices}")
    args.device = args.device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # Refused before minutes of loading: a missing folder would be looked up on the Hub, and an
    # output file that cannot be written would be found only after the load.
    if not args.path.is_dir():
        parser.error(f"{args.path}: {'not a directory' if args.path.exists() else 'no such directory'} (a "
                     "save_pretrained folder is expected)")
    if (args.path / "offload.json").is_file():
        parser.error(f"{args.path} is a checkpoint of save_checkpoint(), not a save_pretrained folder: it loads with "
                     "offload.load_checkpoint(path, model, optimizer) into a model built as its run built it")
    if args.json is not None:
        args.json = args.json.expanduser()
        if not args.json.parent.is_dir() or args.json.is_dir():
            problem = "is a directory" if args.json.is_dir() else "its directory does not exist"
            parser.error(f"--json {args.json}: {problem}")
    if not (args.path / "config.json").is_file():
        parser.error(f"{args.path}: no config.json (a save_pretrained folder is expected)")
    weights = [*args.path.glob("*.safetensors"), *args.path.glob("*.safetensors.index.json")]
    if args.method == "from_pretrained":
        weights += args.path.glob("pytorch_model*.bin")
    if not weights:
        parser.error(f"{args.path}: a config.json but no weights (model.safetensors"
                     f"{', pytorch_model.bin' if args.method == 'from_pretrained' else ''})")

    import transformers

    from offload import OffloadModel
    from offload.integrations.transformers import causal_lm_sequential, load_causal_lm

    dtype = "auto" if args.dtype == "auto" else DTYPES[args.dtype]
    options = {"num_slices": args.num_slices, "compute_dtype": DTYPES[args.compute_dtype]}
    before = resident_bytes()
    start = time.perf_counter()
    if args.method == "slices":
        model, hf = load_causal_lm(args.path, args.device, dtype=dtype, **options)
    else:
        hf = transformers.AutoModelForCausalLM.from_pretrained(args.path, dtype=dtype)
        model = OffloadModel(causal_lm_sequential(hf), args.device, **options)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    footprint = model.memory_footprint()
    result = {
        "method": args.method,
        "parameters": sum(p.numel() for p in model.parameters()),
        "seconds": round(seconds, 2),
        "peak_rss_growth_bytes": peak - before,
        "rss_growth_after_bytes": resident_bytes() - before,
        "host_copies_bytes": footprint.host_copies,
        "host_shadows_bytes": footprint.host_shadows,
        "device": str(args.device),
        "num_slices": model.num_slices,
        "dtype": args.dtype,
        "compute_dtype": args.compute_dtype,
    }
    gib = 2**30
    print(f"{args.method}: {result['parameters'] / 1e6:.1f} M parameters in {seconds:.1f} s; peak RSS growth "
          f"{result['peak_rss_growth_bytes'] / gib:.2f} GiB, host copies {footprint.host_copies / gib:.2f} GiB")
    print(json.dumps(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
