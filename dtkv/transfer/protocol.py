"""The PD transfer protocol, in one place: every store key, the deadline and the backoff loop.

Prefill ranks and decode ranks are not in one process group; they meet in a ``torch.distributed`` store
(:class:`dtkv.transfer.Bootstrap`). Every value is a fixed-schema record (:mod:`dtkv.transfer.wire`,
:mod:`dtkv.transfer.messages`), never a pickle. Keys, under the bootstrap namespace (``P`` prefill ranks, ``D``
decode ranks, ``E`` = ``req/{request_id}/{epoch}``):

=============================  ============================================  ======================================
key                            value                                         written by
=============================  ============================================  ======================================
``{role}/{rank}``              :class:`RankEndpoint` (with an incarnation)   the rank (a restart replaces it)
``{role}/{rank}/open``         the attempts the rank holds open              the rank (adopted by its restart)
``{role}/{rank}/agent``        :class:`AgentRecord`: the rank's NIXL agent   the rank, before its endpoint (NIXL
                                                                             only; a restart replaces it)
``req/{request_id}``           :class:`DstRequest`: the current attempt      decode rank 0
``E/prefill/{r}``              slot: OPEN -> CLAIM (r, fresh nonce) or       decode rank 0 / prefill rank r / a
                               ABORTED                                       failing decode
``E/decode/{d}``               slot: OPEN -> READY (d, staging grant)        decode rank 0 / decode rank d / a
                               or ABORTED                                    failing decode
``E/claimed``                  counter of the prefill slots claimed          prefill ranks
``E/answer/{r}/{d}``           :class:`Answer`: d holds ``E`` and answers    decode rank d, while it holds ``E``
                               r's nonce
``E/start/{r}``                :class:`SendStart`                            prefill rank r
``E/done/{r}``                 :class:`SendOutcome`                          prefill rank r
``E/progress/{r}``             counter (:class:`SendProgress`)               prefill rank r; decode adds ABORT
``E/finished/{w}``             bits of the parties done with ``E``           decode rank 0 creates them at 0;
                               (:data:`WORD_BITS` a word)                    every rank sets its bit; the one
                                                                             completing them deletes ``E/*``
=============================  ============================================  ======================================

**Attempts.** Decode rank 0 opens an attempt of a request under a fresh random *epoch*: it creates every slot of
``E`` (OPEN, or READY for the decode ranks it hosts), then points ``req/{request_id}`` at it. A retry under the
same request id is a new epoch, so a stale value of an earlier attempt (a late "done") is never read by a later
one.

**Slots** are claimed with ``compare_set(OPEN -> claim)``, which is atomic and never recreates a deleted key: a
prefill rank sends only after claiming its slot, and a decode rank that gives up closes every still-OPEN slot
(``OPEN -> ABORTED``) and adds :data:`ABORT` to the progress counter of every claimed one. The compare-and-set
decides, once, whether each rank takes part; the party that closes a slot finishes the attempt on its behalf.

**Freshness.** With a shared secret every value is signed over its key (:mod:`dtkv.transfer.wire`): nobody
without the secret can forge one, or move one to another key. A signature does not date a value, though: a store
peer can write an attempt's values back under their own keys after the attempt failed (``req/{request_id}``, its
OPEN and READY slots), and they verify again. So no stored value makes prefill send. Each claim carries a fresh
random nonce; prefill plans from the READY slots and packs its first layer group meanwhile, but posts no start
and issues no engine call before every decode rank answered every hosted rank's nonce, for the incarnation and
staging grant its READY names (``E/answer/{r}/{d}``). A decode receiver answers only the attempts it holds now
(posted, neither waited for nor given up), from the post until its timeout after it, or until its wait's deadline
(:mod:`dtkv.transfer.liveness`, polling ``E/claimed`` and reading the slots when it rises). A replayed attempt is
held by no receiver, so it is never answered; an answer carries its nonce, so it is never reused. A prefill rank
whose claim a decode receiver answered counts as claimed when that receiver gives up, whatever its slot holds then.

**Progress** (one ``add`` per poll): prefill adds :data:`STARTED` once its ``start`` is posted, 1 per layer group
landed (decode may unpack it), :data:`DONE` once ``done`` is posted and :data:`DRAINED` once none of its engine
calls for the attempt is running any more (at once on success; after a timeout, when the abandoned calls end).
Prefill checks the value it gets back for :data:`ABORT` between layer groups and stops sending.

**Quarantine.** When an attempt fails on decode, its decode pages, metadata slot and staging region stay out of
use until every claimed prefill rank is DRAINED, or until a grace period has passed since the abort: the
prefill rank's send window (it issues no engine call after its own deadline, announced in its claim) plus its
engine's longest call (Mooncake's ``MC_TRANSFER_TIMEOUT`` or NIXL's own timeout, + 1 ns per byte) plus
:data:`GRACE_MARGIN_S`. Late bytes of an abandoned call can therefore never land in pages handed to another
request.

**Late binds.** A decode rank other than 0 takes part with a compare-and-set (OPEN -> READY) on the store worker;
when the store is slow past the caller's deadline, the call keeps running and may still land. The failing
receiver queues its abort behind it (store calls of a process run in order), so the abort sees what the bind did,
like an abandoned engine call: if a READY landed, the attempt is aborted as that rank's and the quarantine waits
for its claimed senders; if none did, the pages are released once the abort ran. Until then, the pages are
quarantined and :meth:`dtkv.transfer.DecodeReceiver.reclaim` does not list them. A bind that had not started when
its caller gave up does nothing.

**Cleanup.** Each party sets its bit in ``E/finished/{w}`` (prefill rank ``r`` is party ``r``, decode rank ``d``
party ``P + d``; one ``add`` of ``2**(party % 62)`` to word ``party // 62``) after its last write to ``E`` (decode:
after its quarantine ended), and only then drops ``E`` from its open attempts; the add that completes every word
deletes every key of ``E`` (the words last), listing ``E`` among its rank's open attempts while it does; decode
rank 0 deletes ``req/{request_id}`` when its own wait ends. The party that closes another's slot sets that
party's bit. Store calls of one process run in order on one worker thread, so a call that timed out during a
store stall still lands, in order, when the store answers again; the key count returns to its baseline. A party
lists an attempt in ``{role}/{rank}/open`` (with its incarnation) before it writes any key of it (decode rank 0
before the words and slots, a bind or a claim before its compare-and-set; un-listed if that took nothing), so a
rank that dies leaves every attempt it wrote to listed there; its restart finishes them
(:meth:`dtkv.transfer.TransferSide.__init__`): an attempt whose word 0 is complete and whose other words are
complete or gone was being deleted when the rank died, and the restart completes the deletion; otherwise it sets
the dead rank's bits that are not set yet, and those of the slots the dead incarnation closed (their ``ABORTED``
names it). Bits, not a count: a rank killed between its add and its un-listing would be counted twice by its
restart, one killed between its un-listing and its add never (its attempt's keys left in the store for good).

**Deadlines.** Every wait is bounded by :func:`deadline_after` and polls with :class:`Backoff`; every store call
is bounded by the remaining time (:meth:`dtkv.transfer.Bootstrap.call`).
"""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

