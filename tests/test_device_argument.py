"""``--device`` of the commands and scripts: one reading, refused while parsing (exit status 2).
And the meta device at an ``OffloadModel``'s forward: what holds no data is refused at the call,
naming the model and what to do, instead of failing inside the copy engine."""

import argparse
import copy

import pytest
import torch

from torch import nn

from offload import OffloadModel
from offload.cli.device_argument import device_argument


def parse(text: str) -> torch.device:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", type=device_argument)
    return parser.parse_args(["--device", text]).device


@pytest.mark.parametrize("text", ["cpu", "cpu:0"])
def test_the_cpu_is_taken_as_a_device(text):
    assert parse(text) == torch.device(text)


def cuda_devices(monkeypatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


@pytest.mark.parametrize(("text", "count", "fragment"), [
    ("gpu0", 2, "gpu0 is not a device: use cpu, cuda or cuda:N"),
    ("meta", 2, "meta: the layers compute on cpu, cuda or cuda:N, not meta"),
    ("mps", 2, "mps: the layers compute on cpu, cuda or cuda:N, not mps"),
    ("cuda", 0, "cuda: this machine has no CUDA device; use --device cpu"),
    ("cuda:0", 0, "cuda:0: this machine has no CUDA device; use --device cpu"),
    ("cuda:2", 2, "cuda:2: this machine has 2 CUDA device(s), cuda:0 to cuda:1"),
])
def test_a_device_the_layers_cannot_compute_on_is_one_line_with_status_2(text, count, fragment, monkeypatch, capsys):
    cuda_devices(monkeypatch, count)
    with pytest.raises(SystemExit) as exit_info:
        parse(text)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(f"argument --device: {fragment}")


@pytest.mark.parametrize("text", ["cuda", "cuda:1"])
def test_a_cuda_device_this_machine_has_is_taken(text, monkeypatch):
    cuda_devices(monkeypatch, 2)
    assert parse(text) == torch.device(text)


# -- the meta device at the model's forward -----------------------------------------------------------


def small() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


@pytest.mark.parametrize("how", ["ctor", "to"])
def test_a_model_computing_on_meta_refuses_a_recorded_forward_and_gives_shapes_without_one(how):
    # Built (or moved) to compute on meta, to be moved before training: a forward autograd records
    # would copy boundary activations and gradients out of meta. The plain model on meta gives shapes.
    plain = small()
    if how == "ctor":
        model = OffloadModel(copy.deepcopy(plain), device="meta", num_slices=2)
    else:
        model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=2).to("meta")
    x = torch.randn(6, 8)
    for inp in (x, x.to("meta")):
        with pytest.raises(RuntimeError, match=r"OffloadModel computes on meta .* holds no data.*model\.to\('cuda'\).*"
                                               r"torch\.no_grad\(\)"):
            model(inp)
    with torch.no_grad():
        out = model(x.to("meta"))
    assert out.device.type == "meta" and out.shape == copy.deepcopy(plain).to("meta")(x.to("meta")).shape
    model.to("cpu")  # then it trains as the plain model, bit for bit
    model(x).sum().backward()
    plain(x).sum().backward()
    torch.testing.assert_close(model(x), plain(x), rtol=0, atol=0)
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


@pytest.mark.parametrize("grad", [True, False], ids=["graph", "no_grad"])
def test_a_meta_input_to_a_model_computing_elsewhere_is_refused_naming_what_to_pass(grad):
    plain = small()
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=2)
    x = torch.randn(6, 8)
    with torch.set_grad_enabled(grad), pytest.raises(
            RuntimeError, match=r"OffloadModel computes on cpu and got an input on meta, which holds no data.*"
                                r"x\.to\('cpu'\)"):
        model(x.to("meta"))
    torch.testing.assert_close(model(x), plain(x), rtol=0, atol=0)  # nothing changed
