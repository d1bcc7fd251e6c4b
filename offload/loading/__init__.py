"""Models loaded slice by slice from safetensors checkpoints, never whole in RAM.

- ``sequential.py``: :func:`load_sequential` (re-exported by ``offload``) and the building of a
  model's host copies from a checkpoint (Note: [Loading slice by slice]);
- ``safetensors_files.py``: reading tensors out of safetensors files;
- ``four_bit.py``: linear layers made bitsandbytes 4-bit ones, and 4-bit weights quantised as
  they are read (Note: [Quantizing while loading]).

Hugging Face models are loaded through ``offload/integrations/transformers_loading.py``.
"""
