"""Host bytes of QLoRA on an offloaded base: LoRA adapters over an NF4 (bitsandbytes) frozen base.

Builds one randomly initialised Hugging Face Llama in bfloat16, replaces every linear layer but the
output head by a bitsandbytes ``Linear4bit`` holding the same weights in NF4 (double quantisation
on by default), adds LoRA adapters with ``peft``, wraps the model in ``OffloadModel``, trains a few
steps with ``OffloadOptimizer(AdamW)`` and records what ``memory_footprint()`` reports, the bytes of
the 4-bit layers (their codes and quantisation state, which lie in the slices' host buffers), the
bytes each step loads over the host-device link (counted by the copy engine) and the process's
resident set. Byte counts do not depend on the device, so the CPU gives the figures a GPU would;
no time is measured.

Two settings of ``OffloadModel``: no ``compute_dtype`` (the base computes in its bfloat16, the
4-bit layers in their ``bnb_4bit_compute_dtype``, the adapters in float32: no shadow), and
``compute_dtype=torch.bfloat16``, under which every slice with a float32 adapter gets a shadow of
the whole slice, 4-bit codes included.

``--bits 8`` builds bitsandbytes' 8-bit ``Linear8bitLt`` layers (LLM.int8(), ``load_in_8bit``)
instead: int8 codes and one float32 scale a row; its keys say ``eight_bit`` where they say
``four_bit`` for 4 bits.

Usage::

    python benchmarks/bench_qlora.py --json benchmarks/results/qlora_bytes_cpu.json
    python benchmarks/bench_qlora.py --hidden 2048 --layers 4 --no-double-quant
    python benchmarks/bench_qlora.py --bits 8 --json benchmarks/results/int8_bytes_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import time
import warnings
from pathlib import Path

import torch

from offload import OffloadModel, OffloadOptimizer
from json_output import check_json_path  # benchmarks/json_output.py, next to this file


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--bits", type=int, default=4, choices=[4, 8])
    parser.add_argument("--quant-type", default="nf4", choices=["nf4", "fp4"])
    parser.add_argument("--no-double-quant", action="store_true")
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--num-slices", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    check_json_path(parser, args.json)
    return args


def build(args: argparse.Namespace) -> torch.nn.Module:
    """The Llama in bfloat16 with its linear layers (not the head) in 4 or 8 bits, as users of the
    module classes build it."""
    import bitsandbytes as bnb
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                                      num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                                      num_key_value_heads=max(1, args.hidden // 256), vocab_size=args.vocab,
                                      max_position_embeddings=max(args.seq_len, 64), tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.config.use_cache = False
    double = not args.no_double_quant
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is not torch.nn.Linear or name == "lm_head":
                continue
            if args.bits == 8:
                layer = bnb.nn.Linear8bitLt(child.in_features, child.out_features, bias=child.bias is not None,
                                            has_fp16_weights=False)
                layer.load_state_dict(child.state_dict())
                setattr(module, name, layer.to("cpu"))  # quantized here
                continue
            layer = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                      compute_dtype=torch.bfloat16, compress_statistics=double,
                                      quant_type=args.quant_type)
            layer.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, compress_statistics=double,
                                             quant_type=args.quant_type, module=layer)
            setattr(module, name, layer.to("cpu"))  # quantized here
    return model


def four_bit_tensors(model: torch.nn.Module) -> tuple[int, list[torch.Tensor]]:
    """The parameters the 4-bit (or 8-bit) weights stand for, and their codes and state tensors."""
    import bitsandbytes as bnb

    parameters, tensors = 0, []
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear8bitLt):
            parameters += module.weight.numel()
            scales = module.weight.SCB if module.weight.SCB is not None else module.state.SCB
            tensors += [module.weight, scales]
        elif isinstance(module, bnb.nn.Linear4bit):
            state = module.weight.quant_state
            parameters += state.shape.numel()
            tensors += [module.weight, state.absmax, state.code]
            if state.nested:
                tensors += [state.offset, state.state2.absmax, state.state2.code]
    return parameters, tensors


def in_host_buffers(model: OffloadModel, tensors: list[torch.Tensor]) -> int:
    """The bytes of ``tensors`` that lie in the slices' host buffers."""
    flats = [(s.storage.flat.data_ptr(), s.storage.flat.numel()) for s in model._engine.slices]
    return sum(t.nbytes for t in tensors if any(start <= t.data_ptr() < start + size for start, size in flats))


