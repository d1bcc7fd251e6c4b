"""Which of a model's parameters receive gradients from outside it, learned by watching the
backwards that accumulate; what lets backward add a slice's gradients onto an earlier backward's;
which calls of a model one backward runs, and what their walks leave each other.

Note: [Adding onto earlier gradients]
    Rule 6 of Note: [Gradients added in place] (``accumulation.py``) lets backward add a slice's
    gradients into ``.grad`` as they land only where ``.grad`` holds the zeros that
    ``zero_grad(set_to_none=False)`` wrote. Gradient accumulation over several backwards (the
    Hugging Face Trainer's ``gradient_accumulation_steps``, any loop calling backward K times
    before ``step()``) finds ``.grad`` holding the earlier backwards' sum instead. Every slice's
    new gradients then waited on the host beside it until autograd added them after the last
    slice: a second copy of all gradients (4 bytes per float32 parameter) in every backward but
    the first of each step, kept in the pool from one to the next.

    Adding onto earlier gradients on landing gives autograd's ``.grad += new`` bit for bit
    exactly when nothing else contributes to the parameter's gradient in the same backward.
    With a contribution from outside the model (a penalty on the weights, another model sharing
    the parameter) autograd computes ``earlier + (ours + outside)`` and the in-place path
    ``(earlier + ours) + outside``: equal up to rounding, not bit for bit. PyTorch cannot say
    which nodes feed a parameter's accumulation node before they run, so it is learned and
    checked instead:

    1. a backward that accumulates into ``.grad`` watches each of the walk's parameters it does
       not know yet, and each whose gradients it adds onto earlier ones, with a pre-hook on the
       parameter's accumulation node: receiving anything but what backward returned for it
       (nothing, where backward added it in place) means a gradient from outside. At the end of
       the backward the parameter is known *clean* or *outside*;
    2. backward adds a clean parameter's gradients onto earlier ones (rule 6 waived) when no
       other call of the model has a graph alive (two calls in one backward would add their
       parts one after the other, where autograd sums them first);
    3. a clean parameter whose gradients were added onto earlier ones and that then receives one
       from outside (the loss changed: a penalty switched on mid-training) makes the backward
       raise at its end, since ``.grad`` then differs from autograd's in rounding; it is known
       outside from then on and goes through autograd, two copies and all. A loss that uses a
       parameter outside the model from its first backward never raises: that backward, which
       adopts its gradients or adds them into zeros, sees it first;
    4. a backward that fails part way cannot take out what it added onto earlier gradients
       (rule 6's undo needs zeros): its error says to zero the gradients and accumulate again.

    The cost: a pre-hook per watched parameter per backward (about 6 microseconds each on a
    CPU), only in the backwards that add onto earlier gradients once every parameter is known.

    The update in backward (Note: [Update in backward] in ``offload/optimizing/in_backward.py``)
    watches the parameters whose updates it starts the same way, in the backward that ends an
    accumulation, and is told of each that receives a gradient from outside (``on_outside``);
    what that backward sees is learned as well.

Note: [Several calls of the model in one backward]
    A loss may call the model more than once (a siamese pair, a triplet loss, chosen and rejected
    answers): each call is an autograd node of its own, and autograd sums what the calls return
    for a parameter in the order they return it, before it adds the sum into ``.grad``. The
    engine runs ready nodes by descending sequence number, so the last call's backward runs
    first, as the plain model's backward meets the last call's uses first. A walk that adds into
    ``.grad`` itself, or sums a tied weight's slices itself, would change that order where it does
    not know its place among the calls, so each walk of a backward that runs several calls of the
    model records itself there (:func:`calls_in_backward`) and learns which calls are still to
    come:

    1. only the last walk adds into zeroed ``.grad`` in place (rule 6 of Note: [Gradients added
       in place] in ``accumulation.py``): autograd sums the earlier calls' gradients (and an
       outside one that arrived before them), ``s``, and adds it onto ours: ``(0 + ours) + s`` is
       ``0 + (s + ours)``, autograd's own sum. The first walk adding in place would make the
       triplet's ``(c + b) + a`` into ``c + (b + a)``;
    2. a walk with calls to come that take the same tied weight leaves its sum of the weight's
       slices to them (``carried``) instead of returning it, and the next one continues it (Note:
       [A tied weight's gradients summed in place] in ``gradients.py``): returned call by call,
       autograd would add one call's sum onto the other's, ``(h2 + e2) + (h1 + e1)``, where the
       plain model gives ``((h2 + e2) + h1) + e1``;
    3. what is carried goes with the backward's end, or with its failure.

    A backward with one call of the model, the common case, opens no record and carries nothing.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..walk.engine import engines_holding, live_engines

# What is known of a parameter lives on the engines that hold it (``Engine.known_sources``), by id:
# a weak reference to the parameter would stop torch.utils.swap_tensors (load_state_dict and .to()
# under torch.__future__.set_swap_module_params_on_conversion).


@dataclass(frozen=True)
class Verdicts:
    """What the watched backwards judged of the parameters (step 1), by id, read from every live
    engine at once: a backward asks it of each of its model's parameters, and finding one
    parameter's engines (``engines_holding`` copies the live engines' weak set) cost about 1 ms
    a backward of 300 parameters.

    Attributes:
        clean: the parameters every engine holding them saw receive gradients from its model only.
        known: the parameters an engine holding them judged already, clean or outside.
    """

    clean: frozenset[int]
    known: frozenset[int]

    @classmethod
    def now(cls) -> Verdicts:
        engines = live_engines()
        held = frozenset().union(*(e.parameter_ids for e in engines))
        # Not clean where one engine holding the parameter has no verdict, or an outside one.
        doubted = set().union(*(e.parameter_ids - {k for k, clean in e.known_sources.items() if clean}
                                for e in engines))
        known = frozenset().union(*(e.parameter_ids & e.known_sources.keys() for e in engines))
        return cls(held - doubted, known)


#: Each model's calls whose graphs are alive (their Function nodes, by engine).
_CALLS: weakref.WeakKeyDictionary[Any, weakref.WeakSet[Any]] = weakref.WeakKeyDictionary()


def called(engine: Any, node: Any) -> None:
    """Remember a call of ``engine``'s model whose graph has the Function node ``node``."""
    _CALLS.setdefault(engine, weakref.WeakSet()).add(node)


