"""What the trainers switch on an :class:`~offload.integrations.causal_lm.OffloadedCausalLM`: the
training mode, activation checkpointing and input gradients, as a base class of it.

Each is ``PreTrainedModel``'s (or ``nn.Module``'s) method, answered as the offloaded model needs
(Note: [What the trainers read from the model], rule 5, in ``causal_lm.py``): checkpointing and
input gradients are accepted and need nothing more; the training mode reaches the Hugging Face
model's own modules, which are no submodules of the wrapper (rule 1).
"""

from __future__ import annotations

from typing import Any

from torch import nn


class TrainerSwitches:
    """The switches, for a class that is an ``nn.Module`` with ``hf_model``, ``peft_model`` and
    ``activation_checkpointing_requested`` set (``OffloadedCausalLM._adopt``)."""

    hf_model: nn.Module
    peft_model: nn.Module | None
    activation_checkpointing_requested: bool

    def train(self, mode: bool = True) -> Any:
        """As ``nn.Module.train``, reaching the Hugging Face model's own modules too:
        ``model.eval()`` leaves ``model.hf_model.training`` as the plain model's would be, for code
        that reads it there (a pipeline, ``generate``)."""
        super().train(mode)  # type: ignore[misc]
        (self.peft_model or self.hf_model).train(mode)
        return self

    def gradient_checkpointing_enable(self, *args: Any, **kwargs: Any) -> None:
        """Accepted: offloaded slices are recomputed in backward already (rule 5 of the note)."""
        self.activation_checkpointing_requested = True

    def gradient_checkpointing_disable(self) -> None:
        self.activation_checkpointing_requested = False

    activation_checkpointing_enable = gradient_checkpointing_enable
    activation_checkpointing_disable = gradient_checkpointing_disable

    @property
    def is_gradient_checkpointing(self) -> bool:
        return self.activation_checkpointing_requested

    is_activation_checkpointing = is_gradient_checkpointing

    def enable_input_require_grads(self) -> None:
        """Accepted: nothing to do (rule 5 of the note)."""

    def disable_input_require_grads(self) -> None:
        """Accepted: nothing to do."""
