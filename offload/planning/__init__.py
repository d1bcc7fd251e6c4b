"""Memory: measured by category, predicted before building, and the models benchmarks build.

- ``footprint.py``: :class:`MemoryFootprint`, a model's memory by category;
- ``planner.py``: :func:`estimate_memory`, the footprint predicted without building the model;
- ``presets.py``: the named models the benchmarks and profiles build.
"""
