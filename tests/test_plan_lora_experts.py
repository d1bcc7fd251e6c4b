"""``offload plan --lora-r`` on a mixture of experts whose experts are fused tensors (``gate_up_proj``,
``down_proj``): PEFT wraps those in a ``lora.ParamWrapper``, whose forward registers and removes a
parametrization on the base weight. Profiling the layers on fake tensors must leave them as they
were (Note: [The layers' own tensors put back] in ``offload/planning/shapes.py``): the plan counts
and sizes the base weights under the adapters too.
"""

from __future__ import annotations

import json

import pytest

from offload.cli.main import main
from offload.cli.plan import parse_args
from offload.cli.plan_models import hf_workload

pytest.importorskip("peft", reason='peft is not installed: pip install -e ".[peft]"')
from .test_transformers import build  # noqa: E402  (skips without transformers)

FLAGS = ("--gpu", "a100", "--host-memory", "8", "--seq-len", "32", "--batch-size", "2")


def planned(capsys, *argv: str) -> dict:
    main(["plan", *argv, *FLAGS, "--json"])
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("kind", ["deepseek_v3"])
def test_lora_on_fused_experts_plans_their_base_weights(kind, tmp_path, capsys):
    hf = build(kind, dropout=0.0)
    hf.config.save_pretrained(tmp_path)
    base = sum(p.numel() for p in hf.parameters())
    work = hf_workload(parse_args(["--hf-config", str(tmp_path), *FLAGS, "--lora-r", "4"]))
    adapters = sum(p.numel() for p in work.layers.parameters() if p.requires_grad)
    assert sum(p.numel() for p in work.layers.parameters() if not p.requires_grad) == base

    lora = planned(capsys, "--hf-config", str(tmp_path), "--lora-r", "4")  # counted after the profile
    assert lora["parameters"] == base + adapters
    # Every slice resident in float32: the base's bytes are in the plan with the adapters' beside them.
    assert lora["chosen"]["memory"]["device_resident"] >= 4 * (base + adapters)
