"""QLoRA: LoRA adapters over a bitsandbytes 4-bit frozen base, offloaded, against the same model
trained unwrapped.

The base is built the two ways users build it: ``Linear4bit`` modules put in place of the
``nn.Linear`` layers (NF4 and FP4, with and without double quantisation), and
``from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True))`` followed by
``prepare_model_for_kbit_training``; and trained through ``transformers.Trainer``. Logits, loss,
every adapter gradient and the adapters after three AdamW steps must be bit-identical, and each
run must read the 4-bit weights and their quantisation state from the device slot. Note:
[Quantized weights] in ``offload/streams/quantized.py``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
import json
import warnings

import pytest
import torch

from offload import OffloadActivations, OffloadModel, OffloadOptimizer
from offload.model import engine_of

from .helpers import DEVICES, assert_same_grads
from .test_mixed_precision import master_grads_of
from .test_peft import assert_same_step, labels_of, lora, offloaded_step, reference_step, trainable
from .test_transformers import EXACT, ROOT, batch, build

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
with warnings.catch_warnings():  # its optional CPU kernels ("pip install kernels") are not needed
    warnings.simplefilter("ignore")
    bnb = pytest.importorskip("bitsandbytes")
from offload.integrations.causal_lm import OffloadedCausalLM  # noqa: E402  (needs transformers)
from offload.integrations.transformers import causal_lm_sequential  # noqa: E402

QUANTIZATIONS = [pytest.param(kind, double, id=f"{kind}{'-double' if double else ''}")
                 for kind in ("nf4", "fp4") for double in (False, True)]


def quantized(hf: torch.nn.Module, quant_type: str = "nf4", double: bool = False, device: str = "cpu",
              compute_dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """``hf`` with every ``nn.Linear`` but the output head replaced by a ``Linear4bit`` holding the
    same weights, quantized on ``device``: the module classes used directly."""
    for module in list(hf.modules()):
        for name, child in list(module.named_children()):
            if type(child) is not torch.nn.Linear or name == "lm_head":
                continue
            layer = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                      compute_dtype=compute_dtype, compress_statistics=double, quant_type=quant_type)
            layer.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, compress_statistics=double,
                                             quant_type=quant_type, module=layer)
            if child.bias is not None:
                layer.bias = child.bias
            setattr(module, name, layer.to(device))
    return hf


def four_bit_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]


def state_tensors(weight) -> list[torch.Tensor]:
    state = weight.quant_state
    found = [state.absmax, state.code]
    if state.nested:
        found += [state.offset, state.state2.absmax, state.state2.code]
    return found


def reading_from_the_slots(model: OffloadModel, hf: torch.nn.Module) -> list[int]:
    """Hooks that check that every ``Linear4bit`` runs on its weight and quantisation state in a
    device slot; returns the list they count the runs in."""
    runs = []
    engine = engine_of(model)

    def check(module, args):
        slots = engine.slots
        assert slots.owns(module.weight) and all(slots.owns(t) for t in state_tensors(module.weight))
        runs.append(1)

    for layer in four_bit_layers(hf):
        layer.register_forward_pre_hook(check)
    return runs


def assert_trains_as_the_unwrapped_model(peft_model: torch.nn.Module,
                                         reading: Callable) -> tuple[torch.nn.Module, list]:
    """Three AdamW steps of ``peft_model`` (2 decoder layers) offloaded in 3 slices equal a copy's
    unwrapped, and every quantized layer ran from a slot (``reading`` counts those runs); returns
    the copy and the runs."""
    reference = copy.deepcopy(peft_model)
    model = OffloadModel(causal_lm_sequential(peft_model), device="cpu", num_slices=3)
    runs = reading(model, peft_model)
    optimizers = [torch.optim.AdamW(trainable(m), lr=1e-2, fused=True) for m in (peft_model, reference)]
    for step in range(3):
        assert_same_step(peft_model, reference, model, batch(), seed=step)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    torch.testing.assert_close(list(peft_model.parameters()), list(reference.parameters()), **EXACT)
    # 7 layers a decoder layer, 2 decoder layers, forward and backward's recompute, 3 steps.
    assert len(runs) == 7 * 2 * 2 * 3
    return reference, runs


@pytest.mark.parametrize(("quant_type", "double"), QUANTIZATIONS)
def test_qlora_trains_as_the_unwrapped_model(quant_type, double):
    # Dropout in the model and in the adapters: the recompute draws the same masks.
    peft_model = lora(quantized(build("llama", dropout=0.1, layers=2), quant_type, double))
    assert_trains_as_the_unwrapped_model(peft_model, reading_from_the_slots)
    weights = [layer.weight for layer in four_bit_layers(peft_model)]
    assert all(w.dtype == torch.uint8 and not w.requires_grad and w.grad is None for w in weights)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_microbatches", [1, 2])
def test_qlora_with_microbatches_and_on_the_device(num_microbatches, device):
    peft_model = lora(quantized(build("llama", dropout=0.0, layers=2), "nf4", True, device=device), lora_dropout=0.0)
    assert_microbatched_runs_match(peft_model, num_microbatches, device, reading_from_the_slots)


def assert_microbatched_runs_match(peft_model, num_microbatches: int, device: str, reading) -> None:
    """A quantized two-layer Llama under LoRA: the offloaded model's adapter gradients are the
    unwrapped one's, with one microbatch or two, every run reading the weights from the slots
    (``reading(model, hf)``: hooks that check it and count the runs)."""
    reference = copy.deepcopy(peft_model).to(device)
    peft_model.to("cpu")  # the host copies; quantized where the kernels will run
    model = OffloadModel(causal_lm_sequential(peft_model), device=device, num_slices=3,
                         num_microbatches=num_microbatches)
    runs = reading(model, peft_model)
    inputs = {key: value[:2] for key, value in batch(device).items()}
    labels = labels_of(inputs)
    if num_microbatches == 2:
        rows = [{key: value[r:r + 1] for key, value in inputs.items()} for r in range(2)]
        for row in rows:  # as the microbatches run: a row at a time, their gradients added
            reference(**row, use_cache=False).logits.sum().backward()
        model(inputs).sum().backward()
    else:
        reference_step(reference, inputs, labels, 0)
        offloaded_step(peft_model.get_base_model(), model, inputs, labels, 0)
    assert len(runs) == 7 * 2 * num_microbatches * 2  # forward and the recompute
    grads = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
    for name, p in peft_model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad.to(device), grads[name], **EXACT, msg=lambda m: f"{name}: {m}")


def test_qlora_under_the_stream_ordering_checker():
    # Copies deferred until something waits for them (the slot holds poison until then), as on a
    # GPU's side stream: every run must read the codes and their state after their load landed.
    from offload.streamcheck import StreamChecker

    peft_model = lora(quantized(build("llama", dropout=0.0, layers=2), "nf4", True), lora_dropout=0.0)
    reference = copy.deepcopy(peft_model)
    with StreamChecker(schedule="late") as checker:
        model = OffloadModel(causal_lm_sequential(peft_model), device="cpu", num_slices=3)
        runs = reading_from_the_slots(model, peft_model)
        optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)
        for step in range(2):
            offloaded_step(peft_model.get_base_model(), model, batch(), labels_of(batch()), step)
            optimizer.step()
            optimizer.zero_grad()
        optimizer.synchronize()
    assert not checker.races, checker.summary()
    assert len(runs) == 2 * 7 * 2 * 2
    plain = torch.optim.AdamW(trainable(reference), lr=1e-2, fused=True)
    for step in range(2):
        reference_step(reference, batch(), labels_of(batch()), step)
        plain.step()
        plain.zero_grad()
    torch.testing.assert_close(list(peft_model.parameters()), list(reference.parameters()), **EXACT)


@pytest.mark.parametrize("placement", ["compute_dtype", "resident_slices"])
def test_qlora_under_a_compute_dtype_and_in_resident_slices(placement):
    peft_model = lora(quantized(build("llama", dropout=0.0, layers=2), "nf4", True), lora_dropout=0.0)
    assert_placed_runs_match(peft_model, placement, reading_from_the_slots)


def assert_placed_runs_match(peft_model, placement: str, reading) -> None:
    """A quantized two-layer Llama under LoRA, offloaded under a compute dtype or with its first two
    slices resident: outputs, loss and adapter gradients are the unwrapped model's (computing as
    OffloadModel does), every run reading from the slots (``reading``, as for
    :func:`assert_microbatched_runs_match`)."""
    reference = copy.deepcopy(peft_model)
    if placement == "compute_dtype":  # as OffloadModel computes: the floating-point parameters in bfloat16
        for p in reference.parameters():
            if p.is_floating_point():
                p.data = p.data.to(torch.bfloat16)
        settings = {"compute_dtype": torch.bfloat16}
    else:  # the first two slices (embeddings, first decoder layer) stay on the device with their state or scales
        settings = {"resident_slices": 2}
    model = OffloadModel(causal_lm_sequential(peft_model), device="cpu", num_slices=3, **settings)
    runs = reading(model, peft_model)
    inputs = batch()
    labels = labels_of(inputs)
    want_logits, want_loss = reference_step(reference, inputs, labels, 0)
    got_logits, got_loss = offloaded_step(peft_model.get_base_model(), model, inputs, labels, 0)
    torch.testing.assert_close(got_logits, want_logits, **EXACT)
    torch.testing.assert_close(got_loss, want_loss, **EXACT)
    assert_same_grads(peft_model, master_grads_of(reference), **EXACT)
    assert len(runs) == 7 * 2 * 2


def llama_64() -> torch.nn.Module:
    """A tiny Llama whose widths are multiples of bitsandbytes' block size (64): on CPUs with
    AVX512-BF16, bitsandbytes repacks a 4-bit weight for its CPU kernel in an inference forward,
    which needs them."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=97, max_position_embeddings=64)
    return transformers.AutoModelForCausalLM.from_config(config)


