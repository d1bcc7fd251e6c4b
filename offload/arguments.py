"""Counts a user passes in, checked the same way wherever they are taken.

``OffloadModel`` and the planner take the same settings (slices, microbatches, resident slices),
and the planner promises to refuse what the model refuses, with the same words: a prediction for a
model that cannot be built would mislead. Both check through these functions, which sit below
either so that neither imports the other for them.
"""

from __future__ import annotations


def int_at_least(name: str, value: object, least: int) -> int:
    """``value``, refused unless it is an ``int`` (not a ``bool``) of at least ``least``.

    Raises:
        TypeError: ``value`` is not an ``int``.
        ValueError: ``value < least``.
    """
    _an_int(name, value)
    if value < least:  # type: ignore[operator]
        raise ValueError(f"{name} must be at least {least}, got {value}")
    return value  # type: ignore[return-value]


def resident_count(value: object, num_slices: int) -> int:
    """``value`` as a count of resident slices of ``num_slices``: an ``int`` from 0 to ``num_slices``.

    Raises:
        TypeError: ``value`` is not an ``int``.
        ValueError: ``value`` is out of that range.
    """
    _an_int("resident_slices", value)
    if not 0 <= value <= num_slices:  # type: ignore[operator]
        raise ValueError(f"resident_slices must be between 0 and the number of slices ({num_slices}), got {value}")
    return value  # type: ignore[return-value]


def _an_int(name: str, value: object) -> None:
    # bool is an int to isinstance, and True slices would be one slice by accident.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
