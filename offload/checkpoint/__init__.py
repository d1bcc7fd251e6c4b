"""Checkpoints: a training run's state written to a directory and read back.

- ``save_load.py``: :func:`save_checkpoint`, :func:`load_checkpoint`, :func:`latest_checkpoint` and
  :class:`CheckpointError` (Note: [Checkpoint layout]), re-exported by ``offload``;
- ``commit.py``: how a save becomes visible, whole or not at all, and what is tidied after it
  (Note: [Atomic save]);
- ``checkpoint_files.py``: the data files, their checksums, and room and failures of a save
  (Note: [Checkpoint checksums]);
- ``slice_save_planner.py`` / ``slice_load_planner.py``: a disk tier's state saved and loaded
  slice by slice (Note: [Slice-by-slice save], [Slice-by-slice load]).
"""