@dataclass
class CallsInBackward:
    """The calls of one model that the running backward runs, as one call's walk sees them (Note:
    [Several calls of the model in one backward]).

    Attributes:
        others: whether it runs another call of the model than this one (step 2 of Note: [Adding
            onto earlier gradients] then adds nothing onto earlier gradients).
        later: the other calls' nodes whose walks have not run yet.
        carried: the tied weights' sums that earlier walks left to this one, by parameter id; what
            this walk leaves to later ones goes there too.
        sure: whether the engine said of every call whether it runs (nothing is left to calls it
            could not say of, which may never come).
    """

    others: bool = False
    later: tuple[Any, ...] = ()
    carried: dict[int, torch.Tensor] = field(default_factory=dict)
    sure: bool = True

    def all_later_take(self, edge: Any) -> bool:
        """Whether each later call has ``edge`` (a parameter's accumulation node) among its own,
        so that its walk receives what this one leaves for that parameter."""
        return self.sure and bool(self.later) and all(any(node is edge for node, _ in other.next_functions)
                                                      for other in self.later)


def calls_in_backward(engine: Any, node: Any) -> CallsInBackward:
    """The calls of ``engine``'s model the running backward runs besides ``node``'s, whose walk
    this is; the walk is recorded as run."""
    will_execute = getattr(torch._C, "_will_engine_execute_node", None)
    if will_execute is None:
        return CallsInBackward(others=True)  # nothing known: nothing carried, nothing added onto earlier
    others, sure = [], True
    for other in list(_CALLS.get(engine, ())):
        if other is node:
            continue
        try:
            runs = bool(will_execute(other))
        except RuntimeError:  # taken as running, and still to come: nothing in place, nothing left to it
            runs, sure = True, False
        if runs:
            others.append(other)
    if not others:
        return CallsInBackward()
    task = _current_task()
    walked = task.walked.setdefault(id(engine), weakref.WeakSet())
    walked.add(node)
    later = tuple(o for o in others if o not in walked)
    return CallsInBackward(True, later, task.carried.setdefault(id(engine), {}), sure)


def _learn(param: torch.Tensor, clean: bool) -> None:
    for engine in engines_holding(param):
        # Once outside, always outside.
        engine.known_sources[id(param)] = clean and engine.known_sources.get(id(param), True)


def identity(t: torch.Tensor | None) -> tuple[Any, ...] | None:
    """What tells a gradient apart from any other alive at the same time: its memory and shape (a
    sum of two contributions is a new tensor)."""
    if t is None:
        return None
    memory = t._values() if t.is_sparse else t
    return (memory.data_ptr(), memory.storage_offset(), tuple(t.shape), t.layout)


@dataclass
class _Watched:
    param: torch.Tensor  # held until the backward ends: a weak reference would stop swap_tensors
    name: str
    onto_earlier: bool
    #: identity of what backward returned for it (``None``: nothing, or added in place)
    expected: tuple[Any, ...] | None = None
    outside: bool = False
    #: told the parameter's name when it receives a gradient from outside (the update in backward)
    on_outside: Callable[[str], None] | None = None


