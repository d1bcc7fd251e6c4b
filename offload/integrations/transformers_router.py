"""A mixture of experts' router logits, carried through the stages for its load-balancing loss.

Note: [Router logits]
    Mixtral and the families built like it (Qwen2-MoE, Qwen3-MoE, OLMoE, GPT-OSS, Granite-MoE,
    PhiMoE, JetMoE, Qwen3-Next, ERNIE 4.5 MoE, FlexOlmo, Flint) add ``router_aux_loss_coef`` times a
    load-balancing loss to the loss when ``output_router_logits`` is asked for. That loss is no sum
    of per-layer terms: it multiplies each expert's share of the routed tokens over all layers by its mean probability
    over all layers, so it needs every layer's router logits at once. The model records them with
    forward hooks on its router modules (those its ``_can_record_outputs["router_logits"]``
    names) and hands them to its family's ``load_balancing_loss_func``.

    The stages do the same:
    1. Each decoder stage hooks the routers of its own layer (:class:`RouterCapture`; the hooks are
       added at the first forward that asks, and record only while their stage runs its layer and
       the batch asks). A recompute in backward records again, into the recomputed state. The hooks
       hold the capture weakly and go with it, so stages cut again from the same model (a second
       ``OffloadedCausalLM``) leave none behind.
    2. What they return travels on in the state as a tuple, one entry per router call in the
       model's order, each reshaped ``B x T x experts`` from the model's ``B*T x experts`` so that
       microbatches join along dim 0 as any output does (Note: [Joining outputs] in
       ``offload/walk/microbatch.py``); the head returns ``(output, *router_logits)``.
    3. The caller (:func:`with_router_loss`, for ``OffloadedCausalLM``) reshapes them back and calls
       the family's own ``load_balancing_loss_func`` with the model's ``num_experts``,
       ``num_experts_per_tok`` and the forward's 2-D attention mask: the model's aux loss, bit for
       bit in one microbatch, and its gradient reaches each router through the slices' boundaries.
    The price is device memory: every router's logits stay on the device from its layer to the
    loss (layers x tokens x experts in the compute dtype: 4 MB for Mixtral's 32 layers of 8
    experts at 8 x 1024 tokens, 100 MB for 48 layers of 128 experts), and each is offloaded to the
    host once for the checkpoints of the slices after its layer (Note: [Leaves that pass through]
    in ``offload/autograd/records.py``, its last item: they need a gradient, so each slice takes
    them in through a copy, which it passes on). A slice whose graph is kept
    (``checkpoint_activation=False``, offloaded activations, the last slice) keeps its copies of
    the logits of every layer before it until backward: with every graph kept, layers x (layers
    - 1) / 2 layers' worth.

    A family whose model returns router logits without such a loss (Llama 4), or whose recorder
    names its routers by layer name, is refused (rule 3 of Note: [What the trainers cannot get
    from the model] in ``transformers_refusals.py``).
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["RouterCapture", "RouterLoss", "flat_router_logits", "router_logits_asked", "router_loss_of",
           "with_router_loss"]


@dataclass(frozen=True)
class RouterLoss:
    """What a family computes its load-balancing loss with: its ``load_balancing_loss_func``, the
    model's expert counts and coefficient, and the classes of the modules that return router logits,
    each with the place of the logits in its output (JetMoE's attention and its experts' gate, in
    some releases)."""

    function: Callable[..., torch.Tensor]
    num_experts: int
    top_k: int
    coefficient: float
    routers: tuple[tuple[type[nn.Module], int], ...]

    def __call__(self, router_logits: tuple[torch.Tensor, ...], attention_mask: torch.Tensor | None) -> torch.Tensor:
        return self.function(router_logits, self.num_experts, self.top_k, attention_mask)


def router_loss_of(model: nn.Module) -> RouterLoss | None:
    """The load-balancing loss of a Hugging Face causal LM (a ``*ForCausalLM``), or ``None`` for a
    model whose family computes none from its router logits as the stages can carry them."""
    function = getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None)
    recorders = (getattr(type(model), "_can_record_outputs", None) or {}).get("router_logits")
    recorders = recorders if isinstance(recorders, list) else [recorders]
    routers = tuple((getattr(r, "target_class", None), getattr(r, "index", 0)) for r in recorders)
    # The model's own attributes, as its forward reads them (JetMoE names its coefficient aux_loss_coef).
    coefficient = getattr(model, "router_aux_loss_coef", getattr(model, "aux_loss_coef", None))
    if (function is None or coefficient is None or not routers
            or any(kind is None for kind, _ in routers) or any(getattr(r, "layer_name", None) for r in recorders)
            or not hasattr(model, "num_experts") or not hasattr(model, "num_experts_per_tok")):
        return None
    return RouterLoss(function, model.num_experts, model.num_experts_per_tok, coefficient, routers)


def refuse_unasked_router_loss(model: nn.Module, router: RouterLoss | None) -> None:
    """Raise for a model whose config asks for router logits (``output_router_logits=True``) that the
    stages will not carry (``router`` is ``None``), saying why for its family: one whose forward adds
    no load-balancing term (GLM-4-MoE, DeepSeek-V3, Llama 4: no ``load_balancing_loss_func``) would
    return the logits only for inspection, the loss the same without them; one whose term the
    stages cannot carry; one whose term they carry where asked (``router_logits``)."""
    if not getattr(getattr(model, "config", None), "output_router_logits", False) or router is not None:
        return
    name = type(model).__name__
    off = ("set config.output_router_logits = False (\"output_router_logits\": false in a saved model's "
           "config.json)")
    if getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None) is None:
        raise ValueError(f"{name} with output_router_logits=True: this model adds no load-balancing term to its loss; "
                         f"it returns its router logits only for inspection, which the stages do not carry. "
                         f"{off}: the loss is the same")
    if router_loss_of(model) is None:
        raise ValueError(f"{name} with output_router_logits=True: the model adds to its loss a load-balancing term "
                         "computed from every layer's router logits, which the stages cannot carry for it (Note: "
                         f"[Router logits]). {off} to train on the language-modelling loss alone")
    # Only causal_lm_sequential's router_logits=False leaves a family with a loss the stages carry here.
    raise ValueError(
        f"{name} with output_router_logits=True: the model adds to its loss a load-balancing term computed from "
        "every layer's router logits, which logits alone do not give. Cut it with router_logits=True and ask for "
        "them (Note: [Router logits]), wrap it in OffloadedCausalLM (which adds the loss as the model does), or "
        f"{off} to train on the language-modelling loss alone")


class RouterCapture:
    """The router modules of one decoder layer, and what they return while :meth:`capturing` (rule 1
    of Note: [Router logits])."""

    def __init__(self, layer: nn.Module, routers: tuple[tuple[type[nn.Module], int], ...]) -> None:
        #: each module of the layer that returns router logits, with their place in its output
        self.routers = [(module, index) for module in layer.modules() for kind, index in routers
                        if isinstance(module, kind)]
        self._hooked = False
        self._captured: list[torch.Tensor] | None = None

    @contextlib.contextmanager
    def capturing(self) -> Iterator[list[torch.Tensor]]:
        if not self._hooked:
            handles = [router.register_forward_hook(_RouterHook(self, index)) for router, index in self.routers]
            weakref.finalize(self, _remove, handles)  # rule 1: the hooks go with the capture
            self._hooked = True
        captured: list[torch.Tensor] = []
        self._captured = captured
        try:
            yield captured
        finally:
            self._captured = None

    def record(self, index: int, output: Any) -> None:
        if self._captured is None:
            return
        logits = output[index] if isinstance(output, tuple) else output
        if logits is not None:  # as the model's recorder skips a None
            self._captured.append(logits)


class _RouterHook:
    """A router's forward hook, holding its :class:`RouterCapture` weakly (rule 1 of Note: [Router
    logits]): a module's hook would otherwise keep the capture, and its stage's, alive with the model."""

    def __init__(self, capture: RouterCapture, index: int) -> None:
        self.capture = weakref.ref(capture)
        self.index = index

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        capture = self.capture()
        if capture is not None:
            capture.record(self.index, output)


def _remove(handles: list[Any]) -> None:
    """Take the hooks off (a function of its own: a finalizer holding the capture would keep it alive)."""
    for handle in handles:
        handle.remove()


def flat_router_logits(carried: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The router logits the head returned (``B x T x experts``), as the model returns them:
    ``B*T x experts`` (rule 3 of Note: [Router logits])."""
    return tuple(logits.reshape(-1, logits.shape[-1]) for logits in carried)


