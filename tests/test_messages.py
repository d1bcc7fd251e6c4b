"""Messages a newcomer meets first say what to do; silent corners either speak or are documented.

The Hugging Face and extras messages, the layer notes, the optimizer's constructor checks, one
OffloadOptimizer per model, ``step()`` before any backward, and ``nn.ModuleList`` as slices.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from offload import OffloadModel, OffloadOptimizer

from .helpers import clone_model

ROOT = Path(__file__).resolve().parents[1]


def layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2))


class Fails(nn.Module):
    def __init__(self, error: BaseException) -> None:
        super().__init__()
        self.error = error
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise self.error


# -- a layer's error says where it came from -----------------------------------------------------


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes (PEP 678) need Python 3.11")
@pytest.mark.parametrize("error", [ValueError("bad shape"), torch.OutOfMemoryError("out of memory")])
def test_a_layers_error_keeps_its_type_and_notes_the_layer_and_slice(error):
    model = OffloadModel(nn.Sequential(nn.Linear(4, 8), nn.GELU(), Fails(error), nn.Linear(8, 2)), device="cpu",
                         num_slices=2)
    assert model.partition == (("0", "1"), ("2", "3"))
    for _ in range(2):  # the layer raises the same exception again: one note, not two
        with pytest.raises(type(error)) as info:
            model(torch.randn(3, 4))
        assert info.value is error
        assert info.value.__notes__ == ["in layer 2 (Fails) of OffloadModel slice 1"]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes (PEP 678) need Python 3.11")
def test_an_error_in_the_recompute_of_backward_notes_the_layer_too():
    class FailsWhenRecomputed(nn.Module):
        def forward(self, x):
            import offload

            if offload.is_recomputing():
                raise RuntimeError("recompute failed")
            return x

    model = OffloadModel(nn.Sequential(nn.Linear(4, 8), FailsWhenRecomputed(), nn.Linear(8, 2)), device="cpu",
                         num_slices=2)
    loss = model(torch.randn(3, 4)).sum()
    with pytest.raises(RuntimeError, match="recompute failed") as info:
        loss.backward()
    assert "in layer 1 (FailsWhenRecomputed) of OffloadModel slice 0" in info.value.__notes__


# -- OffloadModel's input ------------------------------------------------------------------------


def test_a_hugging_face_model_is_pointed_to_causal_lm_sequential():
    transformers = pytest.importorskip("transformers", reason='transformers is not installed: pip install -e ".[transformers]"')
    config = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, vocab_size=32)
    hf = transformers.LlamaForCausalLM(config)
    with pytest.raises(TypeError, match=r"LlamaForCausalLM, a Hugging Face model") as info:
        OffloadModel(hf, device="cpu")
    assert "OffloadModel(causal_lm_sequential(model), device=...)" in str(info.value)


def test_another_module_is_told_to_use_an_nn_sequential():
    with pytest.raises(TypeError, match="got Linear. Put its layers in an nn.Sequential"):
        OffloadModel(nn.Linear(2, 2), device="cpu")


def test_keyword_arguments_to_forward_suggest_one_dict():
    model = OffloadModel(layers(), device="cpu")
    with pytest.raises(TypeError, match=r"\['attention_mask', 'input_ids'\]\. Pass them as one dict instead: "
                                        r"model\(dict\(batch\)\)"):
        model(input_ids=torch.zeros(1, 4), attention_mask=torch.ones(1, 4))


def test_a_module_list_is_taken_as_its_slices_as_a_list_is():
    torch.manual_seed(0)
    slices = [nn.Sequential(nn.Linear(4, 8), nn.GELU()), nn.Linear(8, 2)]
    plain = nn.Sequential(*clone_model(nn.Sequential(*slices)))
    model = OffloadModel(nn.ModuleList(slices), device="cpu")
    assert model.num_slices == 2 and model.partition == (("0",), ("1",))
    x = torch.randn(3, 4)
    torch.testing.assert_close(model(x), plain(x), rtol=0, atol=0)


# -- OffloadOptimizer's arguments ----------------------------------------------------------------


def test_an_optimizer_for_a_plain_model_says_to_wrap_it_first():
    with pytest.raises(TypeError, match=r"got Sequential; wrap the model first: model = OffloadModel\(model, "):
        OffloadOptimizer(layers(), torch.optim.AdamW, lr=1e-3)


def test_an_optimizer_instance_gets_a_short_message():
    model = OffloadModel(layers(), device="cpu")
    instance = torch.optim.AdamW(layers().parameters(), lr=1e-3)
    with pytest.raises(TypeError) as info:
        OffloadOptimizer(model, instance)
    message = str(info.value)
    assert message == ("optimizer_class must be a torch.optim.Optimizer subclass, got a AdamW instance; pass the "
                       "class and its arguments: OffloadOptimizer(model, torch.optim.AdamW, lr=...)")


@pytest.mark.parametrize("lr", [1e-3, 1])
def test_a_learning_rate_in_the_place_of_params_says_to_pass_it_by_name(lr):
    # torch.optim.AdamW(params, 1e-3) takes the learning rate second; OffloadOptimizer's third place is params.
    model = OffloadModel(layers(), device="cpu")
    with pytest.raises(TypeError) as info:
        OffloadOptimizer(model, torch.optim.AdamW, lr)
    assert str(info.value) == (f"params (OffloadOptimizer's third argument) is {lr!r}, a number: pass hyperparameters "
                               f"as keywords, OffloadOptimizer(model, torch.optim.AdamW, lr={lr!r})")


# -- one OffloadOptimizer per model --------------------------------------------------------------


def train_step(model: OffloadModel, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_a_second_optimizer_takes_over_and_the_first_refuses_to_step():
    model = OffloadModel(layers(), device="cpu", num_slices=2)
    first = OffloadOptimizer(model, torch.optim.SGD, lr=0.1, fused=True)
    train_step(model, first)
    second = OffloadOptimizer(model, torch.optim.SGD, lr=0.1, fused=True)  # say, a notebook cell run again
    train_step(model, second)
    model(torch.randn(3, 4)).sum().backward()
    with pytest.raises(RuntimeError, match="a newer OffloadOptimizer was built for this model"):
        first.step()
    second.step()
    second.synchronize()


def test_an_optimizer_built_after_the_last_one_was_dropped_steps():
    model = OffloadModel(layers(), device="cpu", num_slices=2)
    train_step(model, OffloadOptimizer(model, torch.optim.SGD, lr=0.1, fused=True))
    optimizer = OffloadOptimizer(model, torch.optim.SGD, lr=0.1, fused=True)
    train_step(model, optimizer)
    optimizer.synchronize()


def test_each_model_has_its_own_newest_optimizer():
    a, b = (OffloadModel(layers(), device="cpu") for _ in range(2))
    for_a, for_b = OffloadOptimizer(a, torch.optim.SGD, lr=0.1, fused=True), OffloadOptimizer(b, torch.optim.SGD, lr=0.1, fused=True)
    train_step(a, for_a)
    train_step(b, for_b)
    for_a.synchronize()
    for_b.synchronize()


# -- step() before any backward -------------------------------------------------------------------


def test_step_before_any_backward_changes_nothing_as_torch_optim_does():
    model = OffloadModel(layers(), device="cpu", num_slices=2)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-3, fused=True)
    optimizer.step()
    optimizer.synchronize()
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    assert optimizer.state_dict()["state"] == {}


# -- extras hints ---------------------------------------------------------------------------------


def test_the_transformers_integration_without_transformers_says_how_to_install_it(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\n"
        "class Hide:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'transformers' or name.startswith('transformers.'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Hide())\n"
    )
    done = subprocess.run([sys.executable, "-c", "import offload.integrations.transformers"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 1
    assert 'pip install "offload[transformers]"' in done.stderr.strip().splitlines()[-1]
