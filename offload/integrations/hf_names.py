"""The two naming schemes of an :class:`~offload.integrations.causal_lm.OffloadedCausalLM`: the name
tables between its offloaded stages' names and the Hugging Face model's, and ``get_parameter``,
``get_buffer`` and ``get_submodule``, which take either.

They are module-level functions that the class binds as its methods (as it binds the embeddings'
methods of ``causal_lm_embeddings.py``). The state-dict hooks that rename keys are in
``causal_lm.py``; the table of the stages' module names is ``CausalLMSequential``'s
(``transformers_stages.py``). What it does not hold: any name of a ``PeftModel`` around the model
(``base_model.model. ...``), which only ``load_state_dict`` takes (``peft.py``).

Note: [Two naming schemes]
    1. The wrapper's own names are its offloaded stages': ``named_parameters()``,
       ``named_buffers()`` and ``named_modules()`` yield ``offloaded.<stage>.<path in the stage>``
       (``offloaded.1.layer.mlp.up_proj.weight``), and the trainers group and order the parameters
       by them (rule 3 of Note: [What the trainers read from the model] in ``causal_lm.py``). A name
       whose first part is one of the wrapper's own (``offloaded``) resolves as ``nn.Module``
       resolves it, its errors included.
    2. ``state_dict()`` and ``load_state_dict()`` use the Hugging Face model's names
       (``model.layers.0.mlp.up_proj.weight``), so ``get_parameter`` and ``get_buffer`` take them
       too. Both tables go through ``CausalLMSequential.hf_name``, from the stages' state-dict keys
       for the hooks (:func:`state_dict_names`) and from every parameter and buffer for these
       methods (:func:`tensor_names`: a non-persistent buffer too, ``model.rotary_emb.inv_freq``,
       which no state dict holds), so the two cannot drift apart. A Hugging Face name is looked up
       through the wrapper's name: the same object ``named_parameters()`` yields, handed out once
       the pending host update landed (the OffloadModel waits for it, Note: [Overlapped host
       update] in ``offload/optimizer.py``).
    3. ``get_submodule`` of a Hugging Face module path hands out the module a stage holds for it
       (a decoder layer, ``lm_head``, a projection inside a layer): the model's own module, found
       by identity as ``CausalLMSequential`` names its modules, through the wrapper's name.
    4. The containers the stages bypass (``model``, ``model.layers``: Note: [Around the stages] in
       ``causal_lm_guards.py``) are held by no stage and are not handed out: a caller that changed
       them would change nothing the forward runs. They, and names neither scheme knows, raise an
       ``AttributeError`` that names the missing part, the wrapper's scheme with an example, and
       the Hugging Face model's own view, ``model.hf_model``. That is no submodule of the wrapper,
       so what it hands out does not wait for a pending update: after ``optimizer.synchronize()``
       (rule 1 of Note: [The embeddings through the model's own methods]).
    5. A Hugging Face name never reaches ``nn.Module``'s own lookup on the wrapper: its errors name
       the module by ``_get_name()``, the Hugging Face class name here (rule 7 of Note: [What the
       trainers read from the model]), and would say that ``LlamaForCausalLM`` has no ``lm_head``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from ..model import engine_of

__all__ = ["get_buffer", "get_parameter", "get_submodule", "module_names", "state_dict_names", "tensor_names"]


def _stage_layers(model: Any) -> Iterator[tuple[str, nn.Module]]:
    """The OffloadModel's layers (the stages) under their names, ``"0"``, ``"1"``, ...; reads no tensor,
    so it does not wait for a pending update."""
    engine = engine_of(model.offloaded)
    return ((name, layer) for s in engine.slices for name, layer in zip(s.names, s.layers))


def state_dict_names(model: Any) -> dict[str, str]:
    """The OffloadModel's ``state_dict`` keys -> the Hugging Face model's (the state-dict hooks'
    table, Note: [Hugging Face names at any depth] in ``causal_lm.py``)."""
    keys = [key for name, layer in _stage_layers(model) for key in layer.state_dict(prefix=f"{name}.", keep_vars=True)]
    return {key: model.stages.hf_name(key) for key in keys}


def tensor_names(model: Any) -> dict[str, str]:
    """The Hugging Face name -> the OffloadModel's, of every parameter and buffer the stages hold,
    tied and non-persistent ones included (rule 2 of Note: [Two naming schemes])."""
    keys = [key for name, layer in _stage_layers(model)
            for key, _ in itertools.chain(layer.named_parameters(prefix=name, remove_duplicate=False),
                                          layer.named_buffers(prefix=name, remove_duplicate=False))]
    return {model.stages.hf_name(key): key for key in keys}


def module_names(model: Any) -> dict[str, str]:
    """The Hugging Face module path -> the OffloadModel's, of every module a stage holds (rule 3 of
    Note: [Two naming schemes])."""
    held = {id(module): path for name, layer in _stage_layers(model)
            for path, module in layer.named_modules(prefix=name, remove_duplicate=False)}
    return {hf_path: held[id(module)] for hf_path, module in model.hf_model.named_modules(remove_duplicate=False)
            if hf_path and id(module) in held}


def get_parameter(model: Any, target: str) -> nn.Parameter:
    """``OffloadedCausalLM.get_parameter``: as ``nn.Module``'s, for the wrapper's names and the Hugging
    Face model's (Note: [Two naming schemes]).

    Raises:
        AttributeError: a name neither scheme knows, or one that is no parameter.
    """
    return nn.Module.get_parameter(model, _wrapper_name(model, target, tensor_names, "parameter"))


def get_buffer(model: Any, target: str) -> Any:
    """``OffloadedCausalLM.get_buffer``: as ``nn.Module``'s, for the wrapper's names and the Hugging
    Face model's (Note: [Two naming schemes]).

    Raises:
        AttributeError: a name neither scheme knows, or one that is no buffer.
    """
    return nn.Module.get_buffer(model, _wrapper_name(model, target, tensor_names, "buffer"))


def get_submodule(model: Any, target: str) -> nn.Module:
    """``OffloadedCausalLM.get_submodule``: as ``nn.Module``'s, for the wrapper's names and the Hugging
    Face model's modules that a stage holds (Note: [Two naming schemes], rules 3 and 4).

    Raises:
        AttributeError: a name neither scheme knows, or a Hugging Face container no stage holds.
    """
    if target == "":
        return model
    return nn.Module.get_submodule(model, _wrapper_name(model, target, module_names, "submodule"))


def _wrapper_name(model: Any, target: str, table: Callable[[Any], dict[str, str]], kind: str) -> str:
    """``target`` in the wrapper's names: as it is where its first part is the wrapper's own (rule 1
    of the note), else through ``table(model)``, the Hugging Face names' table (rules 2 and 3)."""
    first = target.split(".", 1)[0]
    if first in model._modules or first in model._parameters or first in model._buffers:
        return target
    names = table(model)
    if target in names:
        return f"offloaded.{names[target]}"
    raise AttributeError(_unknown_name(model, target, kind, names))