from dtkv.transfer.errors import StoreTimeout, TransferError

T = TypeVar("T")

__all__ = [
    "ABORT",
    "DONE",
    "DRAINED",
    "GRACE_MARGIN_S",
    "HOT_POLL_S",
    "MAX_POLL_S",
    "STARTED",
    "WORD_BITS",
    "AttemptKeys",
    "Backoff",
    "SendProgress",
    "agent_key",
    "check_request_id",
    "deadline_after",
    "endpoint_key",
    "new_epoch",
    "new_nonce",
    "open_key",
    "peek_counter",
    "request_key",
    "time_left",
]

MAX_POLL_S = 0.005
"""Longest sleep between two polls of the store (the latency a waiter may add after a key appears)."""

STARTED = 1
"""Progress increment: the prefill rank's ``start`` is posted (layer groups landed count on top of it)."""
DONE = 1 << 20
"""Progress increment: the prefill rank's ``done`` is posted."""
DRAINED = 1 << 30
"""Progress increment: none of the prefill rank's engine calls for the attempt is running any more."""
ABORT = 1 << 40
"""Progress increment: a decode rank gave the attempt up (the sender stops at its next layer group)."""

GRACE_MARGIN_S = 1.0
"""Added to the quarantine grace period (scheduling and clock-rate slack)."""

