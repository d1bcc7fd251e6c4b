"""Hugging Face causal language models, trained by :class:`~offload.OffloadModel`: the public face.

- :func:`causal_lm_sequential`, :class:`CausalLMSequential`, :data:`SUPPORTED_MODEL_TYPES`,
  :data:`LAST_HIDDEN_STATE`: a ``*ForCausalLM`` cut into stages around its own submodules
  (``transformers_stages.py``, Note: [Chunked loss] there; the stages in ``transformers_layers.py``,
  what each family departs from Llama in ``transformers_families.py``, the batch and what travels
  between stages in ``transformers_batch.py``, the masks in ``transformers_masks.py``);
- :func:`load_causal_lm`: a model folder loaded slice by slice (``transformers_loading.py``);
- :class:`OffloadedCausalLM`: the model the Hugging Face trainers train (``causal_lm.py``);
- :func:`parallel_clipping`: a trainer clips with :func:`offload.clip_grad_norm_` (``accelerate_clipping.py``).

Saving sits in ``transformers_saving.py``. This module only gathers the names; the modules it
imports never import it, so any of them may be imported first.
"""

from __future__ import annotations

from .accelerate_clipping import parallel_clipping
from .causal_lm import OffloadedCausalLM
from .transformers_loading import load_causal_lm
from .transformers_batch import LAST_HIDDEN_STATE
from .transformers_families import SUPPORTED_MODEL_TYPES
from .transformers_stages import CausalLMSequential, causal_lm_sequential

__all__ = ["LAST_HIDDEN_STATE", "SUPPORTED_MODEL_TYPES", "CausalLMSequential", "OffloadedCausalLM", "causal_lm_sequential",
           "load_causal_lm", "parallel_clipping"]
