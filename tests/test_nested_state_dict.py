"""An offloaded model inside another module: the parent's ``state_dict()`` and ``load_state_dict()``
round-trip it at any depth, as a LightningModule's checkpoint does.

PyTorch's ``load_state_dict`` on a parent never calls a child's ``load_state_dict``: it walks the
modules itself (``_load_from_state_dict``, and the state-dict hooks). So an
:class:`~offload.integrations.causal_lm.OffloadedCausalLM` keeps its Hugging Face names in hooks,
and an :class:`~offload.OffloadModel` waits for pending host updates there too.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from torch import nn

from offload import OffloadModel, OffloadOptimizer

transformers = pytest.importorskip("transformers",
                                   reason='transformers is not installed: pip install -e ".[transformers]"')

from offload.integrations.causal_lm import OffloadedCausalLM  # noqa: E402  (needs transformers)

EXACT = {"rtol": 0.0, "atol": 0.0}


def llama(seed: int, tied: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=97, max_position_embeddings=64, tie_word_embeddings=tied)
    return transformers.AutoModelForCausalLM.from_config(config)


def nested(model: nn.Module, depth: int) -> tuple[nn.Module, str]:
    """``model`` ``depth`` modules deep, and the prefix of its keys in the outermost one's state dict."""
    parent, prefix = model, ""
    for level in reversed(range(depth)):
        outer = nn.Module()
        outer.add_module(f"level{level}", parent)
        outer.head = nn.Linear(2, 2)  # a sibling with weights of its own
        parent, prefix = outer, f"level{level}.{prefix}"
    return parent, prefix


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], **EXACT, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_parent_saves_and_loads_an_offloaded_causal_lm_in_hugging_face_names(depth: int, tied: bool) -> None:
    source = llama(0, tied)
    saving, prefix = nested(OffloadedCausalLM(source, device="cpu", num_slices=2), depth)
    saved = saving.state_dict()
    hf_names = [prefix + name for name in source.state_dict()]
    assert [key for key in saved if key.startswith(prefix)] == hf_names

    target = llama(1, tied)  # other weights, which the load overwrites
    loading, _ = nested(OffloadedCausalLM(target, device="cpu", num_slices=3), depth)
    result = loading.load_state_dict(saved)  # strict
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert_same(loading.state_dict(), saved)
    assert_same({prefix + name: value for name, value in target.state_dict().items()},
                {key: value for key, value in saved.items() if key.startswith(prefix)})
    if tied:
        assert target.lm_head.weight is target.model.embed_tokens.weight


def test_missing_and_unexpected_keys_are_named_as_the_parent_saved_them() -> None:
    parent, prefix = nested(OffloadedCausalLM(llama(0), device="cpu", num_slices=2), 2)
    saved = parent.state_dict()
    del saved[prefix + "model.norm.weight"]
    saved[prefix + "model.layers.7.mlp.up_proj.weight"] = torch.zeros(3)
    saved[prefix + "offloaded.0.embed_tokens.weight"] = torch.zeros(3)  # the stages' names are not the model's
    with pytest.raises(RuntimeError) as raised:
        parent.load_state_dict(saved)
    message = str(raised.value)
    assert f'Missing key(s) in state_dict: "{prefix}model.norm.weight"' in message
    assert f'"{prefix}model.layers.7.mlp.up_proj.weight"' in message and f'"{prefix}offloaded.0.' in message

    result = parent.load_state_dict(saved, strict=False)
    assert result.missing_keys == [prefix + "model.norm.weight"]
    assert sorted(result.unexpected_keys) == [prefix + "model.layers.7.mlp.up_proj.weight",
                                              prefix + "offloaded.0.embed_tokens.weight"]

    saved = parent.state_dict()
    saved[prefix + "lm_head.weight"] = torch.zeros(3, 3)
    with pytest.raises(RuntimeError, match=rf"size mismatch for {prefix}lm_head\.weight: copying a param with shape"):
        parent.load_state_dict(saved, strict=False)


def test_keep_vars_and_assign_reach_the_host_copies() -> None:
    hf = llama(0)
    parent, prefix = nested(OffloadedCausalLM(hf, device="cpu", num_slices=2), 1)
    kept = parent.state_dict(keep_vars=True)
    assert kept[prefix + "model.norm.weight"] is hf.model.norm.weight
    assert not isinstance(parent.state_dict()[prefix + "model.norm.weight"], nn.Parameter)

    reference = llama(1).eval()
    loaded = {prefix + name: value.clone() for name, value in reference.state_dict().items()}
    loaded["head.weight"], loaded["head.bias"] = parent.head.weight.detach(), parent.head.bias.detach()
    parent.load_state_dict(loaded, assign=True)
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(0))
    model = parent.get_submodule(prefix[:-1]).eval()
    torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits, **EXACT)


# -- OffloadModel ------------------------------------------------------------------------------------


class SlowAdamW(torch.optim.AdamW):
    """AdamW that takes a while before it starts: its update is still pending when step() returns."""

    def step(self, closure: Any = None) -> Any:
        time.sleep(0.3)
        return super().step(closure)


def layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))


@pytest.mark.parametrize("depth", [1, 2])
def test_a_parent_loads_an_offload_model_after_its_pending_update(depth: int) -> None:
    model = OffloadModel(layers(), device="cpu", num_slices=3)
    parent, prefix = nested(model, depth)
    saved = {key: value.clone() for key, value in parent.state_dict().items()}
    assert [key for key in saved if key.startswith(prefix)] == [prefix + key for key in layers().state_dict()]

    optimizer = OffloadOptimizer(model, SlowAdamW, lr=0.1, fused=True)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()  # returns while the update is still to run
    parent.load_state_dict(saved)  # must not be overwritten by the update landing after it
    optimizer.synchronize()
    assert_same(parent.state_dict(), saved)


# -- OffloadOptimizer over an OffloadedCausalLM ----------------------------------------------------


def test_offload_optimizer_steps_an_offloaded_causal_lm_as_its_offload_model() -> None:
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(0))
    trained = []
    for through_wrapper in (True, False):
        model = OffloadedCausalLM(llama(0), device="cpu", num_slices=2)
        stepped = model if through_wrapper else model.offloaded
        optimizer = OffloadOptimizer(stepped, torch.optim.AdamW, lr=1e-2, fused=True)
        assert optimizer.model is model.offloaded
        for _ in range(2):
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        trained.append(model.state_dict())
    assert_same(trained[0], trained[1])


def test_offload_optimizer_refuses_a_module_with_parameters_outside_its_offload_model() -> None:
    holder = nn.Module()
    holder.offloaded = OffloadModel(layers(), device="cpu", num_slices=2)
    holder.extra = nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"an OffloadModel or an OffloadedCausalLM, got Module; wrap the model first"):
        OffloadOptimizer(holder, torch.optim.AdamW)