def router_logits_asked(config: Any, kwargs: dict[str, Any]) -> bool:
    """Whether a forward asks for router logits, as the model decides (the call's
    ``output_router_logits`` if given, else the config's); takes the keyword out of ``kwargs``."""
    given = kwargs.pop("output_router_logits", None)
    if given is not None:
        return bool(given)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(text_config, "output_router_logits", False))


def with_router_loss(model: nn.Module, output: Any, carried: Sequence[torch.Tensor],
                     attention_mask: torch.Tensor | None) -> Any:
    """``output`` (a ``CausalLMOutputWithPast``) as ``model``'s forward returns it when asked for router
    logits: a ``MoeCausalLMOutputWithPast`` with the router logits, the load-balancing loss, and that
    loss added to the loss (where there is one) by the model's coefficient (rule 3 of Note: [Router
    logits])."""
    # Here, not at the top: the stages import this module before they say how to install transformers.
    from transformers.modeling_outputs import MoeCausalLMOutputWithPast

    router = router_loss_of(model)
    assert router is not None, "the stages carry router logits only for a family with the loss"
    router_logits = flat_router_logits(carried)
    aux_loss = router(router_logits, attention_mask)
    loss = output.loss
    if loss is not None:
        loss = loss + router.coefficient * aux_loss.to(loss.device)
    return MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux_loss, logits=output.logits, router_logits=router_logits)
