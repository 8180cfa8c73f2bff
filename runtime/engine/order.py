"""The order in which one sparse layer's fetches run: the cache states, a tensor's task and
the list-scheduling priority (the fetcher runs it; the planner's simulator in
runtime.plan.simulate models it).

Every chosen expert tensor is in one cache state; its state decides its tasks::

    full        compute only
    compressed  decompress E -> merge -> compute                 Type II
    sm_only     read E -> decompress -> merge -> compute         Type II
    e_only      read SM -> decompress -> merge -> compute        Type I
    none        read E+SM -> decompress -> merge -> compute      Type I

The priority list (:func:`order`): Type I before Type II, so that the disk starts with Type-I
reads and stays busy while the workers fill with Type-II decompressions::

    none (shortest read first) < e_only (shortest SM read first) < sm_only (shortest E read
    first) < compressed (largest decompression first) < full
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from zipmoe.runtime.engine.states import STATES

TYPE_I = frozenset({"e_only", "none"})
TYPE_II = frozenset({"compressed", "sm_only"})
_READS = frozenset({"none", "e_only", "sm_only"})
_CLASS = {"none": 0, "e_only": 1, "sm_only": 2, "compressed": 3, "full": 4}


@dataclass(frozen=True)
class Task:
    """One chosen expert tensor of a sparse layer, in one cache state."""

    state: str
    nbytes: int  # decoded bf16 bytes (2 x numel)
    e_bytes: int  # stored compressed E bytes
    sm_bytes: int | None = None  # stored SM bytes (numel); None -> nbytes // 2
    expert: Hashable | None = None  # tensors with the same key compute together; None -> alone
    chunks: int = 1  # decompression jobs the runtime splits it into (its E chunks) when L > 1

    def __post_init__(self) -> None:
        if self.state not in _CLASS:
            raise ValueError(f"unknown state {self.state!r}; expected one of {', '.join(STATES)}")
        if int(self.chunks) < 1:
            raise ValueError("Task.chunks must be at least 1")
        if self.sm_bytes is None:
            object.__setattr__(self, "sm_bytes", self.nbytes // 2)
        if self.nbytes < 0 or self.e_bytes < 0 or self.sm_bytes < 0:
            raise ValueError("byte counts must not be negative")

    @property
    def read_bytes(self) -> int:
        """Bytes this task reads from the disk (0 when it reads nothing)."""
        if self.state == "none":
            return self.e_bytes + self.sm_bytes
        if self.state == "e_only":
            return self.sm_bytes
        if self.state == "sm_only":
            return self.e_bytes
        return 0


def priority(state: str, nbytes: int, e_bytes: int, sm_bytes: int) -> tuple[int, int]:
    """A task's place in the priority list, before ties (broken by the task's index): its class
    (none < e_only < sm_only < compressed < full), then the largest decompression first for a
    compressed task (fills the workers, LPT), else the shortest read first (releases decode work
    early). :func:`order` sorts by it; the fetcher's :func:`~zipmoe.runtime.engine.fetch.issue_order`
    computes it straight from a tensor's sizes, with no :class:`Task` per tensor."""
    if state == "compressed":
        return 3, -nbytes
    if state == "none":
        return 0, e_bytes + sm_bytes
    if state == "e_only":
        return 1, sm_bytes
    if state == "sm_only":
        return 2, e_bytes
    return _CLASS[state], 0


def order(tasks: Sequence[Task]) -> list[int]:
    """The priority list: indices of ``tasks``, first = most urgent (see the module docstring)."""
    keys = [(*priority(t.state, t.nbytes, t.e_bytes, t.sm_bytes), i) for i, t in enumerate(tasks)]
    keys.sort()
    return [k[2] for k in keys]
