"""The commands over a 4-bit base (QLoRA): ``offload plan --quantize`` counts what a real 4-bit
model holds, and ``offload-finetune --load-in-4bit`` trains its adapters and saves them as PEFT
does. Note: [Quantized weights] in ``offload/streams/quantized.py``; the library's own QLoRA
tests are ``tests/test_qlora.py``."""

from __future__ import annotations

import json
import sys
import warnings

import pytest
import torch

from offload import OffloadModel, OffloadOptimizer, estimate_memory
from offload.cli.main import main as offload_main
from offload.cli.plan import parse_args, run_plan

from .test_plan_cli import TINY_LLAMA, plan_error

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
with warnings.catch_warnings():  # its optional CPU kernels ("pip install kernels") are not needed
    warnings.simplefilter("ignore")
    bnb = pytest.importorskip("bitsandbytes")
from offload.cli.quantize import four_bit_counts, quantize_linears  # noqa: E402
from offload.integrations.transformers import causal_lm_sequential  # noqa: E402

#: Widths that are multiples of bitsandbytes' block (64) and one that is not (96 x 160 = 240 blocks).
SMALL_LLAMA = TINY_LLAMA | {"hidden_size": 96, "intermediate_size": 160, "num_attention_heads": 4,
                            "num_key_value_heads": 2, "vocab_size": 300}
LORA_R = 4


def real_qlora(config: dict, quant_type: str = "nf4", double: bool = True, dtype: torch.dtype = torch.bfloat16):
    """``config``'s random Llama quantised on the CPU with LoRA adapters on every linear layer, as the
    planner builds it on the meta device (``offload/cli/plan_models.py``)."""
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config), dtype=dtype)
    quantize_linears(hf, quant_type=quant_type, double_quant=double, compute_dtype=dtype, device="cpu")
    return peft.get_peft_model(hf, peft.LoraConfig(r=LORA_R, target_modules="all-linear", task_type="CAUSAL_LM"))


@pytest.mark.parametrize(("quant_type", "double"), [("nf4", True), ("fp4", False)])
def test_the_meta_quantisation_has_the_real_ones_tensors(quant_type, double):
    # The planner never quantises a weight: the codes and state it counts must be those a real
    # quantisation makes, widths that are not a multiple of the block included.
    shapes = []
    for device in ("cpu", "meta"):
        with torch.device(device):
            hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**SMALL_LLAMA))
        quantize_linears(hf, quant_type=quant_type, double_quant=double, compute_dtype=torch.float32, device=device)
        weights = [m.weight for m in hf.modules() if isinstance(m, bnb.nn.Linear4bit)]
        assert len(weights) == 7 * SMALL_LLAMA["num_hidden_layers"] and type(hf.lm_head) is torch.nn.Linear
        state = [(w.quant_state.absmax, w.quant_state.code, w.quant_state.offset,
                  *((w.quant_state.state2.absmax, w.quant_state.state2.code) if double else ())) for w in weights]
        shapes.append([(t.shape, t.dtype) for w, s in zip(weights, state) for t in (w, *s) if t is not None])
        assert all(w.device.type == device and not w.requires_grad for w in weights)
    assert shapes[0] == shapes[1]


def planned(*flags: str) -> tuple:
    plan, work, _, _ = run_plan(parse_args(["--hf-config", json.dumps(SMALL_LLAMA), "--gpu", "a100",
                                            "--host-memory", "8", *flags]))
    return plan, work


