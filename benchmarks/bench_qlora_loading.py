"""A bfloat16 checkpoint loaded into an NF4 offloaded base: peak resident memory against the
quantised bytes (Note: [Quantizing while loading] in ``offload/loading/four_bit.py``).

Writes a randomly initialised Llama checkpoint in bfloat16 (safetensors shards, ``config.json``
and index, as ``save_pretrained`` lays them out) one shard at a time, reads the files once so
they are in the page cache, then loads it in a fresh process per method and reports the growth of
the peak resident set over the process after its imports (``/proc/self/clear_refs`` resets the
peak first):

- ``load_causal_lm``: ``load_causal_lm(dir, "cpu", dtype=torch.bfloat16, num_slices=N,
  quantization_config=BitsAndBytesConfig(load_in_4bit=True, nf4, double quantisation, bf16))``;
- ``from_pretrained``: ``from_pretrained(dir, quantization_config=..., dtype=torch.bfloat16,
  device_map="cpu")``, for comparison (``--skip-from-pretrained`` leaves it out).

With ``--lora-r R`` each method goes on as ``offload-finetune --load-in-4bit --lora-r R`` does:
LoRA adapters of rank R on every linear layer (``peft.get_peft_model``), an ``OffloadModel``
(``load_causal_lm``'s own, laid out again with the adapters; ``from_pretrained``'s built around the
PEFT model), and one forward and backward of a 2 x 16-token batch, so the peak counts the
adapters, the second layout and a step's activations. ``--forward-only`` runs a forward without
gradients instead, with or without ``--lora-r`` (without it, ``from_pretrained``'s model is
wrapped as it is): the two side by side give what the adapters and the second layout add.

The target (issue 42): the peak within 1.2 x the quantised model's bytes (its host copies: codes,
state and the bfloat16 rest) + one slice in bfloat16.

Usage::

    python benchmarks/bench_qlora_loading.py --dir /tmp/qlora_load --json benchmarks/results/qlora_loading_cpu_DATE.json
        [--layers 8] [--hidden 2048] [--intermediate 5632] [--vocab 32000] [--num-slices 8]
        [--lora-r R] [--forward-only]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch
from json_output import check_json_path  # benchmarks/json_output.py, next to this file

ROOT = Path(__file__).resolve().parents[1]
SHARD_BYTES = 512 * 2**20


def write_checkpoint(path: Path, args: argparse.Namespace) -> dict:
    import transformers
    from safetensors.torch import save_file

    config = transformers.LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 128), num_key_value_heads=max(1, args.hidden // 512),
        vocab_size=args.vocab, tie_word_embeddings=False, dtype="bfloat16")
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in transformers.AutoModelForCausalLM.from_config(config).state_dict().items()}
    path.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    groups: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        if groups[-1] and size + shape.numel() * 2 > SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += shape.numel() * 2
    weight_map = {}
    for index, group in enumerate(groups):
        file = f"model-{index + 1:05d}-of-{len(groups):05d}.safetensors"
        # Norm weights start at one, matrices small and random, as an initialised model.
        shard = {name: (torch.ones(shapes[name]) if len(shapes[name]) == 1
                        else torch.randn(shapes[name], generator=generator) * 0.02).to(torch.bfloat16)
                 for name in group}
        weight_map |= dict.fromkeys(group, file)
        save_file(shard, str(path / file), metadata={"format": "pt"})
        del shard
    total = sum(s.numel() * 2 for s in shapes.values())
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    config.save_pretrained(path)
    for file in sorted(path.glob("*.safetensors")):  # into the page cache: the figures are the loader's
        with open(file, "rb", buffering=0) as handle:
            while handle.read(64 * 2**20):
                pass
    return {"parameters": sum(s.numel() for s in shapes.values()), "bf16_bytes": total, "shards": len(groups),
            "config": {"layers": args.layers, "hidden": args.hidden, "intermediate": args.intermediate,
                       "vocab": args.vocab}}


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def with_lora(hf, rank: int):
    import peft

    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules="all-linear",
                             task_type="CAUSAL_LM")
    return peft.get_peft_model(hf, config)


def child(method: str, path: Path, num_slices: int, lora_r: int = 0, forward_only: bool = False) -> dict:
    """Load in this process; the peak resident growth and what the loaded model holds."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import bitsandbytes  # noqa: F401
        import transformers

        from offload.integrations.transformers import load_causal_lm
        from offload.loading.four_bit import unquantized_shape
        from offload.streams.quantized import is_4bit_weight, state_tensors
    transformers.utils.logging.disable_progress_bar()
    config = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                             bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16)
    Path("/proc/self/clear_refs").write_text("5")  # the peak from here on
    before = _status_kib("VmRSS")
    start = time.perf_counter()
    if method == "load_causal_lm":
        model, hf = load_causal_lm(path, "cpu", dtype=torch.bfloat16, quantization_config=config,
                                   num_slices=num_slices)
    else:
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=config,
                                                               dtype=torch.bfloat16, device_map="cpu")
    if lora_r or forward_only:
        from offload import OffloadModel
        from offload.integrations.transformers import causal_lm_sequential

        trained = with_lora(hf, lora_r) if lora_r else hf
        if method != "load_causal_lm":
            model = OffloadModel(causal_lm_sequential(trained), device="cpu", num_slices=num_slices)
        batch = torch.randint(0, hf.config.vocab_size, (2, 16))
        if forward_only:
            with torch.no_grad():
                model({"input_ids": batch})
        else:
            model({"input_ids": batch}).float().sum().backward()
    seconds = time.perf_counter() - start
    peak, after = _status_kib("VmHWM"), _status_kib("VmRSS")

    def nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    params = list(dict(hf.named_parameters()).items())
    quantised = sum(nbytes(p) + sum(nbytes(t) for _, t in state_tensors(p, k)) for k, p in params)
    result = {"seconds": round(seconds, 2), "peak_rss_growth": (peak - before) * 1024,
              "rss_growth_after": (after - before) * 1024, "quantised_bytes": quantised,
              "four_bit_parameters": sum(p.quant_state.shape.numel() for _, p in params if is_4bit_weight(p))}
    if lora_r:
        result["trainable_parameters"] = sum(p.numel() for p in hf.parameters() if p.requires_grad)
    if method == "load_causal_lm":
        slices = [sum(unquantized_shape(p).numel() * 2 for n, p in model._modules[name].named_parameters()
                      if "lora_" not in n)  # the base's, not the adapters'
                  for names in model.partition for name in names]
        result["largest_slice_bf16_bytes"] = max(slices)
        result["memory_footprint_host_copies"] = model.memory_footprint().host_copies
    return result