def _unknown_name(model: Any, target: str, kind: str, names: dict[str, str]) -> str:
    """The message for a name that the wrapper's table does not hold (rule 4 of the note): what is
    missing, the two schemes with the example nearest ``target``, and the Hugging Face model's own view."""
    hf_model = model.hf_model
    found, what = _in_hf_model(hf_model, target)
    if found is not None and isinstance(found, nn.Module) != (kind == "submodule"):
        what = f"it names a {'module' if isinstance(found, nn.Module) else 'tensor'} of the Hugging Face model"
    elif found is not None:
        what = ("the Hugging Face model holds it, but no offloaded stage does: the stages hold its embeddings, "
                "decoder layers, final norm and head one by one, not the containers around them")
    atoms = target.split(".")
    # The example that shares the most leading parts with target (a sibling layer, say), else the first.
    hf_name = max(names, key=lambda name: _shared_parts(name.split("."), atoms), default=None)
    example = "" if hf_name is None else f" (offloaded.{names[hf_name]} is {hf_name})"
    return (
        f"an OffloadedCausalLM wrapping a {type(hf_model).__name__} has no {kind} {target!r}: {what}. It takes two "
        f"names for what its offloaded stages hold: the stages' own, which "
        f"named_{'modules' if kind == 'submodule' else kind + 's'}() yields, and the Hugging Face model's, which "
        f"state_dict() uses{example}. The Hugging Face model itself, containers included, is model.hf_model: no "
        "submodule, so what it hands out does not wait for a pending update; call optimizer.synchronize() before "
        "reading it (Note: [Two naming schemes] in offload/integrations/hf_names.py)")


def _in_hf_model(hf_model: nn.Module, target: str) -> tuple[Any, str]:
    """What ``target`` names in the Hugging Face model (a module or a tensor) and ``""``; or ``None`` and
    where ``target`` leaves the model's tree, said as ``nn.Module`` says it (``... has no attribute `x```)."""
    found: Any = hf_model
    where, path = f"the Hugging Face model ({type(hf_model).__name__})", []
    for atom in target.split("."):
        if not isinstance(found, nn.Module):
            return None, f"{where} is a tensor, not a module"
        found = found._modules.get(atom, found._parameters.get(atom, found._buffers.get(atom)))
        if found is None:
            return None, f"{where} has no attribute `{atom}`"
        path.append(atom)
        where = f"the Hugging Face model's {'.'.join(path)} ({type(found).__name__})"
    return found, ""


def _shared_parts(name: list[str], atoms: list[str]) -> int:
    return next((i for i, (a, b) in enumerate(zip(name, atoms)) if a != b), min(len(name), len(atoms)))