def test_qlora_forward_without_autograd_and_in_eval():
    peft_model = lora(quantized(llama_64(), "nf4", True), lora_dropout=0.0)
    reference = copy.deepcopy(peft_model)
    model = OffloadModel(causal_lm_sequential(peft_model), device="cpu", num_slices=2)
    runs = reading_from_the_slots(model, peft_model)
    for train in (True, False):
        peft_model.train(train)
        reference.train(train)
        with torch.no_grad():
            torch.testing.assert_close(model(batch()), reference(**batch(), use_cache=False).logits, **EXACT)
    assert len(runs) == 2 * 7 * 2
    # A repacking changes the device copies a run is given, never the host copies: training goes on
    # as from the weights loaded (against a reference that never ran in eval).
    fresh = lora(quantized(llama_64(), "nf4", True), lora_dropout=0.0)
    assert_same_step(peft_model, fresh, model.train(), batch())


def test_one_slice_in_eval_backpropagates_as_the_unwrapped_model():
    # The only slice keeps its graph from forward, and in eval mode bitsandbytes repacks the 4-bit
    # weights for its CPU kernel (its input needs no gradient): memory of the layer's own, not a
    # slot that another slice may have written since.
    peft_model = lora(quantized(llama_64(), "nf4", True), lora_dropout=0.0).eval()
    reference = copy.deepcopy(peft_model)
    model = OffloadModel(causal_lm_sequential(peft_model), device="cpu", num_slices=1)
    got, want = model(batch()), reference(**batch(), use_cache=False).logits
    torch.testing.assert_close(got, want, **EXACT)
    got.logsumexp(-1).sum().backward()
    want.logsumexp(-1).sum().backward()
    for mine, theirs in zip(trainable(peft_model), trainable(reference)):
        torch.testing.assert_close(mine.grad, theirs.grad, **EXACT)