_EPOCH = re.compile(r"[0-9a-f]{16}")
_NONCE = re.compile(r"[0-9a-f]{32}")
_FIELD = (1 << 20) - 1

WORD_BITS = 62
"""Parties per counter word of an attempt's ``finished`` bits (a store counter is an int64)."""


def deadline_after(timeout_s: float) -> float:
    """The ``time.monotonic()`` instant ``timeout_s`` from now (the one deadline expression)."""
    return time.monotonic() + float(timeout_s)


def time_left(deadline: float) -> float:
    """Seconds until ``deadline``: never negative, at most a year (what thread waits accept)."""
    return min(max(0.0, deadline - time.monotonic()), 3.2e7)


HOT_POLL_S = 0.05
"""How long a wait for an answer that is due any moment (:mod:`dtkv.transfer.liveness`) polls every 1 ms."""


class Backoff:
    """The one polling loop: sleep 1 ms, doubling up to :data:`MAX_POLL_S`, until the deadline.

    Args:
        deadline: ``time.monotonic()`` bound.
        on_timeout: builds the :class:`TransferError` that :meth:`wait` raises once the deadline has passed.
        hot_s: keep sleeping 1 ms (no doubling) for this long after the start and after each progress (a wait
            whose answer is due any moment, e.g. :data:`HOT_POLL_S`).
    """

    def __init__(
        self, deadline: float, on_timeout: Callable[[], TransferError] | None = None, *, hot_s: float = 0.0
    ) -> None:
        self.deadline = deadline
        self.on_timeout = on_timeout
        self.hot_s = hot_s
        self._hot_until = time.monotonic() + hot_s
        self._delay = 0.001
        self._answered = False

    def sleep(self, progressed: bool = False) -> bool:
        """Sleep before the next poll (1 ms again after progress); whether time is left for another one."""
        now = time.monotonic()
        left = self.deadline - now
        if left > 0:
            if progressed:
                self._hot_until = now + self.hot_s
            hot = progressed or now < self._hot_until
            self._delay = 0.001 if hot else min(self._delay * 2, MAX_POLL_S)
            time.sleep(min(self._delay, left))
        return time.monotonic() < self.deadline

    def wait(self, progressed: bool = False) -> None:
        """:meth:`sleep`, then raise ``on_timeout()`` once the deadline has passed."""
        if not self.sleep(progressed):
            raise self._timeout()

    def poll(self, call: Callable[[], T]) -> T:
        """Run one of the loop's store calls (bounded by the same deadline); its result.

        Once the store answered a poll of this loop, a later one that runs into the deadline (it began with
        milliseconds left, or the store was slow just then) means that what the loop waits for did not come in
        time: that raises ``on_timeout()``, chained to the :class:`StoreTimeout`. Before any answer, the
        :class:`StoreTimeout` itself is raised: the store is what did not answer.
        """
        try:
            out = call()
        except StoreTimeout as e:
            if self._answered and self.on_timeout is not None:
                raise self.on_timeout() from e
            raise
        self._answered = True
        return out

    def _timeout(self) -> TransferError:
        if self.on_timeout is None:
            raise ValueError("Backoff.wait needs on_timeout (use sleep() for a loop without one)")
        return self.on_timeout()


