"""Changes made around an OffloadedCausalLM's stages after wrapping (Note: [Around the stages] in
``offload/integrations/causal_lm_guards.py``): PEFT adapters injected into the Hugging Face model are
saved as the ``PeftModel`` saves them, and reload bit for bit; a module or parameter set on the wrapper,
and a hook on a container the stages bypass, are refused with what to do instead."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from safetensors.torch import load_file  # noqa: E402

from offload import OffloadOptimizer, load_checkpoint, save_checkpoint  # noqa: E402
from offload.integrations.causal_lm import OffloadedCausalLM  # noqa: E402

EXACT = {"rtol": 0.0, "atol": 0.0}
IDS = torch.randint(3, 64, (2, 9), generator=torch.Generator().manual_seed(0))


def llama() -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64, max_position_embeddings=64))


def lora(model: nn.Module, name: str = "default") -> nn.Module:
    torch.manual_seed(3)  # the adapters' initial values
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights="gaussian")
    return peft.get_peft_model(model, config, adapter_name=name)


def trained(model: OffloadedCausalLM) -> torch.Tensor:
    """Two AdamW steps; the logits after them."""
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)
    for _ in range(2):
        model(input_ids=IDS, labels=IDS).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    optimizer.synchronize()
    with torch.no_grad():
        return model(input_ids=IDS).logits


def folder(path: str) -> tuple[dict[str, torch.Tensor], dict]:
    """An adapter folder's tensors and config, and nothing else in it but PEFT's model card."""
    assert set(os.listdir(path)) - {"README.md"} == {"adapter_config.json", "adapter_model.safetensors"}
    with open(os.path.join(path, "adapter_config.json")) as file:
        return load_file(os.path.join(path, "adapter_model.safetensors")), json.load(file)


# -- adapters injected after wrapping ---------------------------------------------------------------

def test_adapters_added_after_wrapping_save_what_the_wrapped_peft_model_saves_and_reload_bit_for_bit(tmp_path):
    base = llama()
    after = OffloadedCausalLM(copy.deepcopy(base), device="cpu", num_slices=2)
    peft_after = lora(after.hf_model)  # injected into the model the stages were cut from
    before = OffloadedCausalLM(lora(copy.deepcopy(base)), device="cpu", num_slices=2)
    logits = trained(after)
    torch.testing.assert_close(logits, trained(before), **EXACT)
    after.save_pretrained(tmp_path / "after")
    before.save_pretrained(tmp_path / "before")  # PeftModel.save_pretrained
    (tensors, config), (expected, expected_config) = folder(tmp_path / "after"), folder(tmp_path / "before")
    assert list(tensors) == list(expected) and len(tensors) == 8
    for key, tensor in expected.items():
        torch.testing.assert_close(tensors[key], tensor, **EXACT)
    # PEFT keeps target_modules as a set and writes it as a list: in an order of the set's own.
    assert {**config, "target_modules": sorted(config["target_modules"])} == \
        {**expected_config, "target_modules": sorted(expected_config["target_modules"])}
    reloaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "after")
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=IDS).logits, logits, **EXACT)
        torch.testing.assert_close(peft_after(input_ids=IDS).logits, logits, **EXACT)
    # Trainer.save_model (and each checkpoint) goes through save_pretrained.
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "run"), use_cpu=True, report_to=[])
    transformers.Trainer(model=after, args=args).save_model(str(tmp_path / "trainer"))
    written = set(os.listdir(tmp_path / "trainer"))  # and the Trainer's training_args.bin
    assert "adapter_config.json" in written and not {"config.json", "model.safetensors"} & written
    saved = load_file(tmp_path / "trainer" / "adapter_model.safetensors")
    for key, tensor in expected.items():
        torch.testing.assert_close(saved[key], tensor, **EXACT)


def test_a_named_adapter_added_after_wrapping_is_saved_in_its_folder_as_peft_saves_it(tmp_path):
    model = OffloadedCausalLM(llama(), device="cpu", num_slices=2)
    lora(model.hf_model, name="mine")
    model.save_pretrained(tmp_path)
    tensors, config = folder(tmp_path / "mine")
    assert config["inference_mode"] is True and config["target_modules"] and len(tensors) == 8


def test_several_adapters_added_after_wrapping_are_refused_before_anything_is_written(tmp_path):
    model = OffloadedCausalLM(llama(), device="cpu", num_slices=2)
    peft_model = lora(model.hf_model)
    peft_model.add_adapter("other", peft.LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match=r"2 PEFT adapters \(default, other\).*peft_model.save_pretrained"):
        model.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_merged_adapters_save_the_whole_model_again(tmp_path):
    model = OffloadedCausalLM(llama(), device="cpu", num_slices=2)
    lora(model.hf_model).merge_and_unload()
    with torch.no_grad():
        logits = model(input_ids=IDS).logits
    model.save_pretrained(tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=IDS).logits, logits, **EXACT)


def test_a_wrapped_peft_model_merged_after_training_saves_the_whole_model(tmp_path):
    # Wrapped as a PeftModel, the adapters trained, then merged: save_pretrained (and the Trainer's
    # save_model, with its state_dict) writes the merged model, not the emptied PeftModel's adapter folder.
    model = OffloadedCausalLM(lora(llama()), device="cpu", num_slices=2)
    trained(model)
    model.peft_model.merge_and_unload()
    with torch.no_grad():
        logits = model(input_ids=IDS).logits
    model.save_pretrained(tmp_path / "direct")
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "run"), use_cpu=True, report_to=[])
    transformers.Trainer(model=model, args=args).save_model(str(tmp_path / "trainer"))
    for saved in ("direct", "trainer"):
        assert "adapter_config.json" not in os.listdir(tmp_path / saved)
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / saved)
        with torch.no_grad():
            torch.testing.assert_close(reloaded(input_ids=IDS).logits, logits, **EXACT)


def test_state_dict_and_checkpoints_of_adapters_added_after_wrapping_round_trip(tmp_path):
    model = OffloadedCausalLM(llama(), device="cpu", num_slices=2)
    lora(model.hf_model)
    logits = trained(model)
    state = model.state_dict()
    assert list(state) == list(model.hf_model.state_dict())  # the Hugging Face model's names, adapters included
    save_checkpoint(tmp_path / "checkpoint", model)
    for load in ("load_state_dict", "load_checkpoint"):
        other = OffloadedCausalLM(llama(), device="cpu", num_slices=2)
        lora(other.hf_model)
        if load == "load_state_dict":
            assert not other.load_state_dict(state).unexpected_keys
        else:
            load_checkpoint(tmp_path / "checkpoint", other)
        with torch.no_grad():
            torch.testing.assert_close(other(input_ids=IDS).logits, logits, **EXACT)


# -- modules and parameters set on the wrapper -------------------------------------------------------

@pytest.mark.parametrize("change", ["lm_head", "v_head", "parameter", "add_module", "register_parameter",
                                    "offloaded"])
def test_a_module_or_parameter_set_on_the_wrapper_is_refused_with_advice(change):
    model = OffloadedCausalLM(llama(), device="cpu", num_slices=2)
    names = [name for name, _ in model.named_parameters()]
    with pytest.raises(RuntimeError, match=r"never run in forward.*model.hf_model.lm_head = "):
        if change == "lm_head":
            model.lm_head = nn.Linear(32, 64, bias=False)
        elif change == "v_head":
            model.v_head = nn.Sequential(nn.Linear(32, 1))
        elif change == "parameter":
            model.scale = nn.Parameter(torch.ones(1))
        elif change == "add_module":
            model.register_module("v_head", nn.Linear(32, 1))
        elif change == "register_parameter":
            model.register_parameter("scale", nn.Parameter(torch.ones(1)))
        else:
            model.offloaded = copy.deepcopy(model.offloaded)
    assert [name for name, _ in model.named_parameters()] == names
    OffloadOptimizer(model, torch.optim.AdamW, lr=1e-3, fused=True)
    model.offloaded = model.offloaded  # what it holds already: no change
    model.warnings_issued = {}  # a plain attribute, as the trainers set them


def test_a_head_set_on_the_hugging_face_model_is_followed():
    plain, hf = llama(), llama()
    model = OffloadedCausalLM(hf, device="cpu", num_slices=2)
    for target in (plain, hf):
        torch.manual_seed(5)
        target.lm_head = nn.Linear(32, 64, bias=False)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=IDS).logits, plain(input_ids=IDS).logits, **EXACT)


def test_the_optimizer_names_parameters_registered_on_the_wrapper_behind_its_back():
    model = OffloadedCausalLM(llama(), device="cpu", num_slices=2)
    model._modules["v_head"] = nn.Linear(32, 1)  # past the refusal, as surgery on _modules would
    with pytest.raises(TypeError, match=r"got OffloadedCausalLM; wrap the model first, all of it: this "
                                         r"OffloadedCausalLM holds an OffloadModel \(.offloaded\) and also "
                                         r"v_head.weight, v_head.bias outside it"):
        OffloadOptimizer(model, torch.optim.AdamW, lr=1e-3, fused=True)


# -- hooks on the containers the stages bypass ----------------------------------------------------

def steer(module: nn.Module, args: tuple, output: object) -> object:
    output.last_hidden_state = output.last_hidden_state + 0.5
    return output


@pytest.mark.parametrize("where", ["hf", "decoder", "peft_model", "tuner"])
@pytest.mark.parametrize("kind", ["forward", "forward_with_kwargs", "forward_pre", "full_backward"])
def test_a_hook_on_a_container_the_stages_bypass_is_refused_at_the_forward(where, kind):
    hf = llama()
    wrapped = lora(hf) if where in ("peft_model", "tuner") else hf
    model = OffloadedCausalLM(wrapped, device="cpu", num_slices=2)
    with torch.no_grad():
        expected = model(input_ids=IDS).logits
    container = {"hf": hf, "decoder": hf.model, "peft_model": wrapped, "tuner": getattr(wrapped, "base_model", None)}
    register = {"forward": lambda m: m.register_forward_hook(steer),
                "forward_with_kwargs": lambda m: m.register_forward_hook(lambda m, a, k, o: o, with_kwargs=True),
                "forward_pre": lambda m: m.register_forward_pre_hook(lambda m, a: None),
                "full_backward": lambda m: m.register_full_backward_hook(lambda m, gi, go: None)}
    handle = register[kind](container[where])
    with pytest.raises(RuntimeError, match=r"never calls.*register it on the OffloadedCausalLM itself"):
        model(input_ids=IDS)
    with pytest.raises(RuntimeError, match="never calls"):
        model.base_model(input_ids=IDS)  # TRL's fused head
    handle.remove()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=IDS).logits, expected, **EXACT)


def test_hooks_on_the_layers_the_stages_call_and_on_the_wrapper_run_as_in_the_plain_model():
    plain, hf = llama(), llama()
    model = OffloadedCausalLM(hf, device="cpu", num_slices=2)
    calls = []
    for target, name in ((plain, "plain"), (hf, "offloaded")):
        target.model.layers[1].register_forward_hook(lambda m, a, o: (o[0] + 0.5, *o[1:]) if isinstance(o, tuple)
                                                     else o + 0.5)
        target.model.norm.register_forward_pre_hook(lambda m, a, name=name: calls.append(name))
    model.register_forward_hook(lambda m, a, k, o: calls.append("wrapper"), with_kwargs=True)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=IDS).logits, plain(input_ids=IDS).logits, **EXACT)
    assert sorted(calls) == ["offloaded", "plain", "wrapper"]


def test_memory_footprint_is_the_offloaded_models():
    model = OffloadedCausalLM(llama(), device="cpu", num_slices=2)
    trained(model)
    footprint = model.memory_footprint()
    assert footprint == model.offloaded.memory_footprint()
    # Hugging Face's counts the parameters and buffers alone, not the gradients and optimizer state.
    assert footprint.host_total > 2 * model.get_memory_footprint()