def run_child(method: str, args: argparse.Namespace) -> dict:
    done = subprocess.run([sys.executable, __file__, "--child", method, "--dir", str(args.dir),
                           "--num-slices", str(args.num_slices), "--lora-r", str(args.lora_r),
                           *(["--forward-only"] if args.forward_only else [])],
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if done.returncode != 0:
        raise SystemExit(f"{method} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, required=True, help="where the checkpoint is written")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--num-slices", type=int, default=8)
    parser.add_argument("--skip-from-pretrained", action="store_true")
    parser.add_argument("--lora-r", type=int, default=0, help="go on as offload-finetune --lora-r R does")
    parser.add_argument("--forward-only", action="store_true",
                        help="after loading (and --lora-r's adapters), a forward without gradients, not a step")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    check_json_path(parser, args.json)
    if args.child:
        print(json.dumps(child(args.child, args.dir, args.num_slices, args.lora_r, args.forward_only)))
        return
    checkpoint = write_checkpoint(args.dir, args)
    results = {}
    for method in ("load_causal_lm", *(() if args.skip_from_pretrained else ("from_pretrained",))):
        result = results[method] = run_child(method, args) | {"bf16_bytes": checkpoint["bf16_bytes"]}
        if "largest_slice_bf16_bytes" in result:
            bound = 1.2 * result["quantised_bytes"] + result["largest_slice_bf16_bytes"]
            result["target_bytes"] = int(bound)
            result["peak_over_target"] = round(result["peak_rss_growth"] / bound, 3)
        print(method, json.dumps(result))
    record = {"benchmark": "bench_qlora_loading", "date": datetime.date.today().isoformat(),
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
              "command": " ".join([Path(sys.executable).name, *sys.argv]), "checkpoint": checkpoint,
              "num_slices": args.num_slices, "lora_r": args.lora_r, "forward_only": args.forward_only,
              "results": results}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
