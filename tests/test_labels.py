"""Profiler labels: present in traces, absent (and free) otherwise."""

from __future__ import annotations

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from offload import OffloadModel
from offload.streams.labels import label


def test_traces_show_the_walk_regions():
    model = OffloadModel(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)), device="cpu", num_slices=2)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model(torch.randn(3, 4)).sum().backward()
    names = {event.name for event in prof.events()}
    for expected in ("offload::forward slice 0", "offload::forward slice 1", "offload::backward slice 0",
                     "offload::load slice 1", "offload::offload gradients slice 0", "offload::offload activation"):
        assert expected in names, f"{expected} missing from the trace"


def test_labels_are_no_ops_without_a_profiler():
    with label("offload::anything") as region:
        assert region is None  # contextlib.nullcontext yields None; record_function yields itself
    with profile(activities=[ProfilerActivity.CPU]):
        with label("offload::anything") as region:
            assert region is not None
