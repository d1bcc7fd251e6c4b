"""Vector clocks: which work is known to have finished before which.

Every agent that runs work in order — the host thread, the compute stream, each side stream — has
a clock that counts its own operations and remembers, for every other agent, how far that agent
had got the last time they were synchronised (an event waited on, a stream waited for, the host
blocking). An operation *happens before* another if the second one's clock has caught up with the
first's count: ``clock[first.agent] >= first.count``. Two accesses to the same memory from
different agents, at least one a write, where neither happens before the other, are a race.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Agent numbers of the two agents that always exist.
HOST = 0
COMPUTE = 1


class VectorClock(dict[int, int]):
    """Agent number → operations of that agent known to have finished (missing means none)."""

    def join(self, other: VectorClock) -> None:
        """Learn everything ``other`` knows."""
        for agent, count in other.items():
            if self.get(agent, 0) < count:
                self[agent] = count

    def tick(self, agent: int) -> int:
        """Count one more operation of ``agent`` (the owner of this clock); return its number."""
        self[agent] = self.get(agent, 0) + 1
        return self[agent]

    def copy(self) -> VectorClock:
        return VectorClock(self)


@dataclass(frozen=True)
class Epoch:
    """One operation: which agent did it and its number there, with a description for reports."""

    agent: int
    count: int
    what: str

    def happens_before(self, clock: VectorClock) -> bool:
        """Whether an agent whose clock is ``clock`` knows this operation has finished."""
        return clock.get(self.agent, 0) >= self.count
