"""The embeddings of an :class:`~offload.integrations.causal_lm.OffloadedCausalLM`: the methods of
``PreTrainedModel`` that read or change its input embedding and ``lm_head``.

Each is the wrapped Hugging Face model's own method, called once the pending host update landed,
and, where it may change a module or a parameter, followed by a new layout of the slices. They are
module-level functions that the class binds as its methods (as it binds ``__getattr__``). The
stages are cut in ``transformers_stages.py``; the rest of the wrapper is in ``causal_lm.py``.

Note: [The embeddings through the model's own methods]
    1. The Hugging Face model is no submodule of the wrapper (rule 1 of Note: [What the trainers
       read from the model] in ``causal_lm.py``): what it hands out does not wait for pending
       updates as ``parameters()`` does, so every method settles the OffloadModel first. A resize
       copies the old rows; a re-tie keeps the embedding's values; a new module replaces one whose
       update must not land on it afterwards.
    2. A module set in the model's place (``set_input_embeddings``, ``set_output_embeddings``, the
       new embedding of ``resize_token_embeddings``) goes into its stage by the registration hook
       of ``transformers_stages.py`` (``_Replacements``); a parameter set on a module (``tie_weights``
       setting ``lm_head.weight``) changes the module the stage holds. Either way the slices that
       held the old tensors are laid out again at once (``refresh``), so that ``parameters()``, an
       optimizer built next and the next forward see the new ones.
    3. ``tie_weights`` is the model's own too, not a no-op: tied embeddings are tied when the model
       is cut, but a tie broken later (``load_state_dict(..., assign=True)`` breaks it, as in plain
       PyTorch) is tied again only by it, as the plain model's ``tie_weights()`` ties it again. A model
       untied on purpose (``untie_embeddings=True``) has its config say so, and stays untied; one
       loaded from a checkpoint whose stored head differs is tied by ``tie_weights()`` as the plain
       model loaded from it is (its config still says tied).
    4. A parameter replaced so (the old embedding's, ``lm_head``'s) is noted for the
       ``OffloadOptimizer`` built before that still holds it, whose next ``step()`` refuses to step
       it (Note: [Parameters replaced after the optimizer] in ``offload/optimizing/let_go.py``):
       the new one would never train. Build the optimizer after the change.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..model import engine_of
from ..optimizing.let_go import noting_let_go

__all__ = ["get_input_embeddings", "get_output_embeddings", "resize_token_embeddings", "set_input_embeddings",
           "set_output_embeddings", "tie_weights"]


def get_input_embeddings(model: Any) -> nn.Module:
    """The model's input embedding, once the pending update landed (rule 1 of the note)."""
    model.offloaded._settle()
    return model.hf_model.get_input_embeddings()


def get_output_embeddings(model: Any) -> nn.Module:
    """The model's ``lm_head``, once the pending update landed (rule 1 of the note)."""
    model.offloaded._settle()
    return model.hf_model.get_output_embeddings()


def set_input_embeddings(model: Any, value: nn.Module) -> None:
    """The model's own ``set_input_embeddings``: ``value`` trains in the embedding's stage (rule 2 of the note)."""
    _through_the_model(model, "set_input_embeddings", value)


def set_output_embeddings(model: Any, new_embeddings: nn.Module) -> None:
    """The model's own ``set_output_embeddings``: ``new_embeddings`` trains as the head's ``lm_head``
    (rule 2 of the note)."""
    _through_the_model(model, "set_output_embeddings", new_embeddings)


def resize_token_embeddings(model: Any, *args: Any, **kwargs: Any) -> nn.Embedding:
    """The model's own ``resize_token_embeddings`` (embeddings, ``lm_head``, ``config.vocab_size``)
    once the pending update landed (it copies the old rows); their slices are laid out again."""
    return _through_the_model(model, "resize_token_embeddings", *args, **kwargs)


def tie_weights(model: Any, *args: Any, **kwargs: Any) -> None:
    """The model's own ``tie_weights``: ``lm_head`` tied to the input embedding again where the
    config ties them and a tie was broken since (rule 3 of the note)."""
    _through_the_model(model, "tie_weights", *args, **kwargs)


def _through_the_model(model: Any, method: str, *args: Any, **kwargs: Any) -> Any:
    """``model.hf_model``'s ``method`` called with the arguments between a settle and a new layout
    (rules 1 and 2 of the note)."""
    model.offloaded._settle()
    result = getattr(model.hf_model, method)(*args, **kwargs)
    engine = engine_of(model.offloaded)
    with noting_let_go(engine):  # an optimizer built before must not step what was replaced (rule 4)
        engine.refresh()
    return result
