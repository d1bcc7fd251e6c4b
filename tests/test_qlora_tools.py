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
def test_the_meta_quantisation_has_the_real_ones_tensors(quant_type, double, monkeypatch):
    # The planner never quantises a weight: the codes and state it counts must be those a real
    # quantisation makes, widths that are not a multiple of the block included. Meta first, with
    # bitsandbytes' code tables not cached yet: a real quantisation still works after it.
    monkeypatch.setattr(bnb.functional, "name2qmap", {})
    shapes = []
    for device in ("meta", "cpu"):
        with torch.device(device):
            hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**SMALL_LLAMA))
        quantize_linears(hf, quant_type=quant_type, double_quant=double, compute_dtype=torch.float32, device=device)
        weights = [m.weight for m in hf.modules() if isinstance(m, bnb.nn.Linear4bit)]
        assert len(weights) == 7 * SMALL_LLAMA["num_hidden_layers"] and type(hf.lm_head) is torch.nn.Linear
        state = [(w.quant_state.absmax, w.quant_state.code, w.quant_state.offset,
                  *((w.quant_state.state2.absmax, w.quant_state.state2.code) if double else ())) for w in weights]
        shapes.append([(t.shape, t.dtype) for w, s in zip(weights, state) for t in (w, *s) if t is not None])
        assert all(w.device.type == device and not w.requires_grad for w in weights)
    assert shapes[1] == shapes[0]


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


def test_when_nothing_fits_it_tries_a_4bit_base_under_the_adapters(capsys):
    from offload.planning.choose import least_needs

    from .test_plan_cli import _plan_json

    bigger = json.dumps(SMALL_LLAMA | {"hidden_size": 256, "intermediate_size": 1024, "vocab_size": 1024})
    args = ("--hf-config", bigger, "--gpu", "a100", "--resident-slices", "0", "--seq-len", "64", "--batch-size", "2",
            "--lora-r", "4", "--host-memory", "0.001")
    found = {a["flags"]: a for a in _plan_json(capsys, *args)["alternatives"]}
    plan, _, _, limits = run_plan(parse_args([*args, "--quantize", "nf4"]))
    needs = least_needs(plan.candidates, limits)
    assert (found["--quantize nf4"]["fits"], found["--quantize nf4"]["host_memory"]) == (False, needs.host_memory)
    without = next(a for flags, a in found.items() if flags.startswith("--host-memory "))
    assert needs.host_memory < 0.8 * without["host_memory"]


@pytest.mark.parametrize(("flags", "fragment"), [
    (["--quantize", "int3", "--lora-r", "4"], "argument --quantize: invalid choice: 'int3'"),
    (["--quantize", "nf4"], "--quantize nf4 freezes the base in 4 bits, which has no gradient: train LoRA "
                            "adapters over it with --lora-r R"),
], ids=["unknown kind", "without lora"])
def test_plan_refuses_a_bad_quantisation_in_one_line(flags, fragment, capsys):
    assert fragment in plan_error(capsys, "--hf-config", json.dumps(TINY_LLAMA), "--gpu", "a100", *flags)


GPT2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 256, "bos_token_id": 0,
        "eos_token_id": 0}
NO_LINEAR = "GPT2LMHeadModel has no nn.Linear layer but its head to quantise in 4 bits (GPT-2's are Conv1D)"


def test_a_family_without_linear_layers_is_refused_rather_than_left_unquantised(tmp_path, capsys):
    from .test_finetune import run_cli

    assert NO_LINEAR in plan_error(capsys, "--hf-config", json.dumps(GPT2), "--gpu", "a100", "--lora-r", "4",
                                   "--quantize", "nf4")
    code, out, err = run_cli("--out", str(tmp_path / "out"), "--arch", "gpt2", "--lora-r", "2", "--load-in-4bit",
                             tmp_path=tmp_path, capsys=capsys)
    assert code == 1 and f"offload-finetune: error: --load-in-4bit: {NO_LINEAR}" in err, err


def test_plan_without_bitsandbytes_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as if not installed: importing it fails
    line = plan_error(capsys, "--hf-config", json.dumps(TINY_LLAMA), "--gpu", "a100", "--lora-r", "4",
                      "--quantize", "nf4")
    assert line.endswith('--quantize nf4 needs bitsandbytes: pip install "offload[bnb]"'), line


# -- offload-finetune --load-in-4bit ------------------------------------------------------------------