def measure(args: argparse.Namespace, compute_dtype: torch.dtype | None) -> dict:
    import peft

    from offload.integrations.transformers import causal_lm_sequential

    import bitsandbytes  # noqa: F401  (its import is not the model's memory)
    rss_before = _rss()
    hf = peft.get_peft_model(build(args), peft.LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r,
                                                          target_modules="all-linear"))
    four_bit_parameters, four_bit = four_bit_tensors(hf)
    four_bit_stored = sum(t.nbytes for t in four_bit)
    layers = causal_lm_sequential(hf)
    model = OffloadModel(layers, device="cpu", num_slices=args.num_slices, compute_dtype=compute_dtype)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-4, fused=True)
    engine = model._engine
    generator = torch.Generator().manual_seed(0)
    for _ in range(args.steps):
        ids = torch.randint(0, args.vocab, (args.batch_size, args.seq_len), generator=generator)
        loaded, _ = engine.traffic()
        logits = model({"input_ids": ids})
        hf.get_base_model().loss_function(logits=logits, labels=ids, vocab_size=args.vocab).backward()
        step_loaded = engine.traffic()[0] - loaded
        optimizer.step()
        optimizer.zero_grad()
    optimizer.synchronize()
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    footprint = model.memory_footprint()
    frozen = [p for p in params if p.dtype not in (torch.uint8, torch.int8) and not p.requires_grad]  # not quantized
    base_parameters = four_bit_parameters + sum(p.numel() for p in frozen)
    host = footprint.host_copies + footprint.host_shadows
    kind = "four_bit" if args.bits == 4 else "eight_bit"
    return {
        "base_parameters": base_parameters,
        f"{kind}_parameters": four_bit_parameters,
        "trainable_parameters": sum(p.numel() for p in trainable),
        f"{kind}_bytes": four_bit_stored,
        f"{kind}_bytes_per_parameter": four_bit_stored / four_bit_parameters,
        f"{kind}_bytes_in_host_buffers": in_host_buffers(model, four_bit),
        "memory_footprint": {key: getattr(footprint, key) for key in
                             ("host_copies", "host_shadows", "host_optimizer_state", "host_pool", "device_slots")},
        # Adapters (float32) included: what the slices' host buffers and shadows hold, per base parameter.
        "host_copies_and_shadows_per_base_parameter": host / base_parameters,
        "loaded_per_step": step_loaded,
        # The peak: building the model in bfloat16 before quantizing it dominates.
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        # Now, after training: the libraries' own memory and what the allocator kept are in it too.
        "rss_bytes": _rss(),
        "rss_before_bytes": rss_before,
    }


def _rss() -> int | None:
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()
    except OSError:  # not Linux
        return None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", message=".*kernels.*")
    results = {}
    for mode, dtype in (("no_compute_dtype", None), ("compute_dtype_bf16", torch.bfloat16)):
        r = results[mode] = measure(args, dtype)
        f = r["memory_footprint"]
        kind = "four_bit" if args.bits == 4 else "eight_bit"
        print(f"{mode:>19}: {args.bits}-bit layers {r[f'{kind}_parameters'] / 1e6:.1f} M params in "
              f"{r[f'{kind}_bytes'] / 2**20:.1f} MiB ({r[f'{kind}_bytes_per_parameter']:.4f} B/param) | base "
              f"{r['base_parameters'] / 1e6:.1f} M params | host copies {f['host_copies'] / 2**20:.1f} MiB, shadows "
              f"{f['host_shadows'] / 2**20:.1f} MiB ({r['host_copies_and_shadows_per_base_parameter']:.3f} B/param, "
              f"adapters included) | adapters {r['trainable_parameters'] / 1e6:.2f} M, AdamW "
              f"{f['host_optimizer_state'] / 2**20:.1f} MiB | loads {r['loaded_per_step'] / 2**20:.1f} MiB "
              f"a step | RSS {(r['rss_bytes'] - r['rss_before_bytes']) / 2**20:.1f} MiB more than before building "
              f"the model, at most {r['max_rss_bytes'] / 2**30:.2f} GiB")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        record = {"settings": vars(args) | {"json": str(args.json)}, "results": results,
                  "torch": torch.__version__, "machine": platform.machine(),
                  "date": time.strftime("%Y-%m-%d", time.gmtime())}
        args.json.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
