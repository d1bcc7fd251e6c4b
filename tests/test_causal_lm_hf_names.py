"""OffloadedCausalLM's ``get_parameter``, ``get_buffer`` and ``get_submodule`` under the Hugging Face model's
names, which its ``state_dict()`` uses, beside its own (the offloaded stages'): the same objects as the
Hugging Face model's and the wrapper's own names, and an ``AttributeError`` that says what is missing and
where to look (Note: [Two naming schemes] in ``offload/integrations/hf_names.py``).
"""

from __future__ import annotations

import itertools
import time

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

transformers = pytest.importorskip("transformers")
from offload import OffloadOptimizer  # noqa: E402
from offload.integrations.causal_lm import OffloadedCausalLM  # noqa: E402
from offload.model import engine_of  # noqa: E402

from .helpers import quiet_transformers  # noqa: E402,F401 (autouse)
from .test_transformers import build  # noqa: E402
from .test_transformers_causal_lm import VOCAB, llama  # noqa: E402


def wrapped(tied: bool = False) -> tuple[torch.nn.Module, OffloadedCausalLM]:
    hf = llama(tied)
    return hf, OffloadedCausalLM(hf, device="cpu", num_slices=2)


def tensors_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by name, tied and non-persistent ones included."""
    return dict(itertools.chain(module.named_parameters(remove_duplicate=False),
                                module.named_buffers(remove_duplicate=False)))


def assert_every_name_resolves(hf: torch.nn.Module, model: OffloadedCausalLM) -> list[str]:
    """Every parameter and buffer of ``hf`` by its name through ``model``: ``hf``'s own tensor, which
    ``model.named_parameters()`` (or ``named_buffers()``) yields under the stages' name and
    ``model.state_dict()`` saves under the Hugging Face one; every module a stage holds by its path.
    Returns the module paths no stage holds (which raise)."""
    own = {id(tensor): name for name, tensor in tensors_of(model).items()}
    saved = model.state_dict(keep_vars=True)
    assert list(saved) == list(hf.state_dict())
    parameters = dict(hf.named_parameters(remove_duplicate=False))
    for name, tensor in tensors_of(hf).items():
        got = model.get_parameter(name) if name in parameters else model.get_buffer(name)
        assert got is tensor, name
        assert own[id(got)].startswith("offloaded."), name
        assert name not in saved or got is saved[name], name
    held, containers = {id(module) for module in model.offloaded.modules()}, []
    for name, module in hf.named_modules(remove_duplicate=False):
        if name and id(module) in held:
            assert model.get_submodule(name) is module, name
        elif name:
            containers.append(name)
            with pytest.raises(AttributeError, match="no offloaded stage does"):
                model.get_submodule(name)
    return containers


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_every_hugging_face_name_is_the_tensor_or_module_of_the_wrappers_own_name(tied):
    hf, model = wrapped(tied)
    assert assert_every_name_resolves(hf, model) == ["model", "model.layers"]  # what the stages bypass
    assert model.get_buffer("model.rotary_emb.inv_freq") is hf.model.rotary_emb.inv_freq  # in no state dict
    assert model.get_parameter("lm_head.weight") is hf.lm_head.weight
    if tied:
        assert model.get_parameter("lm_head.weight") is model.get_parameter("model.embed_tokens.weight")


def test_gpt2s_names_too():
    hf = build("gpt2", layers=2)
    model = OffloadedCausalLM(hf, device="cpu", num_slices=2)
    assert assert_every_name_resolves(hf, model) == ["transformer", "transformer.h"]


def test_a_decoder_layer_by_its_hugging_face_path_is_the_module_its_stage_holds():
    hf, model = wrapped()
    assert model.get_submodule("model.layers.1") is hf.model.layers[1] is model.get_submodule("offloaded.2.layer")
    assert model.get_submodule("model.layers.0").get_parameter("mlp.up_proj.weight") is model.get_parameter(
        "model.layers.0.mlp.up_proj.weight")


def test_the_wrappers_own_names_resolve_as_before():
    _, model = wrapped()
    for name, parameter in model.named_parameters(remove_duplicate=False):
        assert model.get_parameter(name) is parameter, name
    for name, buffer in model.named_buffers(remove_duplicate=False):
        assert model.get_buffer(name) is buffer, name
    for name, module in model.named_modules(remove_duplicate=False):
        assert model.get_submodule(name) is module, name
    with pytest.raises(AttributeError, match="OffloadModel has no attribute `9`"):  # nn.Module's own error
        model.get_parameter("offloaded.9.weight")


@pytest.mark.parametrize("method, name, missing", [
    ("get_parameter", "lm_head.wieght", "the Hugging Face model's lm_head (Linear) has no attribute `wieght`"),
    ("get_parameter", "model.layers.7.mlp.up_proj.weight",
     "the Hugging Face model's model.layers (ModuleList) has no attribute `7`"),
    ("get_buffer", "model.rotary_emb.inv_fre",
     "the Hugging Face model's model.rotary_emb (LlamaRotaryEmbedding) has no attribute `inv_fre`"),
    ("get_submodule", "transformer.h.0", "the Hugging Face model (LlamaForCausalLM) has no attribute `transformer`"),
    ("get_submodule", "model.layers", "the Hugging Face model holds it, but no offloaded stage does"),
    ("get_submodule", "lm_head.weight", "it names a tensor of the Hugging Face model"),
    ("get_parameter", "model.layers.0", "it names a module of the Hugging Face model"),
])
def test_an_unknown_name_raises_an_attribute_error_that_says_what_is_missing_and_where_to_look(method, name, missing):
    _, model = wrapped()
    with pytest.raises(AttributeError) as raised:
        getattr(model, method)(name)
    message = str(raised.value)
    assert f"has no {method.removeprefix('get_')} {name!r}: {missing}" in message
    assert "LlamaForCausalLM has no attribute" not in message  # nn.Module's, naming the wrapper by the model
    # The two schemes, with the example nearest the name, and the Hugging Face model's own view.
    example = {"lm_head.wieght": "offloaded.3.lm_head.weight is lm_head.weight",
               "model.layers.7.mlp.up_proj.weight":
                   "offloaded.1.layer.self_attn.q_proj.weight is model.layers.0.self_attn.q_proj.weight",
               "model.rotary_emb.inv_fre": "offloaded.0.rotary_emb.inv_freq is model.rotary_emb.inv_freq",
               "transformer.h.0": "offloaded.0.embed_tokens is model.embed_tokens",
               "model.layers": "offloaded.1.layer is model.layers.0",
               "lm_head.weight": "offloaded.3.lm_head is lm_head",
               "model.layers.0": "offloaded.1.layer.self_attn.q_proj.weight is model.layers.0.self_attn.q_proj.weight"}
    assert f"({example[name]})" in message
    assert "model.hf_model" in message and "optimizer.synchronize()" in message


def test_a_hugging_face_name_of_the_other_kind_raises_as_in_nn_module():
    _, model = wrapped()
    with pytest.raises(AttributeError, match="^`weight` is not a buffer$"):
        model.get_buffer("lm_head.weight")
    with pytest.raises(AttributeError, match="^`inv_freq` is not an nn.Parameter$"):
        model.get_parameter("model.rotary_emb.inv_freq")


def late(inner, args, kwargs) -> None:
    """A global step pre-hook that holds each of OffloadOptimizer's slice updates back: still pending
    when step() has returned."""
    if getattr(inner, "_offload_inner", False):
        time.sleep(0.2)


@pytest.mark.parametrize("name", ["model.embed_tokens.weight", "lm_head.weight"])
def test_a_hugging_face_name_right_after_step_holds_the_update(name):
    """As named_parameters(): the tensor is handed out once the pending host update landed."""
    hf, model = wrapped()
    before = hf.get_parameter(name).detach().clone()
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    handle = register_optimizer_step_pre_hook(late)
    try:
        optimizer.step()
        assert engine_of(model.offloaded).updates.pending()
        read = model.get_parameter(name).detach().clone()
    finally:
        handle.remove()
        optimizer.synchronize()
    assert not torch.equal(read, before)
    torch.testing.assert_close(read, hf.get_parameter(name).detach(), rtol=0.0, atol=0.0)


def test_the_adapters_of_a_peft_model_by_the_hugging_face_models_names():
    peft = pytest.importorskip("peft")
    hf = llama()
    adapted = peft.get_peft_model(hf, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    model = OffloadedCausalLM(adapted, device="cpu", num_slices=2)
    parameters = dict(hf.named_parameters(remove_duplicate=False))
    assert "model.layers.0.self_attn.q_proj.lora_A.default.weight" in parameters
    for name, tensor in tensors_of(hf).items():
        assert (model.get_parameter(name) if name in parameters else model.get_buffer(name)) is tensor, name
    assert model.get_submodule("model.layers.0.self_attn.q_proj") is hf.model.layers[0].self_attn.q_proj
