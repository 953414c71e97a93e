"""An undo log of host-state changes: what a failed step needs to put the allocator and the prefix cache back.

While a :class:`Journal` is attached (``allocator.journal = journal``, ``cache.journal = journal``), every change
:class:`dtkv.PageAllocator` and :class:`dtkv.PrefixCache` make records how to undo itself (a closure, appended in
the order of the changes); :meth:`Journal.rollback` runs them newest first, which puts both back exactly as they
were when the journal was attached: free lists, reference counts, the balanced-allocation cursor, the tree, its
clock and last uses, and the counters in ``stats``. Recording costs one append per change; only a rollback walks
the log (:mod:`dtkv.runtime._outcome` uses it for a step every rank rolls back together).

The log is host-side and identical on every rank of a CP group while the SPMD contract holds, like the state it
undoes.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["Journal"]


class Journal:
    """Undo closures of the changes made while attached; :meth:`rollback` runs them newest first."""

    __slots__ = ("_undo",)

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def __len__(self) -> int:
        return len(self._undo)

    def record(self, undo: Callable[[], None]) -> None:
        """Add the undo of a change just made."""
        self._undo.append(undo)

    def rollback(self) -> None:
        """Undo every recorded change, newest first; the journal is empty afterwards."""
        while self._undo:
            self._undo.pop()()
