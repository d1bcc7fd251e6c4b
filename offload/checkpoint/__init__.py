"""Checkpoints: a training run's state written to a directory and read back.

The public face is :func:`save_checkpoint`, :func:`load_checkpoint`, :func:`latest_checkpoint` and
:class:`CheckpointError`, re-exported by ``offload``. Each file holds one part, as in
``torch.distributed.checkpoint``:

- ``saver.py``: :func:`save_checkpoint`, the steps of a save;
- ``loader.py``: :func:`load_checkpoint`, the steps of a load;
- ``contents.py``: what a checkpoint holds and how each part is taken from the model, the optimizer
  and the random number generators and put back (Note: [Checkpoint layout]);
- ``checks.py``: what is checked before a save writes or a load loads anything;
- ``ranks.py``: which processes save or load together, and how they agree;
- ``commit.py``: how a save becomes visible, whole or not at all, what is tidied after it, and
  :func:`latest_checkpoint` (Note: [Atomic save]);
- ``checkpoint_files.py``: the data files, their checksums, and room and failures of a save
  (Note: [Checkpoint checksums]);
- ``slice_save_planner.py`` / ``slice_load_planner.py``: a disk tier's state saved and loaded
  slice by slice (Note: [Slice-by-slice save], [Slice-by-slice load]);
- ``wrapped_state.py``: optimizer state kept as a tensor subclass around plain tensors (torchao's
  low-bit moments), saved as those tensors and built again (Note: [Wrapped state]);
- ``framework_wrappers.py``: Lightning Fabric's wrappers of the model and the optimizer, seen
  through at a save and a load;
- ``quant_states.py``: a 4-bit weight's packed quantisation state, checked before a load and set
  after it (Note: [Packed quantisation state]).
"""

from .checkpoint_files import CheckpointError
from .commit import latest_checkpoint
from .loader import load_checkpoint
from .saver import save_checkpoint

__all__ = ["CheckpointError", "latest_checkpoint", "load_checkpoint", "save_checkpoint"]
