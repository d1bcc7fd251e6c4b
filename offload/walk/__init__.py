"""One model's slices and their walk through the device slots.

- ``slicing.py``: cutting layers into slices;
- ``engine.py``: a model's slices (``Slice``) and the machinery that serves them (copy engine,
  device slots, host buffers, offloaders, pending host updates); no per-call state;
- ``binding.py``: the user's layers run on device copies; ``module_state.py``: what a run changed
  in a module's buffers and attributes;
- ``activation_policy.py``: what each slice keeps for backward (recompute, kept graph, offload);
- ``slice_walk.py``: one walk of the slices through the slots (Note: [The walk], [Buffers]);
- ``claims.py``: which thread holds a model's engine for a forward, backward or move (Note: [One
  walk at a time] in ``slice_walk.py``);
- ``structures.py``: an input, boundary activation or output taken apart into leaves and put
  back together;
- ``microbatch.py``: a batch split into microbatches and joined again;
- ``milestones.py``: what a walk announces (a slice's gradients ready on the host, ...);
- ``streamed.py``: the forward that keeps no graph.

What runs on each slice for autograd lives in ``offload/autograd/``; moving tensors and ordering
the moves, in ``offload/streams/``.
"""
