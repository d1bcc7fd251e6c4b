"""An :class:`~offload.integrations.causal_lm.OffloadedCausalLM`'s ``config``, ``generation_config`` and ``vocab_size``:
the wrapped Hugging Face model's own, read and written there.

What it does not hold: loading them from a folder (``load_causal_lm`` in ``transformers_loading.py``)
and writing them (``save_causal_lm`` in ``transformers_saving.py``, or the model's ``save_pretrained``).

Note: [The model's configs, not copies]
    ``save_pretrained`` (so ``Trainer.save_model`` and every checkpoint) writes the Hugging Face
    model's ``config`` and ``generation_config``, and the forward reads the model's config. An
    attribute of the wrapper's own, set once at wrapping, would part from them at the first
    assignment: ``model.generation_config = GenerationConfig(...)``, the transformers idiom, would
    show on the wrapper and silently not be saved. So both are properties that read and assign the
    model's attribute: assigning one on the wrapper is assigning it on the model, which behaves as
    assigning it on the plain model does (its layers keep the config object they were built with,
    there too). Settings changed in place (``model.generation_config.max_new_tokens = 64``) reach
    the same object either way.
"""

from __future__ import annotations

from typing import Any

__all__ = ["config", "generation_config", "vocab_size"]


def _config(model: Any) -> Any:
    return model.hf_model.config


def _set_config(model: Any, value: Any) -> None:
    model.hf_model.config = value


def _generation_config(model: Any) -> Any:
    return getattr(model.hf_model, "generation_config", None)  # None for a model that cannot generate


def _set_generation_config(model: Any, value: Any) -> None:
    model.hf_model.generation_config = value


#: ``OffloadedCausalLM.config``: the Hugging Face model's (Note: [The model's configs, not copies]).
config = property(_config, _set_config, doc="The Hugging Face model's config, read and assigned there.")

#: ``OffloadedCausalLM.generation_config``: the Hugging Face model's (Note: [The model's configs, not copies]).
generation_config = property(_generation_config, _set_generation_config,
                             doc="The Hugging Face model's generation config, read and assigned there "
                                 "(``save_pretrained`` writes it).")


def _vocab_size(model: Any) -> Any:
    return model.hf_model.vocab_size  # an AttributeError, for a model without one, is answered with advice


#: ``OffloadedCausalLM.vocab_size``: the Hugging Face model's, which ``resize_token_embeddings`` changes
#: (TRL's ``clone_chat_template`` reads it right after): a property, not a copy taken at wrapping.
vocab_size = property(_vocab_size, doc="The Hugging Face model's vocab_size, read there.")
