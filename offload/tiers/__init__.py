"""A slice's host update and the tiers that hold its state in files around it.

- ``slice_update.py``: the inner ``torch.optim`` optimizer run on one slice's host copies;
- ``disk_tier.py``: optimizer state in files, read before and written after each slice's update
  (Note: [Disk tier pipeline], [Disk tier failures]); beside it, one slice's state and its moves
  between ``optimizer.state``, a buffer and its file (``state_slice.py``), the window of buffers
  (``state_window.py``), and the tier's directory of files (``state_files.py``);
- ``master_files.py``: float32 masters in file mappings (Note: [Masters on disk]); beside it, the
  model's refusal to save after a failed write-back, until a load (``masters_latch.py``).

The direct I/O and the file mappings themselves are in ``offload/streams/disk.py`` and
``offload/streams/mapped.py``; when updates run, in ``offload/optimizer.py``
and ``offload/optimizing/``.
"""