def test_a_weight_quantized_again_after_wrapping_is_followed():
    peft_model = lora(quantized(build("llama", dropout=0.0, layers=2)), lora_dropout=0.0)
    reference = copy.deepcopy(peft_model)
    model = OffloadModel(causal_lm_sequential(peft_model), device="cpu", num_slices=3)
    assert_same_step(peft_model, reference, model, batch())
    for m in (peft_model, reference):  # a new state object, as a new quantisation leaves
        weight = m.get_base_model().model.layers[1].mlp.up_proj.weight
        weight.quant_state = copy.deepcopy(weight.quant_state)
        weight.quant_state.absmax *= 2
        m.zero_grad()
    assert_same_step(peft_model, reference, model, batch())


# -- Hugging Face models loaded in 4 bits ---------------------------------------------------------


def load_4bit(path, quant_type="nf4", double=True, compute_dtype=torch.float32) -> torch.nn.Module:
    config = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type,
                                             bnb_4bit_use_double_quant=double, bnb_4bit_compute_dtype=compute_dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # gradient_checkpointing_enable's new name
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=config, device_map="cpu",
                                                               dtype=torch.float32)
        # OffloadModel recomputes every slice already: no checkpointing inside them.
        return peft.prepare_model_for_kbit_training(hf, use_gradient_checkpointing=False).train()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A saved tiny model of each family, to load in 4 bits."""
    paths = {}
    for kind in ("llama", "gemma2", "gpt_neox"):
        paths[kind] = tmp_path_factory.mktemp(kind)
        build(kind, dropout=0.1, layers=2).save_pretrained(paths[kind])
    return paths


@pytest.mark.parametrize("kind", ["llama", "gemma2", "gpt_neox"])
def test_a_model_loaded_with_bits_and_bytes_config(kind, checkpoints):
    peft_model = lora(load_4bit(checkpoints[kind]), kind)
    assert len(four_bit_layers(peft_model)) == 7 * 2 if kind != "gpt_neox" else 4 * 2
    reference = copy.deepcopy(peft_model)
    model = OffloadModel(causal_lm_sequential(peft_model), device="cpu", num_slices=3)
    reading_from_the_slots(model, peft_model)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)
    plain = torch.optim.AdamW(trainable(reference), lr=1e-2, fused=True)
    for step in range(3):
        assert_same_step(peft_model, reference, model, batch(), seed=step)
        for o in (optimizer, plain):
            o.step()
            o.zero_grad()
    optimizer.synchronize()
    torch.testing.assert_close(list(peft_model.parameters()), list(reference.parameters()), **EXACT)
    stepped = {id(p) for p, state in optimizer.state.items() if state}
    assert stepped == {id(p) for p in trainable(peft_model)}


def test_the_adapters_save_as_peft_saves_them_and_load_on_the_unwrapped_4bit_model(checkpoints, tmp_path):
    peft_model = lora(load_4bit(checkpoints["llama"]), init_lora_weights=True)
    model = OffloadModel(causal_lm_sequential(peft_model), device="cpu", num_slices=3)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)
    for step in range(2):
        offloaded_step(peft_model.get_base_model(), model, batch(), labels_of(batch()), step)
        optimizer.step()
        optimizer.zero_grad()
    optimizer.synchronize()
    peft_model.save_pretrained(tmp_path)
    loaded = peft.PeftModel.from_pretrained(load_4bit(checkpoints["llama"]), tmp_path)
    trained = {n: p for n, p in peft_model.named_parameters() if "lora_" in n}
    assert trained and all(p.abs().sum() > 0 for n, p in trained.items() if "lora_B" in n)
    got = dict(loaded.named_parameters())
    for name, p in trained.items():
        torch.testing.assert_close(got[name], p, **EXACT)
    # In training mode (in eval, bitsandbytes may repack the weights for its CPU kernel, which these
    # widths do not allow), from one generator state: the same dropout masks.
    loaded.train()
    with torch.no_grad():
        torch.manual_seed(3)
        want = loaded(**batch(), use_cache=False).logits
        torch.manual_seed(3)
        torch.testing.assert_close(model(batch()), want, **EXACT)


def test_a_checkpoint_of_a_4bit_base_resumes_exactly(tmp_path):
    from offload import load_checkpoint, save_checkpoint

    runs = []
    for _ in range(2):
        peft_model = lora(quantized(build("llama", dropout=0.0, layers=2), "nf4", True), lora_dropout=0.0)
        model = OffloadModel(causal_lm_sequential(peft_model), device="cpu", num_slices=3)
        runs.append((peft_model, model, OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)))

    def step(run, seed):
        peft_model, model, optimizer = run
        offloaded_step(peft_model.get_base_model(), model, batch(), labels_of(batch()), seed)
        optimizer.step()
        optimizer.zero_grad()
        optimizer.synchronize()

    step(runs[0], 0)
    save_checkpoint(tmp_path / "step1", runs[0][1], runs[0][2])
    load_checkpoint(tmp_path / "step1", runs[1][1], runs[1][2])
    for run in runs:
        step(run, 1)
    torch.testing.assert_close(list(runs[1][0].parameters()), list(runs[0][0].parameters()), **EXACT)


def other_base(seed: int, double: bool = True) -> torch.nn.Module:
    """The test Llama, its weights drawn anew from ``seed``, quantized to NF4 and given adapters."""
    hf = build("llama", dropout=0.0, layers=2)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_()
    return lora(quantized(hf, "nf4", double), lora_dropout=0.0)


@pytest.mark.parametrize("into, compute_dtype", [("offloaded", None), ("offloaded", torch.bfloat16), ("unwrapped", None)])
def test_a_checkpoint_of_another_4bit_base_loads_its_scales_offset(tmp_path, into, compute_dtype):
    """The offset of a double-quantized weight's scales is packed in a tensor that state_dict()
    makes anew and whose length varies with it (Note: [Packed quantisation state]): a checkpoint
    of another base was refused for that length, or loaded its codes and scales in place and
    dequantized them around this model's offset."""
    from offload import load_checkpoint, save_checkpoint

    saved, target = other_base(1), other_base(2)
    model = OffloadModel(causal_lm_sequential(saved), device="cpu", num_slices=3, compute_dtype=compute_dtype)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)
    offloaded_step(saved.get_base_model(), model, batch(), labels_of(batch()), 0)
    optimizer.step()
    optimizer.synchronize()
    save_checkpoint(tmp_path / "step1", model)
    offsets = [w.weight.quant_state.offset.item() for w in four_bit_layers(saved)]
    assert offsets != [w.weight.quant_state.offset.item() for w in four_bit_layers(target)]

    layers = causal_lm_sequential(target)
    loaded = OffloadModel(layers, device="cpu", num_slices=3, compute_dtype=compute_dtype) if into == "offloaded" else layers
    load_checkpoint(tmp_path / "step1", loaded)
    assert [w.weight.quant_state.offset.item() for w in four_bit_layers(target)] == offsets
    torch.testing.assert_close(loaded(batch()), model(batch()), **EXACT)


