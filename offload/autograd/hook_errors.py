"""The note on an error that a parameter's own gradient hook raises after backward started the
optimizer's update: autograd runs those hooks once the Function has returned, past the walk that
notes its own errors (``BackwardGradients.__exit__`` in ``gradients.py``).

Note: [Hook errors after updates started]
    The backward that starts the optimizer's update (Note: [Update in backward] in
    ``offload/optimizing/in_backward.py``) hands each slice's update to the host worker as its
    gradients land. An error raised inside the walk after that leaves the parameters mixing two
    steps, and the walk adds a note saying so (:data:`UPDATES_MAY_HAVE_RUN`). A parameter's
    gradient hooks (``register_hook``, ``register_post_accumulate_grad_hook``) run later, when
    autograd accumulates the gradients the Function returned: one that raises leaves the same mix
    (its slice's update waits for ``step()``, the others' ran), and PyTorch offers no place to see
    an error of the engine's on its way to the caller.

    So when the Function returns from such a backward, each hook of the walk's parameters is
    wrapped, in place in the parameter's own dictionary of hooks (so a handle's ``remove()`` still
    finds it), by a :class:`_NotingHook` that adds the note to what the hook raises, the user's own
    exception, and re-raises it. The wrappers go at the backward's end (a callback of the engine),
    or as soon as one raises; one left behind by a backward that failed elsewhere (the engine's
    callbacks then never run) puts its hook back the next time autograd calls it, and calls it as
    it is. A hook runs as before: the same arguments, the same result.
"""

from __future__ import annotations

from collections.abc import Iterable, MutableMapping
from typing import Any

import torch

#: The note of an error raised after this backward may have started updates (Note: [Hook errors
#: after updates started]); the walk's own errors carry it too.
UPDATES_MAY_HAVE_RUN = (
    "OffloadModel: this backward was to start the optimizer's update (update_in_backward): the update of the "
    "slices whose gradients had landed may have run with this backward's gradients, and their .grad may hold "
    "them. Reload the last checkpoint before training on.")


class _NotingHook:
    """A gradient hook of a parameter, for the rest of one backward: what it raises carries
    :data:`UPDATES_MAY_HAVE_RUN`."""

    def __init__(self, hook: Any, hooks: MutableMapping[Any, Any], key: Any, task: int,
                 siblings: list[_NotingHook]) -> None:
        self.hook = hook
        self._hooks, self._key, self._task = hooks, key, task
        self._siblings = siblings  # the backward's other wrappers, all put back when one raises

    def __call__(self, *args: Any) -> Any:
        if int(torch._C._current_graph_task_id()) != self._task:
            # Left behind by a backward that failed elsewhere (its end's callback never ran).
            self.restore()
            return self.hook(*args)
        try:
            return self.hook(*args)
        except BaseException as error:
            if UPDATES_MAY_HAVE_RUN not in getattr(error, "__notes__", ()):
                error.add_note(UPDATES_MAY_HAVE_RUN)
            _restore(self._siblings)
            raise

    def restore(self) -> None:
        """Put the hook back, unless it was removed or replaced since."""
        if self._hooks.get(self._key) is self:
            self._hooks[self._key] = self.hook


def note_hook_errors(params: Iterable[torch.Tensor]) -> None:
    """For the rest of the running backward, have what the gradient hooks of ``params`` raise
    say that updates may have run (Note: [Hook errors after updates started])."""
    task = int(torch._C._current_graph_task_id())
    wrappers: list[_NotingHook] = []
    seen: set[int] = set()
    for p in params:
        if id(p) in seen:
            continue  # a weight tied across slices
        seen.add(id(p))
        for hooks in (p._backward_hooks, getattr(p, "_post_accumulate_grad_hooks", None)):
            for key, hook in list((hooks or {}).items()):
                if isinstance(hook, _NotingHook):
                    if hook._task == task:
                        continue  # the model's second call in this backward wrapped it already
                    hook = hook.hook
                hooks[key] = _NotingHook(hook, hooks, key, task, wrappers)
                wrappers.append(hooks[key])
    if wrappers:
        torch.autograd.Variable._execution_engine.queue_callback(lambda: _restore(wrappers))


def _restore(wrappers: list[_NotingHook]) -> None:
    for wrapper in wrappers:
        wrapper.restore()
