"""The parameters a model let go of while an ``OffloadOptimizer`` built before still steps them.

What it holds: the record a new layout leaves (:func:`noting_let_go`, around an ``Engine.refresh``)
and the lookup the optimizer's plan makes (:func:`let_go_name`). What it does not: the refusal
itself (``plan.py``), and the layout (``Engine.refresh`` in ``offload/walk/engine.py``).

Note: [Parameters replaced after the optimizer]
    An optimizer holds the ``nn.Parameter`` objects it was given. A parameter replaced in the model
    after it was built leaves the optimizer stepping the old object, which the model no longer
    holds: the new one never trains, and nothing fails, in plain PyTorch too. TRL's
    ``SFTConfig(chat_template_path=...)`` resizes the embeddings inside ``SFTTrainer(...)``, after
    ``optimizers=(model.offload_optimizer(args), None)`` was built: the documented recipe met it
    silently.
    1. Where the library itself replaces parameters, the new layout that follows is noted:
       ``OffloadedCausalLM``'s embedding methods (``resize_token_embeddings``,
       ``set_input_embeddings``, ``set_output_embeddings``, ``tie_weights``, which TRL and
       transformers call) refresh the engine at once, inside :func:`noting_let_go`, which notes
       each parameter the slices no longer hold for each ``OffloadOptimizer`` of the model that
       holds it, under its name in the old layout. (A parameter the user replaces by hand is
       followed at the next forward's refresh, unnoted, as plain PyTorch leaves it.)
    2. The optimizer's plan (``slice_steps`` in ``plan.py``, made anew at the next ``step()``,
       since the slices changed) refuses a parameter so noted that the slices do not hold again:
       the error names it and says to build the optimizer after the change.
    3. The note holds the parameter itself, not its id (an id is reused once the object dies), and
       lives as long as the optimizer: a weak key, so a dropped optimizer takes the old tensors
       with it. Parameters never in the model (stepped outside it, on purpose) are never noted.
    4. A copy of the optimizer (``copy.deepcopy``, a pickle: Note: [Copying an OffloadOptimizer] in
       ``copying.py``) keeps the old tensor, copied, among its groups, since the model's copy does
       not hold it either: the note goes with it (:func:`noted_let_go` in the original,
       :func:`carry_let_go` in the copy, under the copied tensor), so the copy refuses to step it as
       the original does, and a copy of an optimizer that refuses nothing keeps working.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["carry_let_go", "let_go_name", "noted_let_go", "noting_let_go"]

#: Per optimizer: id of a parameter the model let go of -> (that parameter, its name in the old layout).
_LET_GO: weakref.WeakKeyDictionary[Any, dict[int, tuple[torch.Tensor, str]]] = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def noting_let_go(engine: Any) -> Iterator[None]:
    """Around ``engine``'s refresh: note the parameters it no longer holds after a new layout for the
    optimizers that step them (rule 1 of Note: [Parameters replaced after the optimizer]). Every
    forward refreshes: what it reads before is two references a slice, the rest only after a layout."""
    ids = engine.parameter_ids  # a new layout builds a new set
    entries = [(s.index, s.storage.params) for s in engine.slices]  # and a new list a slice it lays out
    yield
    if engine.parameter_ids is ids:
        return
    gone = ids - engine.parameter_ids
    for optimizer in list(engine.optimizers):
        # An id from before names the same object here: the optimizer held it all along.
        held = {id(p): p for group in optimizer.param_groups for p in group["params"] if id(p) in gone}
        if held:
            names = _names(engine, entries, held)
            _LET_GO.setdefault(optimizer, {}).update({i: (p, names[i]) for i, p in held.items()})


def let_go_name(engine: Any, p: torch.Tensor) -> str | None:
    """The name ``p`` had in ``engine``'s slices if the model let it go while an optimizer of it held
    ``p`` (rule 2 of the note); ``None`` otherwise."""
    for optimizer in list(engine.optimizers):
        noted = _LET_GO.get(optimizer, {}).get(id(p))
        if noted is not None and noted[0] is p:
            return noted[1]
    return None


def noted_let_go(optimizer: Any, p: torch.Tensor) -> str | None:
    """The name noted for ``p`` in ``optimizer``'s note, for the copy to carry (rule 4); ``None`` if not noted."""
    noted = _LET_GO.get(optimizer, {}).get(id(p))
    return noted[1] if noted is not None and noted[0] is p else None


def carry_let_go(optimizer: Any, p: torch.Tensor, name: str) -> None:
    """Note ``p`` (the copy of a tensor the original's note held) as let go under ``name``, for
    ``optimizer`` (the copy): it refuses to step it as the original does (rule 4)."""
    _LET_GO.setdefault(optimizer, {})[id(p)] = (p, name)


def _names(engine: Any, entries: list[tuple[int, list[Any]]], held: dict[int, torch.Tensor]) -> dict[int, str]:
    """Each of ``held``'s names in the layout before, with its shape (a replaced module is no longer
    in the model, so it may be named by its type alone)."""
    names = {i: f"a parameter of shape {tuple(p.shape)}" for i, p in held.items()}
    for index, params in reversed(entries):  # a tied parameter by its first slice
        for entry in (entry for entry in params if id(entry.tensor) in held):
            where = engine.slices[index].site_name(entry.sites[0])
            names[id(entry.tensor)] = f"{where} of shape {tuple(entry.tensor.shape)} in slice {index}"
    return names
