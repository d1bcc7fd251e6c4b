"""``--device`` of the commands and scripts: one reading, refused while parsing (exit status 2)."""

import argparse

import pytest
import torch

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
