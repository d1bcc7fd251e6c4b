"""Where a parameter or buffer is registered: :class:`Site`.

Host storage (``host_storage.py``) keeps each host copy's sites so that loading and tying can put
tensors back where the user's modules look for them; binding (``offload/walk/binding.py``) swaps device
copies into the same sites for a run. The type sits here, in the lowest layer that uses it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Site:
    """One place a tensor is registered: ``module._parameters[name]`` or ``module._buffers[name]``."""

    module: nn.Module
    name: str
    is_parameter: bool

    def table(self) -> dict[str, torch.Tensor | None]:
        return self.module._parameters if self.is_parameter else self.module._buffers  # type: ignore[return-value]