@dataclass
class _Task:
    """What one run of autograd's engine watches, judged at its end, and what the walks of each
    model in it leave each other (Note: [Several calls of the model in one backward])."""

    id: int
    thread: int
    watched: dict[int, _Watched] = field(default_factory=dict)
    hooks: list[Any] = field(default_factory=list)
    #: by engine id: the calls of its model whose walks ran, and the tied weights' sums they left
    walked: dict[int, weakref.WeakSet[Any]] = field(default_factory=dict)
    carried: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)

    def close(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
        # A sum left for a walk that never came (the backward failed) holds a pooled buffer.
        self.carried = {}


#: The backwards running now, by graph task id (a backward per thread at most, but nested ones).
_TASKS: dict[int, _Task] = {}
_LOCK = threading.Lock()


def _current_task() -> _Task:
    """The running backward's watch, opened (with its end's callback queued) on first use."""
    task_id = int(torch._C._current_graph_task_id())
    thread = threading.get_ident()
    with _LOCK:
        task = _TASKS.get(task_id)
        if task is not None:
            return task
        # A backward that failed never reached its end (its callbacks do not run): an earlier
        # task of this thread that is still open is such a one; its hooks must not judge later ones.
        for stale in [t for t in _TASKS.values() if t.thread == thread and t.id < task_id]:
            stale.close()
            del _TASKS[stale.id]
        task = _TASKS[task_id] = _Task(task_id, thread)
    torch.autograd.Variable._execution_engine.queue_callback(lambda: _task_done(task))
    return task


def watch(params: Iterable[tuple[torch.Tensor, bool]], names: Callable[[torch.Tensor], str],
          on_outside: Callable[[str], None] | None = None) -> None:
    """Watch each ``(param, added onto earlier gradients)`` at its accumulation node for the rest of
    the running backward (step 1); ``on_outside`` is told the name of each that receives a
    gradient from outside, when it does."""
    task = _current_task()
    for param, onto_earlier in params:
        if id(param) in task.watched:  # the model's second call in this backward
            watched = task.watched[id(param)]
            watched.onto_earlier |= onto_earlier
            watched.on_outside = watched.on_outside or on_outside
            continue
        watched = task.watched[id(param)] = _Watched(param, names(param), onto_earlier,
                                                     on_outside=on_outside)
        node = torch.autograd.graph.get_gradient_edge(param).node

        def check(grad_inputs: tuple[torch.Tensor | None, ...], watched: _Watched = watched) -> None:
            if identity(grad_inputs[0] if grad_inputs else None) != watched.expected:
                watched.outside = True
                if watched.on_outside is not None:
                    watched.on_outside(watched.name)

        task.hooks.append(node.register_prehook(check))


def returned(params: Iterable[tuple[torch.Tensor, torch.Tensor | None]]) -> None:
    """What backward returns to autograd for each watched parameter (``None``: nothing)."""
    task = _TASKS.get(int(torch._C._current_graph_task_id()))
    if task is None:
        return
    for param, grad in params:
        watched = task.watched.get(id(param))
        if watched is not None and grad is not None:
            # By its memory, not a reference: holding the tensor would make autograd copy it.
            watched.expected = identity(grad)


def abandon() -> None:
    """Stop watching the running backward, which failed (its end's callback never runs)."""
    task_id = int(torch._C._current_graph_task_id())
    with _LOCK:
        task = _TASKS.pop(task_id, None)
    if task is not None:
        task.close()


def _task_done(task: _Task) -> None:
    with _LOCK:
        _TASKS.pop(task.id, None)
    task.close()
    spoiled = []
    for watched in task.watched.values():
        param = watched.param
        if watched.outside and watched.onto_earlier:
            spoiled.append(watched.name)
        _learn(param, not watched.outside)
    if spoiled:
        listing = ", ".join(spoiled[:5]) + (f" and {len(spoiled) - 5} more" if len(spoiled) > 5 else "")
        raise RuntimeError(
            f"OffloadModel: the gradient of {listing} also came from outside the model in this backward (the loss "
            "uses the parameter itself, e.g. a penalty on the weights, or another model shares it), and backward "
            "had added the model's part into .grad as it landed, onto the gradients of earlier backwards (Note: "
            "[Adding onto earlier gradients]): .grad now differs from PyTorch's sum in rounding. From now on these "
            "parameters' gradients go through autograd. Zero the gradients (zero_grad()) and run this accumulation "
            "again.")