def test_plan_counts_the_4bit_base_as_estimate_memory_and_the_footprint_do():
    fixed = ("--batch-size", "2", "--seq-len", "16", "--num-slices", "3", "--microbatches", "1",
             "--resident-slices", "0", "--schedule", "overlapped")
    plan, work = planned("--lora-r", str(LORA_R), "--quantize", "nf4", "--compute-dtype", "bf16", *fixed)
    chosen = plan.chosen
    assert chosen.config.compute_dtype is None  # the base computes in its own bfloat16
    # The same model, quantised for real: its 4-bit weights, and the estimate of its cut model, are
    # the plan's.
    peft_model = real_qlora(SMALL_LLAMA)
    assert work.four_bit.dtype == torch.bfloat16
    assert (work.four_bit.parameters, work.four_bit.nbytes) == four_bit_counts(peft_model)
    sequential = causal_lm_sequential(peft_model, loss_chunk_tokens=1024)
    estimate = estimate_memory(sequential, num_slices=3, optimizer="adamw", device="cuda",
                               profile=work.profile(None))
    assert chosen.memory == estimate
    # And what training it holds: the host copies (codes, state, bfloat16 rest, float32 adapters),
    # their gradients and AdamW state, measured after two steps.
    model = OffloadModel(sequential, device="cpu", num_slices=3)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-3, fused=True)
    ids = torch.randint(0, SMALL_LLAMA["vocab_size"], (2, 16))
    for _ in range(2):
        model({"input_ids": ids, "labels": ids}).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    optimizer.synchronize()
    measured = model.memory_footprint()
    for category in ("masters", "shadows", "gradients", "optimizer_state"):
        assert chosen.memory.host_categories()[category] == measured.host_categories()[category], category
    assert chosen.memory.device_slots == measured.device_slots
    # The rest (the pool: pinned and rounded on a GPU) within a few percent of the whole.
    planned_host = chosen.memory.host_total - chosen.memory.host_activations
    assert abs(planned_host - measured.host_total) <= 0.03 * measured.host_total
    assert work.parameters == sum(p.quant_state.shape.numel() if isinstance(p, bnb.nn.Params4bit) else p.numel()
                                  for p in peft_model.parameters())


def test_the_4bit_plan_holds_fewer_bytes_and_prints_its_calls_and_fine_tune_command(capsys):
    flags = ("--lora-r", str(LORA_R), "--batch-size", "2", "--seq-len", "16", "--num-slices", "3",
             "--resident-slices", "0", "--compute-dtype", "bf16")
    four_bit, _ = planned(*flags, "--quantize", "nf4")
    full, _ = planned(*flags)
    # The linear layers' bytes on the host: about an eighth of float32's (the plan without
    # --quantize keeps the base in float32); the embeddings and head are the same in both.
    assert four_bit.chosen.memory.host_masters < 0.6 * full.chosen.memory.host_masters
    offload_main(["plan", "--hf-config", json.dumps(SMALL_LLAMA), "--gpu", "a100", "--host-memory", "8", *flags,
                  "--quantize", "fp4", "--no-bnb-4bit-use-double-quant"])
    out = capsys.readouterr().out
    assert "4-bit base: " in out and "in fp4 without double quantisation" in out and "the rest in bfloat16" in out
    assert 'BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_use_double_quant=False' in out
    assert "compute_dtype=" not in out.split("model = OffloadModel(")[1]
    command = next(line for line in out.splitlines() if line.startswith("offload-finetune "))
    assert ("--lora-r 4 --load-in-4bit --bnb-4bit-quant-type fp4 --no-bnb-4bit-use-double-quant" in command
            and "--compute-dtype bf16" in command)


@pytest.mark.parametrize(("flags", "fragment"), [
    (["--quantize", "int3", "--lora-r", "4"], "argument --quantize: invalid choice: 'int3'"),
    (["--quantize", "nf4"], "--quantize nf4 freezes the base in 4 bits, which has no gradient: train LoRA "
                            "adapters over it with --lora-r R"),
], ids=["unknown kind", "without lora"])
def test_plan_refuses_a_bad_quantisation_in_one_line(flags, fragment, capsys):
    assert fragment in plan_error(capsys, "--hf-config", json.dumps(TINY_LLAMA), "--gpu", "a100", *flags)


def test_plan_without_bitsandbytes_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as if not installed: importing it fails
    line = plan_error(capsys, "--hf-config", json.dumps(TINY_LLAMA), "--gpu", "a100", "--lora-r", "4",
                      "--quantize", "nf4")
    assert line.endswith('--quantize nf4 needs bitsandbytes: pip install "offload[bnb]"'), line