@dataclass(frozen=True, slots=True)
class SendProgress:
    """A prefill rank's progress counter, decoded (see the module docstring)."""

    value: int

    @property
    def started(self) -> bool:
        return (self.value & _FIELD) >= STARTED

    @property
    def groups_landed(self) -> int:
        """Layer groups announced as landed (decode may unpack them)."""
        return max(0, (self.value & _FIELD) - STARTED)

    @property
    def done(self) -> bool:
        return (self.value >> 20) & 0x3FF > 0

    @property
    def drained(self) -> bool:
        return (self.value >> 30) & 0x3FF > 0

    @property
    def aborted(self) -> bool:
        return self.value >= ABORT


def check_request_id(request_id: object) -> str:
    """``request_id`` if it can name store keys: a non-empty str of at most 256 characters without ``/``."""
    if not isinstance(request_id, str) or not 0 < len(request_id) <= 256 or "/" in request_id:
        raise ValueError(
            f"request_id must be a non-empty str of at most 256 characters without '/', got request_id={request_id!r}"
        )
    if any(ord(c) < 32 for c in request_id):
        raise ValueError(f"request_id must not hold control characters, got request_id={request_id!r}")
    return request_id


def new_epoch() -> str:
    """A fresh attempt epoch: 16 random hex digits."""
    return secrets.token_hex(8)


def check_epoch(epoch: str) -> bool:
    """Whether ``epoch`` has the form :func:`new_epoch` produces."""
    return bool(_EPOCH.fullmatch(epoch))


def new_nonce() -> str:
    """A fresh claim nonce: 32 random hex digits (128 bits), never reused."""
    return secrets.token_hex(16)


def check_nonce(nonce: str) -> bool:
    """Whether ``nonce`` has the form :func:`new_nonce` produces."""
    return bool(_NONCE.fullmatch(nonce))


def endpoint_key(role: str, rank: int) -> str:
    return f"{role}/{rank}"


def agent_key(role: str, rank: int) -> str:
    """Where a rank publishes its NIXL agent's record (:class:`dtkv.transfer.messages.AgentRecord`)."""
    return f"{role}/{rank}/agent"


def open_key(role: str, rank: int) -> str:
    return f"{role}/{rank}/open"


def request_key(request_id: str) -> str:
    return f"req/{request_id}"