def test_a_checkpoint_of_another_4bit_format_is_refused_before_loading(tmp_path):
    from offload import load_checkpoint, save_checkpoint
    from offload.checkpoint import CheckpointError

    saved, target = other_base(1), other_base(2)
    save_checkpoint(tmp_path / "s", OffloadModel(causal_lm_sequential(saved), device="cpu", num_slices=3))
    changed = four_bit_layers(target)[1].weight
    changed.quant_state.dtype = torch.bfloat16  # the dtype the weight dequantizes to
    model = OffloadModel(causal_lm_sequential(target), device="cpu", num_slices=3)
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(CheckpointError, match=r"holds another model: .*k_proj.base_layer.weight's 4-bit format: "
                                              r"dtype 'float32' there, 'bfloat16' here"):
        load_checkpoint(tmp_path / "s", model)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))


def test_trainer_trains_the_same_adapters(checkpoints, tmp_path):
    datasets = pytest.importorskip("datasets")
    ids = torch.randint(1, 97, (8, 10), generator=torch.Generator().manual_seed(3))
    data = datasets.Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist(),
                                       "labels": ids.tolist()})
    args = dict(use_cpu=True, report_to=[], per_device_train_batch_size=4,
                max_steps=2, logging_steps=1, save_strategy="no", seed=0, disable_tqdm=True, learning_rate=1e-2)
    runs = []
    for kind in ("plain", "offloaded"):
        peft_model = lora(load_4bit(checkpoints["llama"]))
        seen = []
        if kind == "offloaded":
            model = OffloadedCausalLM(peft_model, device="cpu", num_slices=2)
            seen = reading_from_the_slots(model.offloaded, peft_model)
        else:
            model = peft_model
        trainer = transformers.Trainer(model=model, train_dataset=data,
                                       args=transformers.TrainingArguments(output_dir=str(tmp_path / kind), **args))
        trainer.train()
        # Two steps of 7 layers on each decoder layer in forward, and on the first again in backward
        # (the second, in the last slice, keeps its graph).
        assert len(seen) == (0 if kind == "plain" else 2 * 7 * 3)
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        runs.append((losses, {n: p.detach().clone() for n, p in peft_model.named_parameters() if p.requires_grad}))
    (plain_losses, plain), (losses, offloaded) = runs
    assert losses == plain_losses and len(losses) == 2
    for name, p in plain.items():
        torch.testing.assert_close(offloaded[name], p, **EXACT, msg=lambda m: f"{name}: {m}")


