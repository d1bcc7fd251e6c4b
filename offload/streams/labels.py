"""Profiler labels that cost nothing when no profiler is running.

``torch.profiler.record_function`` enters and leaves the profiler's bookkeeping even when nobody
records, and a walk labels every slice, microbatch and copy, so on small slices the labels alone
took a noticeable share of a step. :func:`label` returns
PyTorch's own context manager while a profiler is active, and a no-op otherwise, so traces keep
their ``offload::`` regions.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager

import torch
from torch.profiler import record_function

_profiler_enabled = torch._C._autograd._profiler_enabled


def label(name: str) -> ContextManager[object]:
    """A ``record_function(name)`` region if a profiler is recording, else nothing."""
    if _profiler_enabled():
        return record_function(name)
    return contextlib.nullcontext()