@dataclass(frozen=True, slots=True)
class AttemptKeys:
    """The keys of one attempt ``req/{request_id}/{epoch}`` between ``num_prefill`` and ``num_decode`` ranks."""

    request_id: str
    epoch: str
    num_prefill: int
    num_decode: int

    @property
    def prefix(self) -> str:
        return f"req/{self.request_id}/{self.epoch}"

    def slot(self, role: str, rank: int) -> str:
        return f"{self.prefix}/{role}/{rank}"

    def start(self, rank: int) -> str:
        return f"{self.prefix}/start/{rank}"

    def done(self, rank: int) -> str:
        return f"{self.prefix}/done/{rank}"

    def progress(self, rank: int) -> str:
        return f"{self.prefix}/progress/{rank}"

    def answer(self, prefill_rank: int, decode_rank: int) -> str:
        return f"{self.prefix}/answer/{prefill_rank}/{decode_rank}"

    @property
    def claimed(self) -> str:
        return f"{self.prefix}/claimed"

    def finished(self, word: int) -> str:
        """Counter word ``word`` of the parties done with the attempt (:meth:`finish`)."""
        return f"{self.prefix}/finished/{word}"

    @property
    def num_parties(self) -> int:
        """``P + D``: the ranks that each finish the attempt once."""
        return self.num_prefill + self.num_decode

    @property
    def num_words(self) -> int:
        """Counter words of ``finished``: :data:`WORD_BITS` parties each."""
        return -(-self.num_parties // WORD_BITS)

    def party(self, role: str, rank: int) -> int:
        """The party number of ``role`` rank ``rank``: prefill ``r`` is ``r``, decode ``d`` is ``P + d``."""
        if role == "prefill" and 0 <= rank < self.num_prefill:
            return rank
        if role == "decode" and 0 <= rank < self.num_decode:
            return self.num_prefill + rank
        raise ValueError(
            f"role and rank must name one of the attempt's {self.num_prefill} prefill and {self.num_decode} decode "
            f"ranks, got {role!r} rank {rank!r}"
        )

    def full_word(self, word: int) -> int:
        """The value of counter word ``word`` once each of its parties finished."""
        return (1 << min(WORD_BITS, self.num_parties - word * WORD_BITS)) - 1

    def all(self) -> list[str]:
        """Every key of the attempt (``req/{request_id}`` excluded: decode rank 0 owns it), in deletion order:
        the counter words last, word 0 the very last."""
        keys = [self.slot("decode", d) for d in range(self.num_decode)]
        for r in range(self.num_prefill):
            keys += [self.slot("prefill", r), self.start(r), self.done(r), self.progress(r)]
            keys += [self.answer(r, d) for d in range(self.num_decode)]
        return [*keys, self.claimed, *(self.finished(w) for w in reversed(range(self.num_words)))]

    def create(self, store) -> None:
        """Create the counter words at 0 (decode rank 0, before any slot): a missing word then means a deletion
        under way, which :meth:`deleting` relies on."""
        for w in range(self.num_words):
            store.add(self.finished(w), 0)

    def finish(self, store, parties: Iterable[int], before_delete: Callable[[], object] | None = None) -> bool:
        """Set the bits of ``parties`` (:meth:`party`) in the counter words (runs on the store worker); the call
        that completes every word deletes every key, calling ``before_delete()`` first
        (:meth:`dtkv.transfer.TransferSide._finish` lists the attempt open again meanwhile, so that a restart
        finishes a deletion its rank died in). Each party's bit is added once, by the rank or, for a rank that
        died, by its restart where the bit is not set yet (:meth:`unfinished`): a count could not tell whether a
        rank killed right after its add had added.

        Returns whether this call deleted the attempt.
        """
        words: dict[int, int] = {}
        for p in parties:
            words[p // WORD_BITS] = words.get(p // WORD_BITS, 0) | 1 << (p % WORD_BITS)
        if not words:
            return False
        complete = True
        for w, bits in sorted(words.items()):
            complete &= store.add(self.finished(w), bits) == self.full_word(w)
        if not complete:
            return False
        for w in range(self.num_words):  # another word's last party may be finishing now: one of us sees both
            if w not in words and peek_counter(store, self.finished(w)) != self.full_word(w):
                return False
        if before_delete is not None:
            before_delete()
        self.delete(store)
        return True

    def unfinished(self, store, parties: Iterable[int]) -> list[int]:
        """Those of ``parties`` whose bit is not set; none where their counter word is gone (the attempt was
        deleted: an add would create the key again)."""
        values: dict[int, int | None] = {}
        out = []
        for p in parties:
            w = p // WORD_BITS
            if w not in values:
                values[w] = peek_counter(store, self.finished(w))
            if values[w] is not None and not values[w] >> (p % WORD_BITS) & 1:
                out.append(p)
        return out

    def delete(self, store) -> None:
        """Delete every key of the attempt, the counter words last: while word 0 is complete and every other word
        complete or gone (:meth:`deleting`), a deletion began and may not have ended. Deleting a deleted key does
        nothing, so a deletion can be redone."""
        for key in self.all():
            store.delete_key(key)

    def deleting(self, store) -> bool:
        """Whether the attempt's deletion began and may not have ended (see :meth:`delete`)."""
        if peek_counter(store, self.finished(0)) != self.full_word(0):
            return False
        for w in range(1, self.num_words):
            value = peek_counter(store, self.finished(w))
            if value is not None and value != self.full_word(w):
                return False
        return True


_ABSENT = b"\x00absent"


def peek_counter(store, key: str) -> int | None:
    """The counter at ``key``, or ``None`` where the key is missing or not a counter. Never creates the key
    (a compare-and-set with an expected value no counter holds: the store answers the value it has, or, for a
    missing key, the expected value back)."""
    raw = store.compare_set(key, _ABSENT, _ABSENT)
    if raw == _ABSENT:
        return None
    try:
        return int(raw)
    except ValueError:
        return None
