"""The custom autograd Function and the state its recompute replays."""

from .function import Call, OffloadFunction
from .replay import AutocastState, capture_rng, replaying_rng

__all__ = ["AutocastState", "Call", "OffloadFunction", "capture_rng", "replaying_rng"]
