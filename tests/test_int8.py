"""LoRA adapters over a bitsandbytes 8-bit frozen base (``Linear8bitLt``, LLM.int8()), offloaded,
against the same model trained unwrapped.

Logits, loss, every adapter gradient and the adapters after three AdamW steps must be
bit-identical, and each run must read the int8 codes and their row scales from the device slot.
Note: [Quantized weights] in ``offload/streams/quantized.py``, rule 6.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import warnings

import pytest
import torch

from offload import OffloadModel, OffloadOptimizer
from offload.model import engine_of

from .helpers import DEVICES, assert_same_grads, run_state_lookups
from .test_mixed_precision import master_grads_of
from .test_qlora import assert_microbatched_runs_match, assert_placed_runs_match, assert_trains_as_the_unwrapped_model
from .test_peft import assert_same_step, labels_of, lora, offloaded_step, reference_step, trainable
from .test_transformers import EXACT, ROOT, batch, build

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
with warnings.catch_warnings():  # its optional CPU kernels ("pip install kernels") are not needed
    warnings.simplefilter("ignore")
    bnb = pytest.importorskip("bitsandbytes")
from offload.integrations.transformers import causal_lm_sequential  # noqa: E402  (needs transformers)


def eight_bit(hf: torch.nn.Module, threshold: float = 6.0, device: str = "cpu") -> torch.nn.Module:
    """``hf`` with every ``nn.Linear`` but the output head replaced by a ``Linear8bitLt`` holding the
    same weights, quantized on ``device``, as ``load_in_8bit`` builds them."""
    for module in list(hf.modules()):
        for name, child in list(module.named_children()):
            if type(child) is not torch.nn.Linear or name == "lm_head":
                continue
            layer = bnb.nn.Linear8bitLt(child.in_features, child.out_features, bias=child.bias is not None,
                                        has_fp16_weights=False, threshold=threshold)
            layer.load_state_dict(child.state_dict())
            setattr(module, name, layer.to(device))
    return hf


def eight_bit_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(m, bnb.nn.Linear8bitLt)]


def reading_from_the_slots(model: OffloadModel, hf: torch.nn.Module) -> list:
    """Hooks that check that every ``Linear8bitLt`` computes with codes and row scales in a device
    slot (its forward reads them from ``layer.state``); returns the list they count the runs in,
    whose ``handles`` remove them."""
    runs = _Runs()
    engine = engine_of(model)

    def check(module, args, output):
        assert engine.slots.owns(module.state.CB) and engine.slots.owns(module.state.SCB)
        runs.append(1)

    runs.handles = [layer.register_forward_hook(check) for layer in eight_bit_layers(hf)]
    return runs


class _Runs(list):
    handles: list = []


@pytest.mark.parametrize("ran_before", [False, True], ids=["fresh", "ran-before-wrapping"])
@pytest.mark.parametrize("threshold", [0.0, 6.0])
def test_lora_over_8bit_trains_as_the_unwrapped_model(threshold, ran_before):
    # Dropout in the model and in the adapters: the recompute draws the same masks.
    peft_model = lora(eight_bit(build("llama", dropout=0.1, layers=2), threshold))
    if ran_before:  # its forward moved the codes and scales from the weight to the layer's state
        with torch.no_grad():
            peft_model(**batch(), use_cache=False)
        assert all(layer.weight.SCB is None for layer in eight_bit_layers(peft_model))
    reference, runs = assert_trains_as_the_unwrapped_model(peft_model, reading_from_the_slots)
    layers = eight_bit_layers(peft_model)
    assert all(m.weight.dtype == torch.int8 and not m.weight.requires_grad and m.weight.grad is None for m in layers)
    # Between runs every layer holds its host copies again, so the unwrapped model runs as before.
    for handle in runs.handles:
        handle.remove()
    assert all(m.state.CB.data_ptr() == m.weight.data_ptr() for m in layers)
    for m in (peft_model, reference):
        m.eval()
    with torch.no_grad():
        torch.testing.assert_close(peft_model(**batch(), use_cache=False).logits,
                                   reference(**batch(), use_cache=False).logits, **EXACT)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_microbatches", [1, 2])
def test_lora_over_8bit_with_microbatches_and_on_the_device(num_microbatches, device):
    peft_model = lora(eight_bit(build("llama", dropout=0.0, layers=2), device=device), lora_dropout=0.0)
    assert_microbatched_runs_match(peft_model, num_microbatches, device, reading_from_the_slots)


@pytest.mark.parametrize("placement", ["compute_dtype", "resident_slices"])
def test_lora_over_8bit_under_a_compute_dtype_and_in_resident_slices(placement):
    peft_model = lora(eight_bit(build("llama", dropout=0.0, layers=2)), lora_dropout=0.0)
    assert_placed_runs_match(peft_model, placement, reading_from_the_slots)


def test_lora_over_8bit_forward_in_eval():
    # In eval bitsandbytes runs its int8 matmul (with the outlier split) instead of dequantizing.
    peft_model = lora(eight_bit(build("llama", dropout=0.0, layers=2)), lora_dropout=0.0).eval()
    reference = copy.deepcopy(peft_model)
    model = OffloadModel(causal_lm_sequential(peft_model), device="cpu", num_slices=2)
    runs = reading_from_the_slots(model, peft_model)
    with torch.no_grad():
        torch.testing.assert_close(model(batch()), reference(**batch(), use_cache=False).logits, **EXACT)
    assert len(runs) == 7 * 2


def test_binding_swaps_run_states_at_the_8bit_weights_alone(monkeypatch):
    # The slice's layout finds its 8-bit weights once; binding looks up the run state of those
    # entries alone, and a slice without any (the embedding's, the head's) looks up none.
    peft_model = lora(eight_bit(build("llama", layers=2)), lora_dropout=0.0)
    model = OffloadModel(causal_lm_sequential(peft_model), device="cpu", num_slices=4)
    slices = engine_of(model).slices
    for s in slices:
        held = [id(s.storage.entries[i].tensor) for i in s.storage.run_state_positions]
        assert held == [id(m.weight) for layer in s.layers for m in eight_bit_layers(layer)]
    assert any(not s.storage.run_state_positions for s in slices)
    looked_up = run_state_lookups(monkeypatch)
    runs = reading_from_the_slots(model, peft_model)
    model(batch()).sum().backward()
    assert looked_up and all(isinstance(t, bnb.nn.Int8Params) for t in looked_up)
    assert len(runs) == 7 * 2 * 2  # each 8-bit layer in forward and in backward's recompute


def test_the_scales_travel_with_the_codes_and_are_counted():
    peft_model = lora(eight_bit(build("llama", layers=2)))
    layers = eight_bit_layers(peft_model)
    model = OffloadModel(causal_lm_sequential(peft_model), device="cpu", num_slices=4)
    engine = model._engine
    codes = sum(m.weight.numel() for m in layers)
    scales = sum(m.state.SCB.nbytes for m in layers)
    assert scales == 4 * sum(m.out_features for m in layers)
    # The codes and their scales lie in the slices' host buffers, once: the layers compute with them.
    flats = [s.storage.flat for s in engine.slices]
    for t in [*(m.weight for m in layers), *(m.state.SCB for m in layers)]:
        assert any(f.data_ptr() <= t.data_ptr() < f.data_ptr() + f.numel() for f in flats)
    assert all(m.state.CB.data_ptr() == m.weight.data_ptr() and m.weight.CB is None and m.weight.SCB is None
               for m in layers)
    footprint = model.memory_footprint()
    others = sum(p.numel() * p.element_size() for p in peft_model.parameters() if p.dtype != torch.int8)
    assert codes + scales + others <= footprint.host_copies <= codes + scales + others + 64 * 200
    before, _ = engine.traffic()
    with torch.no_grad():
        model(batch())
    assert engine.traffic()[0] - before == sum(s.storage.load_nbytes for s in engine.slices)


# -- what is refused ------------------------------------------------------------------------------


def replaced_down_proj(**options) -> torch.nn.Module:
    hf = build("llama", layers=1)
    layer = hf.model.layers[0].mlp.down_proj
    hf.model.layers[0].mlp.down_proj = bnb.nn.Linear8bitLt(layer.in_features, layer.out_features, bias=False,
                                                           **options)
    return hf


def test_an_8bit_weight_with_float_values_is_refused():
    hf = replaced_down_proj(has_fp16_weights=True)
    hf.model.layers[0].mlp.down_proj.to("cpu")
    with pytest.raises(ValueError, match=r"keeps float values \(has_fp16_weights=True.*has_fp16_weights=False"):
        OffloadModel(causal_lm_sequential(hf), device="cpu", num_slices=2)


def test_an_8bit_weight_not_quantized_yet_is_refused():
    hf = replaced_down_proj(has_fp16_weights=False)
    with pytest.raises(ValueError, match=r"Int8Params that is not quantized yet.*layer.to\('cuda'\)"):
        OffloadModel(causal_lm_sequential(hf), device="cpu", num_slices=2)


def test_kept_graphs_over_8bit_weights_are_refused():
    # bitsandbytes keeps the input and the layer's state on its autograd context, as for 4 bits.
    peft_model = lora(eight_bit(build("llama", layers=2)))
    model = OffloadModel(causal_lm_sequential(peft_model), device="cpu", num_slices=4, checkpoint_activation=False)
    with pytest.raises(ValueError, match=r"slice 1 holds quantized weights.*checkpoint_activation=True"):
        model(batch())


# -- Hugging Face models loaded in 8 bits ---------------------------------------------------------


def load_8bit(path) -> torch.nn.Module:
    config = transformers.BitsAndBytesConfig(load_in_8bit=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # gradient_checkpointing_enable's new name
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=config, device_map="cpu",
                                                               dtype=torch.float32)
        # OffloadModel recomputes every slice already: no checkpointing inside them.
        return peft.prepare_model_for_kbit_training(hf, use_gradient_checkpointing=False).train()


@pytest.mark.parametrize("kind", ["llama", "gpt_neox"])
def test_a_model_loaded_with_load_in_8bit(kind, tmp_path):
    build(kind, dropout=0.1, layers=2).save_pretrained(tmp_path)
    peft_model = lora(load_8bit(tmp_path), kind)
    assert len(eight_bit_layers(peft_model)) == (7 * 2 if kind != "gpt_neox" else 4 * 2)
    reference = copy.deepcopy(peft_model)
    model = OffloadModel(causal_lm_sequential(peft_model), device="cpu", num_slices=3)
    runs = reading_from_the_slots(model, peft_model)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)
    plain = torch.optim.AdamW(trainable(reference), lr=1e-2, fused=True)
    for step in range(3):
        assert_same_step(peft_model, reference, model, batch(), seed=step)
        for o in (optimizer, plain):
            o.step()
            o.zero_grad()
    optimizer.synchronize()
    torch.testing.assert_close(list(peft_model.parameters()), list(reference.parameters()), **EXACT)
    assert len(runs) == len(eight_bit_layers(peft_model)) * 2 * 3


@pytest.mark.parametrize("ran_before", [False, True], ids=["fresh", "ran-before-wrapping"])
def test_estimate_memory_counts_the_8bit_bytes_and_their_scales(ran_before):
    from offload import estimate_memory

    peft_model = lora(eight_bit(build("llama", layers=3)))
    if ran_before:  # the row scales are on the layers' state, no longer on the weights
        with torch.no_grad():
            peft_model(**batch(), use_cache=False)
    sequential = causal_lm_sequential(peft_model)
    plan = estimate_memory(sequential, num_slices=3, optimizer="adamw", device="cpu")
    model = OffloadModel(sequential, device="cpu", num_slices=3)
    footprint = model.memory_footprint()
    assert plan.host_categories()["masters"] == footprint.host_categories()["masters"]
    assert plan.device_slots == footprint.device_slots


def test_bench_qlora_records_the_bytes_of_an_8bit_base(tmp_path):
    out = tmp_path / "int8.json"
    done = subprocess.run([sys.executable, "benchmarks/bench_qlora.py", "--bits", "8", "--hidden", "128", "--layers",
                           "2", "--vocab", "300", "--seq-len", "16", "--lora-r", "2", "--steps", "1", "--json",
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    plain = json.loads(out.read_text())["results"]["no_compute_dtype"]
    # One byte a parameter for the codes, four a row for the scales (128 or more columns a row).
    assert 1.0 < plain["eight_bit_bytes_per_parameter"] <= 1 + 4 / 128
    host_copies = plain["memory_footprint"]["host_copies"]
    assert plain["eight_bit_bytes_in_host_buffers"] == plain["eight_bit_bytes"] < host_copies


def test_the_adapters_save_as_peft_saves_them_and_load_on_the_unwrapped_8bit_model(tmp_path):
    build("llama", dropout=0.0, layers=2).save_pretrained(tmp_path / "base")
    peft_model = lora(load_8bit(tmp_path / "base"), init_lora_weights=True)
    model = OffloadModel(causal_lm_sequential(peft_model), device="cpu", num_slices=3)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)
    for step in range(2):
        offloaded_step(peft_model.get_base_model(), model, batch(), labels_of(batch()), step)
        optimizer.step()
        optimizer.zero_grad()
    optimizer.synchronize()
    peft_model.save_pretrained(tmp_path / "adapter")
    loaded = peft.PeftModel.from_pretrained(load_8bit(tmp_path / "base"), tmp_path / "adapter")
    trained = {n: p for n, p in peft_model.named_parameters() if "lora_" in n}
    assert trained and all(p.abs().sum() > 0 for n, p in trained.items() if "lora_B" in n)
    got = dict(loaded.named_parameters())
    for name, p in trained.items():
        torch.testing.assert_close(got[name], p, **EXACT)
    for m in (peft_model, loaded):
        m.eval()
    with torch.no_grad():  # the loaded adapters, unwrapped and offloaded, and the trained model unwrapped
        want = loaded(**batch(), use_cache=False).logits
        torch.testing.assert_close(model(batch()), want, **EXACT)
        torch.testing.assert_close(peft_model(**batch(), use_cache=False).logits, want, **EXACT)
