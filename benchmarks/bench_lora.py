"""Bytes of LoRA on an offloaded frozen base, beside full fine-tuning of the same model.

Builds one randomly initialised Hugging Face Llama, wraps it in ``OffloadModel`` three ways (every
weight trainable; LoRA adapters from ``peft`` on a frozen float32 base; the same on a base loaded in
bfloat16), trains a few steps with
``OffloadOptimizer(AdamW)`` and records, per mode: what ``memory_footprint()`` reports, the host
bytes of gradients and optimizer state, and the bytes each step moves over the host-device link,
counted by the copy engine (``model._engine.traffic()``), loads and offloads apart, gradients and
boundary activations apart. Byte counts do not depend on the device, so the CPU gives the same
figures as a GPU would (where the host buffers are pinned); no time is measured.

Usage::

    python benchmarks/bench_lora.py --json benchmarks/results/lora_bytes.json
    python benchmarks/bench_lora.py --hidden 1024 --layers 16 --lora-r 16 --compute-dtype none
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from offload import OffloadModel, OffloadOptimizer
from json_output import check_json_path  # benchmarks/json_output.py, next to this file

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "none": None}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--lora-targets", nargs="+", default=["all-linear"])
    parser.add_argument("--num-slices", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=2, help="more than one: device gradient sums are used")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--compute-dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    sizes = ("hidden", "layers", "vocab", "lora_r", "num_slices", "microbatches", "batch_size", "seq_len",
             "steps")
    if any(getattr(args, name) < 1 for name in sizes):
        parser.error(f"{', '.join('--' + name.replace('_', '-') for name in sizes)} must be at least 1")
    heads, key_value_heads = attention_heads(args.hidden)
    if heads < 1:
        parser.error(f"--hidden {args.hidden}: the model has one attention head per 64 features; give 64 or more")
    if heads % key_value_heads:
        parser.error(f"--hidden {args.hidden}: its {heads} attention heads (one per 64 features) are not a multiple "
                     f"of its {key_value_heads} key-value heads (one per 256); give a multiple of 256, or less than 512")
    check_json_path(parser, args.json)
    return args


def attention_heads(hidden: int) -> tuple[int, int]:
    """The Llama's attention heads and key-value heads for ``hidden`` features: heads of 64, four
    query heads to a key-value head."""
    return hidden // 64, max(1, hidden // 256)


def build(args: argparse.Namespace) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    heads, key_value_heads = attention_heads(args.hidden)
    config = transformers.LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                                      num_hidden_layers=args.layers, num_attention_heads=heads,
                                      num_key_value_heads=key_value_heads, vocab_size=args.vocab,
                                      max_position_embeddings=max(args.seq_len, 64), tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config)
    model.config.use_cache = False
    return model


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


#: What each mode trains: every weight; LoRA adapters on a float32 base; LoRA adapters (float32, as
#: PEFT keeps them) on a base loaded in bfloat16.
MODES = {"full": (False, None), "lora": (True, None), "lora_bf16_base": (True, torch.bfloat16)}


def measure(args: argparse.Namespace, lora: bool, base_dtype: torch.dtype | None) -> dict:
    from offload.integrations.transformers import causal_lm_sequential

    hf = build(args)
    if base_dtype is not None:
        hf.to(base_dtype)
    if lora:
        import peft

        targets = args.lora_targets[0] if args.lora_targets == ["all-linear"] else args.lora_targets
        hf = peft.get_peft_model(hf, peft.LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r,
                                                     target_modules=targets))
    layers = causal_lm_sequential(hf, loss_chunk_tokens=1024)
    model = OffloadModel(layers, device="cpu", num_slices=args.num_slices, num_microbatches=args.microbatches,
                         compute_dtype=DTYPES[args.compute_dtype])
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-4, fused=True)
    engine = model._engine
    generator = torch.Generator().manual_seed(0)
    per_step = []
    for _ in range(args.steps):
        ids = torch.randint(0, args.vocab, (args.batch_size, args.seq_len), generator=generator)
        loaded, offloaded = engine.traffic()
        gradients_before = engine.gradients.offloaded_bytes
        loss = model({"input_ids": ids, "labels": ids}).sum() / layers.count_loss_tokens(ids)
        after_forward = engine.traffic()
        loss.backward()
        after_backward = engine.traffic()
        gradient_bytes = engine.gradients.offloaded_bytes - gradients_before
        per_step.append({
            "forward_loaded": after_forward[0] - loaded,
            "backward_loaded": after_backward[0] - after_forward[0],
            "offloaded_gradients": gradient_bytes,
            "offloaded_activations": after_backward[1] - offloaded - gradient_bytes,
            "host_gradients": nbytes(p.grad for p in model.parameters() if p.grad is not None),
        })
        optimizer.step()
        optimizer.zero_grad()
    optimizer.synchronize()
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    state = nbytes(v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    footprint = model.memory_footprint()
    return {
        "parameters": sum(p.numel() for p in params),
        "trainable_parameters": sum(p.numel() for p in trainable),
        "memory_footprint": {key: getattr(footprint, key) for key in
                             ("host_copies", "host_shadows", "host_pool", "device_slots", "device_gradients")},
        "optimizer_state": state,
        "host_gradients": per_step[-1]["host_gradients"],
        "per_step": per_step[-1],  # the last step: pools and shadows settled
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    results = {mode: measure(args, lora, base_dtype) for mode, (lora, base_dtype) in MODES.items()}
    base = results["full"]["parameters"]
    for mode, r in results.items():
        f = r["memory_footprint"]
        host = f["host_copies"] + f["host_shadows"] + r["host_gradients"] + r["optimizer_state"]
        r["host_bytes_per_base_parameter"] = host / base
        step = r["per_step"]
        link = step["forward_loaded"] + step["backward_loaded"] + step["offloaded_gradients"]
        r["link_bytes_per_step_per_base_parameter"] = link / base
        print(f"{mode:>14}: {r['trainable_parameters'] / 1e6:8.2f} M of {r['parameters'] / 1e6:.2f} M trainable | "
              f"host {host / 2**20:8.1f} MiB ({host / base:5.2f} B/param: copies {f['host_copies'] / 2**20:.1f}, "
              f"shadows {f['host_shadows'] / 2**20:.1f}, grads {r['host_gradients'] / 2**20:.1f}, "
              f"optimizer {r['optimizer_state'] / 2**20:.1f} MiB) | pool {f['host_pool'] / 2**20:.1f} MiB | "
              f"device grad sums {f['device_gradients'] / 2**20:.1f} MiB | per step: loads "
              f"{(step['forward_loaded'] + step['backward_loaded']) / 2**20:.1f} MiB, gradients back "
              f"{step['offloaded_gradients'] / 2**20:.2f} MiB, "
              f"activations {step['offloaded_activations'] / 2**20:.1f} MiB")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        record = {"settings": vars(args) | {"json": str(args.json)}, "results": results,
                  "torch": torch.__version__, "machine": platform.machine(),
                  "date": time.strftime("%Y-%m-%d", time.gmtime())}
        args.json.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
