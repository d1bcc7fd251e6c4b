"""Skip tests marked ``cuda`` cleanly when no CUDA device is present, and say why tests skipped."""

from __future__ import annotations

import collections

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        # The marker, not ``item.keywords``: keywords also hold the names of the directories above
        # the test, and a checkout in a directory named ``cuda`` would skip every test.
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


def skip_reason(report: pytest.TestReport) -> str:
    # A skip's longrepr is (file, line, "Skipped: reason").
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    return reason.removeprefix("Skipped: ")


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    # One line per reason, so that a suite run without a GPU or without an extra says so in a few
    # lines (pytest's -rs lists every skipping test location).
    reasons = collections.Counter(skip_reason(r) for r in terminalreporter.stats.get("skipped", []))
    if not reasons:
        return
    terminalreporter.section("skipped, by reason")
    for reason, count in reasons.most_common():
        terminalreporter.line(f"{count:5d}  {reason}")