def test_the_state_travels_with_the_weights_and_is_counted():
    peft_model = lora(quantized(build("llama", layers=2), "nf4", True))
    weights = [layer.weight for layer in four_bit_layers(peft_model)]
    model = OffloadModel(causal_lm_sequential(peft_model), device="cpu", num_slices=4)
    engine = model._engine
    state = sum(t.numel() * t.element_size() for w in weights for t in state_tensors(w))
    codes = sum(w.numel() for w in weights)
    # The codes and their state lie in the slices' host buffers; the layers still hold them.
    flats = [s.storage.flat for s in engine.slices]
    for t in [*weights, *(t for w in weights for t in state_tensors(w))]:
        assert any(f.data_ptr() <= t.data_ptr() < f.data_ptr() + f.numel() for f in flats)
    footprint = model.memory_footprint()
    others = sum(p.numel() * p.element_size() for p in peft_model.parameters() if p.dtype != torch.uint8)
    assert codes + state + others <= footprint.host_copies <= codes + state + others + 64 * 200
    # Each forward loads the codes and their state once, with everything else.
    before, _ = engine.traffic()
    with torch.no_grad():
        model(batch())
    assert engine.traffic()[0] - before == sum(s.storage.load_nbytes for s in engine.slices)
    assert sum(s.storage.load_nbytes for s in engine.slices) >= codes + state + others