def adapters(model) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in model.named_parameters() if "lora_" in n}


def test_finetune_trains_the_adapters_of_a_4bit_base_as_the_unwrapped_model_does(tmp_path, capsys):
    from offload.cli import finetune as cli
    from offload.cli.finetune_args import parse_args as finetune_args
    from offload.cli.models import four_bit_settings, quantized_random_model, random_model

    from .test_finetune import EXACT, run_cli

    args = ["--out", str(tmp_path / "adapter"), "--steps", "2", "--batch-size", "2", "--seq-len", "16",
            "--compute-dtype", "none", "--loss-chunk-tokens", "0", "--lora-r", "2", "--load-in-4bit"]
    code, out, err = run_cli(*args, tmp_path=tmp_path, capsys=capsys)
    assert code == 0, err
    assert "nf4 4-bit base" in out and len([line for line in out.splitlines() if line.startswith("step ")]) == 2
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    assert not (tmp_path / "adapter" / "model.safetensors").exists()  # the adapter only, not the base

    def base():
        torch.manual_seed(0)
        hf, tokenizer = random_model("llama", "tiny", 256, 16)
        return quantized_random_model(hf, four_bit_settings(namespace, None)), tokenizer

    # The same QLoRA model trained unwrapped on the same batches, with PyTorch, peft and transformers alone.
    namespace = finetune_args([*args, "--device", "cpu"])
    hf, tokenizer = base()
    reference = peft.get_peft_model(hf, peft.LoraConfig(r=2, lora_alpha=4, target_modules="all-linear",
                                                        task_type="CAUSAL_LM"))
    hf.config.use_cache = False
    optimizer = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.0,
                                  fused=True)
    batches = cli.Batches(namespace, tokenizer).train()
    for _ in range(2):
        ids = next(batches)
        logits = reference(input_ids=ids).logits
        hf.loss_function(logits=logits, labels=ids, vocab_size=256, num_items_in_batch=ids[:, 1:].numel()).backward()
        optimizer.step()
        optimizer.zero_grad()
    # Saved as PEFT saves an adapter, loaded back on the unwrapped 4-bit base: the same adapters, bit for bit.
    loaded = peft.PeftModel.from_pretrained(base()[0], tmp_path / "adapter")
    assert sum(isinstance(m, bnb.nn.Linear4bit) for m in loaded.modules()) == 7 * 4
    got, want = adapters(loaded), adapters(reference)
    assert len(got) == 2 * 7 * 4 and all(want[n].abs().sum() > 0 for n in want if "lora_B" in n)
    torch.testing.assert_close(got, want, **EXACT)


