"""The custom autograd Function, what its forward leaves for backward, and the state its recompute replays."""

from .call import Call, flatten_input
from .function import OffloadFunction
from .replay import AutocastState, capture_rng, replaying_rng

__all__ = ["AutocastState", "Call", "OffloadFunction", "capture_rng", "flatten_input", "replaying_rng"]