@pytest.mark.parametrize("compute_dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_estimate_memory_counts_the_4bit_bytes_and_their_state(compute_dtype):
    # Made from the cut model before wrapping, the estimate matches what training then holds.
    from offload import estimate_memory

    sequential = causal_lm_sequential(lora(quantized(build("llama", layers=3), "nf4", True)))
    plan = estimate_memory(sequential, num_slices=3, optimizer="adamw", device="cpu", compute_dtype=compute_dtype)
    model = OffloadModel(sequential, device="cpu", num_slices=3, compute_dtype=compute_dtype)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)
    for _ in range(2):
        model(batch()).float().logsumexp(-1).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    optimizer.synchronize()
    footprint = model.memory_footprint()
    for category in ("masters", "shadows", "gradients", "optimizer_state"):
        assert plan.host_categories()[category] == footprint.host_categories()[category], category
    assert plan.device_slots == footprint.device_slots
    # The host buffers hold every parameter and every state tensor.
    weights = [layer.weight for layer in four_bit_layers(sequential)]
    state = sum(t.nbytes for w in weights for t in state_tensors(w))
    assert footprint.host_masters >= sum(p.nbytes for p in sequential.parameters()) + state


# -- what is refused ------------------------------------------------------------------------------


def test_a_trainable_4bit_weight_is_refused():
    hf = build("llama", layers=1)
    # Stored in bfloat16 (bitsandbytes' quant_storage, for FSDP), 4-bit codes can be marked trainable.
    layer = bnb.nn.Linear4bit(32, 32, bias=False, quant_storage=torch.bfloat16).to("cpu")
    layer.weight.requires_grad_(True)
    hf.model.layers[0].self_attn.q_proj = layer
    with pytest.raises(ValueError, match=r"'weight' of Linear4bit is a 4-bit weight that requires grad.*"
                                         r"requires_grad_\(False\)"):
        OffloadModel(causal_lm_sequential(hf), device="cpu", num_slices=2)