def test_finetune_loads_a_checkpoint_in_4bits_and_its_adapters_load_back(tmp_path, capsys):
    from offload.cli.models import random_model
    from offload.cli.quantize import bnb_config

    from .test_finetune import run_cli

    torch.manual_seed(0)
    hf, tokenizer = random_model("llama", "tiny", 256, 16)
    hf.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    code, out, err = run_cli("--model", str(tmp_path / "base"), "--out", str(tmp_path / "adapter"), "--steps", "2",
                             "--batch-size", "2", "--seq-len", "16", "--lora-r", "2", "--load-in-4bit",
                             "--bnb-4bit-quant-type", "fp4", "--compute-dtype", "bf16", tmp_path=tmp_path, capsys=capsys)
    assert code == 0, err
    assert "compute dtype bf16, fp4 4-bit base" in out
    four_bit = bnb_config(quant_type="fp4", double_quant=True, compute_dtype=torch.bfloat16)
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", quantization_config=four_bit,
                                                             dtype=torch.bfloat16, device_map="cpu")
    loaded = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")
    weights = [m.weight for m in loaded.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(weights) == 7 * 4 and all(w.quant_state.quant_type == "fp4" for w in weights)
    assert loaded.get_base_model().model.embed_tokens.weight.dtype == torch.bfloat16
    trained = adapters(loaded)
    assert trained and all(p.abs().sum() > 0 for n, p in trained.items() if "lora_B" in n)
    assert loaded.peft_config["default"].base_model_name_or_path == str((tmp_path / "base").resolve())


@pytest.mark.parametrize("flags", [["--load-in-4bit", "--compute-dtype", "none"], ["--compute-dtype", "bf16"],
                                   ["--compute-dtype", "bf16", "--disk-tier", "TIER", "--masters-on-disk"]],
                         ids=["4-bit base", "bf16 shadow", "masters on disk"])
def test_finetune_loads_the_base_of_lora_slice_by_slice_and_trains_as_from_pretrained_does(flags, tmp_path, capsys,
                                                                                            monkeypatch):
    # The base is read into its host copies a weight at a time (quantised as it is read under
    # --load-in-4bit), never whole in RAM as from_pretrained holds it, and the adapters are injected
    # there: the same losses and trained adapters, bit for bit, as the run that loads with
    # from_pretrained and injects them before wrapping.
    from safetensors.torch import load_file

    from offload.cli import finetune as cli
    from offload.cli.finetune_args import DTYPES
    from offload.cli.models import four_bit_settings, pretrained_model, random_model, with_lora

    from .test_finetune import EXACT, run_cli

    torch.manual_seed(0)
    hf, tokenizer = random_model("llama", "tiny", 256, 16)
    hf.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    args = ["--model", str(tmp_path / "base"), "--steps", "2", "--batch-size", "2", "--seq-len", "16",
            "--lora-r", "4", "--seed", "3", *(str(tmp_path / f) if f == "TIER" else f for f in flags)]

    def whole(*args, **kwargs):
        raise AssertionError("from_pretrained holds the whole model in RAM")

    def from_pretrained_then_wrapped(args, options, causal_lm_sequential, load_causal_lm):
        hf, tokenizer = pretrained_model(args.model, four_bit_settings(args, DTYPES[args.compute_dtype]))
        peft_model = with_lora(hf, args)
        layers = causal_lm_sequential(peft_model, loss_chunk_tokens=args.loss_chunk_tokens or None)
        return OffloadModel(layers, device=args.device, **options), hf, tokenizer, peft_model

    def run(name: str) -> tuple[str, list[str], dict[str, torch.Tensor]]:
        code, out, err = run_cli(*args, "--out", str(tmp_path / name), tmp_path=tmp_path, capsys=capsys)
        assert code == 0, err
        losses = [line.split(" tokens/s")[0].rsplit(" ", 1)[0] for line in out.splitlines()
                  if line.startswith(("step ", "final loss "))]
        return out, losses, load_file(tmp_path / name / "adapter_model.safetensors")

    with monkeypatch.context() as patched:
        patched.setattr(transformers.AutoModelForCausalLM, "from_pretrained", whole)
        out, losses, trained = run("sliced")
    assert f"loaded {tmp_path / 'base'} slice by slice" in out
    assert ("nf4 4-bit base" in out) == ("--load-in-4bit" in flags)
    monkeypatch.setattr(cli, "_build_model", from_pretrained_then_wrapped)
    _, want_losses, want = run("whole")
    assert len(losses) == 3 and losses == want_losses
    assert len(want) == 2 * 7 * 4 and all(want[n].abs().sum() > 0 for n in want if "lora_B" in n)
    torch.testing.assert_close(trained, want, **EXACT)


@pytest.mark.parametrize(("flags", "fragment"), [
    (["--load-in-4bit"], "--load-in-4bit freezes the base in 4 bits, which has no gradient: train LoRA adapters "
                         "over it with --lora-r R"),
    (["--load-in-4bit", "--lora-r", "2", "--bnb-4bit-quant-type", "int3"],
     "argument --bnb-4bit-quant-type: invalid choice: 'int3'"),
    (["--load-in-4bit", "--lora-r", "2", "--disk-tier", "TIER", "--masters-on-disk"],
     "--masters-on-disk needs a half-precision shadow to load from, and a 4-bit base has none"),
], ids=["without lora", "unknown kind", "masters on disk"])
def test_finetune_refuses_a_4bit_base_it_cannot_train(flags, fragment, tmp_path, capsys):
    from .test_finetune import run_cli

    code, out, err = run_cli("--out", str(tmp_path / "out"), *flags, tmp_path=tmp_path, capsys=capsys)
    assert code == 2 and fragment in err, err
    assert not (tmp_path / "out").exists()  # refused before anything was made


def test_finetune_without_bitsandbytes_says_what_to_install(tmp_path, capsys, monkeypatch):
    from .test_finetune import run_cli

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as if not installed: importing it fails
    code, out, err = run_cli("--out", str(tmp_path / "out"), "--lora-r", "2", "--load-in-4bit", tmp_path=tmp_path,
                             capsys=capsys)
    assert code == 2 and '--load-in-4bit needs bitsandbytes: pip install "offload[bnb]"' in err, err
