"""One step, one outcome on every rank: the ranks vote after the run, then all keep the step or all undo it.

A step changes host state on every rank (requests' pages and ``num_computed``, the allocator, the prefix cache,
``stats``) and device state (KV rows). When the run fails on one rank only -- an out-of-memory error in the LM
head of one GPU, after the step's last collective -- the others have finished it; each rank deciding alone would
leave the ranks at different positions of the same requests (stepping them from there with no error, or failing
every later step). :class:`StepOutcome` wraps a step (plan, run, commit) instead:

1. on entry it attaches a :class:`dtkv._journal.Journal` to the allocator and the prefix cache and notes each
   request's page count and ``num_computed`` and the runtime's ``stats``;
2. the step runs and commits (``num_computed``, cache insertions, counters) as usual; the bytes of cached pages
   the step evicted and took back for its own KV are copied first (:meth:`StepOutcome.keep_pages`, this rank's own
   pages only: the step overwrites them);
3. on exit every rank votes (:func:`vote`: its error or success, and the state it committed); when every rank
   succeeded with equal state the step stands; otherwise every rank raises the same error and rolls back:
   the journal undoes every allocator and cache change (free lists, reference counts, the balanced-allocation
   cursor, evictions, insertions, the LRU clock), the requests get their pages and ``num_computed`` back, the
   copied pages their bytes, ``stats`` its counts. KV rows the step wrote past a request's ``num_computed`` stay
   in pages it holds or in free pages: nothing reads them before a step writes them again.

**The vote** is one collective per step: the 48-byte header all-gather of :func:`dtkv._agree.agree` on the CP
group's CPU channel (a status byte and a digest of the committed state; the payloads travel only when a rank
failed or the digests differ); the rule: no rank keeps a step that another undoes.

**Off the decode critical path** (``StepOutcome(..., defer=True)``, what :meth:`dtkv.runtime.Runtime.decode` uses):
a step that succeeded locally starts its vote on leaving the block and returns at once
(:func:`dtkv._agree.agree_async`); the GPU runs the step (a CUDA graph's replay is asynchronous) while the header
all-gather travels, and :meth:`StepOutcome.settle` waits for the verdict before the step's tokens are taken: on a
failure or a mismatch every rank rolls back and raises there, as above. A step that failed locally votes at once
(its peers, deferred, meet it in the same collective). The vote also carries the batch's request ids, so that it
compares exactly what the next step's input agreement would (:func:`dtkv.runtime._batch.batch_value`): the decode
loop skips that agreement for the steps it runs next, whose inputs follow from the voted state on every rank alike.

Limits: an error *before* the step's last collective leaves the other ranks waiting in that collective (until the
process group's timeout, like any collective a rank never joins); ``KeyboardInterrupt`` and other non-``Exception``
errors are rolled back on their own rank and raised without a vote.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dtkv._agree import PendingAgreement, agree, agree_async
from dtkv._collectives import cpu_channel
from dtkv._journal import Journal

__all__ = ["StepOutcome", "committed_state", "vote", "vote_async"]


def vote(group, error: BaseException | None, *, what: str, value: object = None) -> None:
    """Every rank's outcome of one step (collective over ``group``'s CPU channel, ``None``: one process).

    Returns on every rank when every rank passed ``error=None`` and an equal ``value``; else raises on every
    rank: each its own error when every rank failed alike (an error the step raised on every rank together), else
    the first failing rank's error type naming every failing rank, or :class:`dtkv.ConfigMismatchError` for
    unequal values.
    """
    channel = None
    if group is not None:
        channel = cpu_channel(group)
    agree(error, channel, what=what, value=value, keep_common=True)


def vote_async(group, error: BaseException | None, *, what: str, value: object = None) -> PendingAgreement:
    """:func:`vote` started and not waited for (:meth:`dtkv._agree.PendingAgreement.wait` gives the verdict)."""
    return agree_async(error, None if group is None else cpu_channel(group), what=what, value=value,
                       keep_common=True)  # fmt: skip


def committed_state(runtime, reqs: Sequence) -> dict[str, object]:
    """What every rank must hold after a step: the requests, each one's ``num_computed`` and page count, the free
    pages (what the next step's input agreement compares: :func:`dtkv.runtime._batch.batch_value`)."""
    return {
        "rids": [int(r.rid) for r in reqs],
        "num_computed": [int(r.num_computed) for r in reqs],
        "num_pages": [len(r.pages) for r in reqs],
        "free_pages": runtime.allocator.num_free(),
    }


class StepOutcome:
    """A step of ``runtime`` over ``reqs`` that every rank keeps or every rank undoes (see the module docstring).

    Use as ``with StepOutcome(runtime, reqs, what="Runtime step") as outcome: ...``; leaving the block votes
    (collective) and raises on every rank when the step failed on any.
    """

    def __init__(self, runtime, reqs: Sequence, *, what: str, defer: bool = False) -> None:
        self.runtime, self.reqs, self.what = runtime, list(reqs), what
        self.defer = bool(defer)
        """A step that succeeded locally votes asynchronously: :meth:`settle` gives the verdict."""
        self._pending: PendingAgreement | None = None
        self.journal = Journal()
        self.evicted: list[int] = []
        """Pages the step's evictions freed (the runtime's :mod:`dtkv.runtime._prefix` adds them)."""
        self._before: list[tuple[int, int]] = []
        self._stats: dict[str, int] = {}
        self._kept: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def __enter__(self) -> StepOutcome:
        rt = self.runtime
        self._before = [(len(r.pages), r.num_computed) for r in self.reqs]
        self._stats = dict(rt.stats)
        rt.allocator.journal = self.journal
        if rt.prefix_cache is not None:
            rt.prefix_cache.journal = self.journal
        rt._outcome = self
        return self

    def keep_pages(self) -> None:
        """Copy this rank's bytes of the cached pages the step evicted and took for its own KV (plan phase, before
        the run writes them), so that a rollback gives the cache back its pages with their KV."""
        rt = self.runtime
        if not self.evicted:
            return
        taken = {p for r, (n, _) in zip(self.reqs, self._before) for p in r.pages[n:]}
        own, rank = rt.ownership, rt.pool.rank
        mine = [p for p in dict.fromkeys(self.evicted) if p in taken and int(own.owner(p)) == rank]
        if not mine:
            return
        idx = torch.tensor([int(own.local_index(p)) for p in mine], dtype=torch.int64, device=rt.device)
        for name in sorted(rt.pool.layouts):
            buf = rt.pool.buffer(name)
            self._kept.append((buf, idx, buf.index_select(1, idx)))

    def _detach(self) -> None:
        rt = self.runtime
        rt.allocator.journal = None
        if rt.prefix_cache is not None:
            rt.prefix_cache.journal = None
        rt._outcome = None

    def _rollback(self) -> None:
        rt = self.runtime
        self.journal.rollback()
        for r, (n, computed) in zip(self.reqs, self._before):
            del r.pages[n:]
            r.num_computed = computed
        rt.stats.clear()
        rt.stats.update(self._stats)
        for buf, idx, saved in self._kept:
            buf.index_copy_(1, idx, saved)
        self._kept = []

    def __exit__(self, exc_type, exc, tb) -> None:
        self._detach()
        if exc is not None and not isinstance(exc, Exception):
            self._rollback()
            return
        if self.runtime.group is None:  # one process: nothing to agree on
            if exc is not None:
                self._rollback()
            self._kept = []
            return
        try:
            value = committed_state(self.runtime, self.reqs) if exc is None else None
            if self.defer and exc is None:
                self._pending = vote_async(self.runtime.group, None, what=self.what, value=value)
                return
            vote(self.runtime.group, exc, what=self.what, value=value)
        except BaseException:
            self._rollback()
            raise
        self._kept = []

    def settle(self) -> None:
        """Wait for a deferred vote (collective, every rank): return when the step stands on every rank, else roll
        it back and raise on every rank (what leaving the block does without ``defer``). A no-op otherwise."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.wait()
        except BaseException:
            self._rollback()
            raise
        self._kept = []