def test_a_weight_not_quantized_yet_is_refused():
    hf = build("llama", layers=1)
    layer = hf.model.layers[0].self_attn.q_proj
    hf.model.layers[0].self_attn.q_proj = bnb.nn.Linear4bit(layer.in_features, layer.out_features, bias=False)
    hf.model.layers[0].self_attn.q_proj.weight.requires_grad_(False)
    with pytest.raises(ValueError, match=r"Params4bit that is not quantized yet.*layer.to\('cuda'\)"):
        OffloadModel(causal_lm_sequential(hf), device="cpu", num_slices=2)


def test_torchao_nf4_weights_are_refused():
    nf4 = pytest.importorskip("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")
    layers = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Linear(128, 128))
    layers[0].weight = torch.nn.Parameter(nf4.to_nf4(layers[0].weight.detach()), requires_grad=False)
    with pytest.raises(ValueError, match="torchao NF4Tensor.*Linear4bit"):
        OffloadModel(layers, device="cpu", num_slices=2)


@pytest.mark.parametrize("settings", [{"checkpoint_activation": False},
                                      {"offload_activations": OffloadActivations(slices=[1])}],
                         ids=["kept", "offloaded"])
def test_kept_graphs_over_4bit_weights_are_refused(settings):
    peft_model = lora(quantized(build("llama", layers=2)))
    model = OffloadModel(causal_lm_sequential(peft_model), device="cpu", num_slices=4, **settings)
    with pytest.raises(ValueError, match=r"slice 1 holds quantized weights.*checkpoint_activation=True"):
        model(batch())


def test_a_second_forward_before_backward_with_4bit_weights_in_the_last_slice_raises():
    peft_model = lora(quantized(build("llama", layers=3)))
    # The last of three slices holds the last decoder layer and the head, and keeps its graph; the
    # second forward loads it into the other of the two slots.
    model = OffloadModel(causal_lm_sequential(peft_model), device="cpu", num_slices=3)
    assert model._engine.slices[-1].storage.companions
    first = model(batch())
    model(batch())
    with pytest.raises(RuntimeError, match="holds a quantized weight and its graph was kept from forward"):
        first.sum().backward()


def test_bench_qlora_records_the_bytes_of_a_4bit_base(tmp_path, monkeypatch):
    # In this process (the figures checked do not depend on the process; the imports are paid once).
    import importlib.util

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # for its json_output.py
    spec = importlib.util.spec_from_file_location("bench_qlora_under_test", ROOT / "benchmarks" / "bench_qlora.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "qlora.json"
    with warnings.catch_warnings():  # its main() sets a filter of its own
        bench.main(["--hidden", "128", "--layers", "2", "--vocab", "300", "--seq-len", "16", "--lora-r", "2",
                    "--steps", "1", "--json", str(out)])
    results = json.loads(out.read_text())["results"]
    plain, bf16 = results["no_compute_dtype"], results["compute_dtype_bf16"]
    # NF4 with double quantisation: half a byte a parameter, and a little for the state.
    assert 0.5 < plain["four_bit_bytes_per_parameter"] < 0.6
    assert plain["four_bit_bytes"] == bf16["four_bit_bytes"]
    assert plain["memory_footprint"]["host_shadows"] == 0 < bf16["memory_footprint"]["host_shadows"]
    assert plain["four_bit_bytes_in_host_buffers"] == plain["four_bit_bytes"] < plain["memory_footprint"]["host_copies"]
