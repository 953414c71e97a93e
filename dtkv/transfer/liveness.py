"""Decode's answers to prefill's claims: the freshness proof of an attempt (:mod:`dtkv.transfer.protocol`).

A signed value proves who wrote it and for which key, not when: a store peer can write an attempt's signed values
back after the attempt failed (the epoch pointer ``req/{request_id}``, its OPEN and READY slots) and they verify
again. So prefill does not trust an attempt because its values verify: each prefill rank claims with a fresh
random nonce and sends no byte before every decode rank answered that nonce (:class:`dtkv.transfer.messages.Answer`,
signed under ``E/answer/{r}/{d}``). A decode receiver answers only the attempts it holds right now (posted, not
waited for yet, not given up), so a replayed attempt, which no receiver holds, is never answered.

:class:`Responder` answers on a thread of its own, from the post until the attempt's answer window closes (the
receiver's timeout after the post, or the end of :meth:`dtkv.transfer.DecodeReceiver.wait_request`), so that a
caller may post, send and wait on one thread. It polls only while some held attempt has a prefill rank it has not
answered yet (every 1 ms for :data:`dtkv.transfer.protocol.HOT_POLL_S` after a post or an answer, then doubling
up to :data:`dtkv.transfer.protocol.MAX_POLL_S`), and exits when there is none.
"""

from __future__ import annotations

import logging
import threading
import time

import torch.distributed as dist

from dtkv.transfer.bootstrap import WORKER_LINGER_S, Bootstrap, exiting
from dtkv.transfer.errors import TransferError
from dtkv.transfer.messages import Aborted, Answer, Claim, SlotOpen
from dtkv.transfer.protocol import HOT_POLL_S, MAX_POLL_S, deadline_after
from dtkv.transfer.quarantine import PostedAttempt

__all__ = ["Responder", "answer_claims"]

logger = logging.getLogger(__name__)

_CALL_S = 0.5
"""Bound on one answering store call (a stalled store: the next round tries again)."""


def _unanswered(att: PostedAttempt) -> list[int]:
    keys = att.keys
    return [r for r in range(keys.num_prefill) if r not in att.answered and r not in att.settled]


def answer_claims(s: dist.Store, bootstrap: Bootstrap, incarnation: int, attempts: list[PostedAttempt]) -> bool:
    """(On the store worker.) Answer every new claim of the held ``attempts``; whether any slot changed.

    Each held attempt's claim counter is read; when it rose, its unanswered prefill slots are read, and a claim of
    the attempt is answered once per hosted decode rank the receiver bound, with the claim's nonce, this
    receiver's incarnation and its staging grant, and recorded in ``att.answered``. A slot closed before its rank
    claimed it needs no answer.
    """
    progressed = False
    for att in attempts:
        if att.closed or att.keys is None:
            continue  # given up or finished since the snapshot: it is not held any more
        keys = att.keys
        ranks = _unanswered(att)
        claims = s.add(keys.claimed, 0)  # one call per attempt while no new rank claimed
        slots = [keys.slot("prefill", r) for r in ranks]
        if claims <= att.claims_seen or not slots or not s.check(slots):
            continue
        att.claims_seen = claims
        for r, slot in zip(ranks, slots):
            try:
                msg = bootstrap.decode(slot, s.get(slot), SlotOpen, Claim, Aborted, request_id=keys.request_id)
            except TransferError as e:  # a malformed slot: never answered (prefill then times out)
                logger.warning("not answering %s: %s", slot, e)
                att.settled.add(r)
                continue
            if isinstance(msg, Aborted):
                att.settled.add(r)
                progressed = True
            elif isinstance(msg, Claim) and msg.epoch == keys.epoch and msg.rank == r:
                for d in att.bound:
                    key = keys.answer(r, d)
                    answer = Answer(
                        epoch=keys.epoch,
                        prefill_rank=r,
                        decode_rank=d,
                        nonce=msg.nonce,
                        incarnation=incarnation,
                        staging=att.staging.get(d, False),
                    )
                    s.set(key, bootstrap.encode(key, answer))
                att.answered[r] = msg
                progressed = True
    return progressed


class Responder:
    """Answers the claims of the attempts a :class:`dtkv.transfer.DecodeReceiver` holds, on its own thread.

    Args:
        bootstrap: the receiver's store access (answers run on its worker, in order with every other call).
        incarnation: the receiver's incarnation (in every answer).
        timeout_s: the receiver's timeout: an attempt is answered until this long after :meth:`add`, or until the
            deadline given to :meth:`extend`, whichever is later.
    """

    def __init__(self, bootstrap: Bootstrap, incarnation: int, timeout_s: float) -> None:
        self.bootstrap = bootstrap
        self.incarnation = incarnation
        self.timeout_s = timeout_s
        self._held: list[PostedAttempt] = []
        self._cv = threading.Condition()
        self._alive = False
        self._kick = False
        self._closed = False

    def add(self, att: PostedAttempt) -> None:
        """Start answering ``att`` (which this receiver now holds)."""
        with self._cv:
            att.answer_until = max(att.answer_until, deadline_after(self.timeout_s))
            self._held.append(att)
            self._wake()

    def extend(self, att: PostedAttempt, deadline: float) -> None:
        """Keep answering ``att`` until ``deadline`` at least (a wait for it runs until then)."""
        with self._cv:
            att.answer_until = max(att.answer_until, deadline)
            if att not in self._held and att.keys is not None and not att.closed:
                self._held.append(att)
            self._wake()

    def close(self) -> None:
        """Stop answering (the receiver closes); the thread exits after its current round."""
        with self._cv:
            self._closed = True
            self._held.clear()
            self._cv.notify_all()

    def _wake(self) -> None:
        if self._closed:
            return
        self._kick = True
        if self._alive:
            self._cv.notify_all()
        else:
            self._alive = True
            threading.Thread(target=self._run, name="dtkv-answer", daemon=True).start()

    def _due(self) -> list[PostedAttempt]:
        """(Under the lock.) The held attempts still to answer; drops the others."""
        now = time.monotonic()
        self._held = [
            a for a in self._held if not a.closed and a.keys is not None and now < a.answer_until and _unanswered(a)
        ]
        return list(self._held)

    def _run(self) -> None:
        delay, hot_until = 0.001, 0.0
        while True:
            with self._cv:
                due = [] if self._closed or exiting() else self._due()
                if not due and not self._closed:
                    self._cv.wait(WORKER_LINGER_S)
                    due = [] if self._closed or exiting() else self._due()
                if not due:
                    self._alive = False
                    return
                if self._kick:  # a new attempt: its claims are likely soon, poll every 1 ms for a while
                    hot_until, self._kick = time.monotonic() + HOT_POLL_S, False
            try:
                progressed = self.bootstrap.call(
                    lambda s, due=due: answer_claims(s, self.bootstrap, self.incarnation, due),
                    deadline=deadline_after(_CALL_S),
                    what="answer claims",
                )
            except TransferError as e:  # a stalled or failing store: the next round tries again
                logger.debug("answering claims failed: %s", e)
                progressed = False
            now = time.monotonic()
            if progressed:  # more claims of the same attempt are likely soon
                hot_until = now + HOT_POLL_S
            delay = 0.001 if now < hot_until else min(2 * delay, MAX_POLL_S)
            with self._cv:
                if not self._kick and not self._closed:
                    self._cv.wait(delay)
