"""Decode-side attempts and the quarantine of failed ones (the rule is in :mod:`dtkv.transfer.protocol`).

When a request fails on decode, engine calls that a prefill rank abandoned after a timeout may still be writing
its pages, its metadata slot and its staging region. :class:`Quarantine` keeps such attempts until every prefill
rank that claimed a slot reported DRAINED, or until the grace period of the slowest one passed since the abort
took effect (its send window plus its longest engine call plus :data:`dtkv.transfer.protocol.GRACE_MARGIN_S`).
An attempt whose bind (a decode rank's READY compare-and-set) was still running when its caller gave up is held
the same way: its abort runs once the bind resolved, and tells which senders to wait for.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from dtkv.transfer.errors import format_pages
from dtkv.transfer.messages import Claim
from dtkv.transfer.protocol import GRACE_MARGIN_S, AttemptKeys, SendProgress

__all__ = ["PostedAttempt", "Quarantine", "check_not_pending"]


@dataclass(eq=False)
class PostedAttempt:
    """One request posted on a decode receiver: its pages, staging grants, the claims it answered and, once failed,
    its abort. Fields marked *(store worker)* are written only by store calls, which run in order on one thread."""

    request_id: str
    dst: np.ndarray
    """int64 ``[num_positions]``: the request's decode pages (every rank's)."""
    mine: np.ndarray
    """The pages of ``dst`` stored on the ranks hosted here (what a quarantine holds)."""
    num_tokens: int | None
    meta_slot: int | None
    staging: dict[int, bool]
    """hosted decode rank -> whether its staging region is granted to this attempt."""
    keys: AttemptKeys | None = None
    """The attempt in the store (``None``: this receiver is not a party of any attempt yet). *(store worker)* for
    a decode rank other than 0."""
    bound: tuple[int, ...] = ()
    """Hosted ranks whose slot this receiver holds (READY)."""
    cas_keys: AttemptKeys | None = None
    """The attempt a bind compare-and-set was sent for, which may land after its caller gave up *(store worker)*."""
    cas_resolved: bool = False
    """Whether that compare-and-set returned (its outcome is in ``keys``/``bound``) *(store worker)*."""
    closed: bool = False
    """The receiver finished or gave the attempt up: a bind that has not run yet does nothing, no claim is
    answered any more."""
    answer_until: float = 0.0
    """``time.monotonic()`` until which the responder answers claims (the post's timeout, or the wait's)."""
    answered: dict[int, Claim] = field(default_factory=dict)
    """prefill rank -> its claim, which this receiver answered *(store worker)*: it may send, so an abort waits for
    it whatever its slot holds."""
    claims_seen: int = 0
    """The attempt's claim counter when its slots were last read *(store worker)*."""
    settled: set[int] = field(default_factory=set)
    """Prefill ranks whose slot was closed before they claimed it (nothing to answer) *(store worker)*."""
    abort: Future | None = None
    """The queued abort; its result is ``(claimed prefill rank -> (Claim, drained), when it took effect)``."""
    failed_at: float = 0.0
    drained: set[int] = field(default_factory=set)
    """Claimed prefill ranks seen DRAINED since the abort."""


class Quarantine:
    """Failed attempts whose pages may still receive late bytes (a retry under the same id adds another).

    Args:
        fallback_grace_s: how long to hold an attempt whose abort never reported which ranks claimed it (a store
            that failed the abort call): as long as any sender may write.
    """

    def __init__(self, fallback_grace_s: float) -> None:
        self.fallback_grace_s = fallback_grace_s
        self.attempts: list[PostedAttempt] = []

    def __bool__(self) -> bool:
        return bool(self.attempts)

    def add(self, att: PostedAttempt) -> None:
        att.failed_at = time.monotonic()
        self.attempts.append(att)

    def remove(self, att: PostedAttempt) -> None:
        if att in self.attempts:
            self.attempts.remove(att)

    def pages(self) -> dict[str, np.ndarray]:
        """request id -> its quarantined pages (hosted here)."""
        out: dict[str, np.ndarray] = {}
        for att in self.attempts:
            out[att.request_id] = np.union1d(out.get(att.request_id, att.mine), att.mine)
        return out

    def check_free(self, pages: np.ndarray, meta_slot: int | None) -> None:
        """Raise ``ValueError`` if ``pages`` (hosted here) or ``meta_slot`` belong to a quarantined attempt."""
        for att in self.attempts:
            clash = np.intersect1d(pages, att.mine)
            if clash.size:
                raise ValueError(
                    f"dst_pages must not hold pages quarantined after request {att.request_id!r} failed (its "
                    f"abandoned engine calls may still write them; free them once reclaim() lists it), got pages "
                    f"{format_pages(clash)}"
                )
            if meta_slot is not None and meta_slot == att.meta_slot:
                raise ValueError(
                    f"dst_meta_slot must not be the slot of request {att.request_id!r}, which is quarantined, got "
                    f"dst_meta_slot={meta_slot}"
                )

    def due(self) -> tuple[list[PostedAttempt], dict[PostedAttempt, list[int]]]:
        """``(attempts whose quarantine ended, attempt -> claimed prefill ranks still to see DRAINED)``."""
        now = time.monotonic()
        done: list[PostedAttempt] = []
        waiting: dict[PostedAttempt, list[int]] = {}
        for att in self.attempts:
            if att.abort is None or not att.abort.done():
                continue  # which ranks claimed it is not known yet
            try:
                claimed, when = att.abort.result()
            except Exception:  # noqa: BLE001 - the claims stay unknown: wait as long as any sender may write
                if now >= att.failed_at + self.fallback_grace_s + GRACE_MARGIN_S:
                    done.append(att)
                continue
            left = [r for r, (_, drained) in claimed.items() if not drained and r not in att.drained]
            grace_end = when + max((claimed[r][0].grace_s for r in left), default=0.0) + GRACE_MARGIN_S
            if not left or now >= grace_end:
                done.append(att)
            else:
                waiting[att] = left
        return done, waiting

    @staticmethod
    def record_drained(waiting: dict[PostedAttempt, list[int]], progress: list[int]) -> list[PostedAttempt]:
        """Note which waited-for ranks are DRAINED (``progress``: their counters, in ``waiting`` order); the
        attempts none of whose ranks is left."""
        values = iter(progress)
        for att, ranks in waiting.items():
            for r in ranks:
                if SendProgress(next(values)).drained:
                    att.drained.add(r)
        return [att for att, ranks in waiting.items() if all(r in att.drained for r in ranks)]


def check_not_pending(pending: Iterable[PostedAttempt], pages: np.ndarray, meta_slot: int | None) -> None:
    """Raise ``ValueError`` if ``pages`` or ``meta_slot`` belong to a request posted and not waited for yet."""
    for att in pending:
        clash = np.intersect1d(pages, att.dst)
        if clash.size:
            raise ValueError(
                f"dst_pages must not hold pages of request {att.request_id!r}, posted here and not waited for yet "
                f"(both would be written there), got pages {format_pages(clash)}"
            )
        if meta_slot is not None and meta_slot == att.meta_slot:
            raise ValueError(
                f"dst_meta_slot must not be the slot of request {att.request_id!r}, posted here and not waited for "
                f"yet, got dst_meta_slot={meta_slot}"
            )
