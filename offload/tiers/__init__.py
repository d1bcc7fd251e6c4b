"""A slice's host update and the tiers that hold its state in files around it.

- ``slice_update.py``: the inner ``torch.optim`` optimizer run on one slice's host copies;
- ``disk_tier.py``: optimizer state in files, read before and written after each slice's update
  (Note: [Disk tier pipeline], [Disk tier failures]);
- ``master_files.py``: float32 masters in file mappings (Note: [Masters on disk]).

The direct I/O and the file mappings themselves are in ``offload/streams/disk.py`` and
``offload/streams/mapped.py``; when updates run, in ``offload/optimizer.py``.
"""
