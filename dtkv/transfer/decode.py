"""``DecodeReceiver``: decode posts where each position goes, waits for every prefill rank, rebuilds its layout.

The protocol (keys, slots, progress, quarantine, cleanup) is :mod:`dtkv.transfer.protocol`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from dtkv.transfer._receive import ReceiveLoop
from dtkv.transfer._side import TransferSide
from dtkv.transfer.bootstrap import Bootstrap
from dtkv.transfer.descriptors import as_pages
from dtkv.transfer.errors import TransferError, format_pages
from dtkv.transfer.liveness import Responder
from dtkv.transfer.messages import Aborted, Claim, DstRequest, Ready, SlotOpen
from dtkv.transfer.plan import check_pages
from dtkv.transfer.protocol import (
    ABORT,
    AttemptKeys,
    Backoff,
    SendProgress,
    check_request_id,
    deadline_after,
    new_epoch,
    request_key,
    time_left,
)
from dtkv.transfer.quarantine import PostedAttempt, Quarantine, check_not_pending
from dtkv.transfer.shard import KVShard

__all__ = ["DecodeReceiver", "ReceiveReport"]

logger = logging.getLogger(__name__)

_ABORT_WAIT_S = 0.25
"""How long a failing wait lets its abort reach the store before raising (within timeout + 1 s overall)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ReceiveReport:
    """One received request: what the prefill ranks sent, and how long decode waited and unpacked."""

    request_id: str
    num_positions: int
    num_entries: int
    """Entries sent by every prefill rank."""
    min_entries: int
    """The fewest entries any plan of the request needs."""
    num_calls: int
    num_bytes: int
    staged: bool
    """Whether any staging region was unpacked."""
    wait_s: float
    """Time waiting for the senders (less the unpacking done meanwhile)."""
    unpack_s: float
    """Time unpacking staging regions (mostly overlapped with the transfer when it has several layer groups)."""
    tail_s: float
    """Unpacking after the last sender finished (on the critical path)."""


class DecodeReceiver(ReceiveLoop, TransferSide):
    """The decode side of PD transfer for the decode ranks hosted by this process.

    A non-CP decode hosts one shard of ``PageOwnership(1, num_pages)``; a CP decode runs one receiver per rank
    (SPMD: every receiver posts and waits for the same requests), or hosts all of its ranks in one process
    (tests, benchmarks). The receiver hosting decode rank 0 opens each attempt; the others take part in it.

    Each decode rank grants its own staging region to at most one request at a time: to the first one posted
    while it is free, until that request was unpacked here (or, if it failed, until its quarantine ended).

    **Liveness.** From the post until the wait ends (at least ``timeout_s`` after the post) the receiver answers
    each prefill rank's claim of the attempt, on a thread of its own (:mod:`dtkv.transfer.liveness`); prefill
    sends nothing before every decode rank answered, so a caller may post, send and wait on one thread.

    **Failures and page reuse.** When a post or a wait fails, prefill calls abandoned after a timeout may still be
    writing into the request's pages (and staging region, and metadata slot), and a decode rank's READY may still
    land after the call gave up. Those stay *quarantined* until that write resolved and every prefill rank that
    took part reported its calls ended, or a grace period passed (:mod:`dtkv.transfer.protocol`);
    :meth:`post_request` refuses quarantined pages. Free a failed request's pages only once :meth:`reclaim`
    lists it.

    Args:
        shards: the decode ranks hosted here (:class:`dtkv.transfer.KVShard`); give them ``staging_bytes`` to
            let prefill pack strided pages into one entry per rank pair.
        bootstrap: the rendezvous store shared with prefill.
        engine: an engine, or the name of one to create (``"mooncake"``, the default, ``"nixl"``, ``"local"``;
            :class:`dtkv.transfer.TransferSide`).
        timeout_s: bound on every wait (default ``DTKV_TRANSFER_TIMEOUT_S``).
    """

    def __init__(
        self,
        shards: KVShard | Sequence[KVShard],
        bootstrap: Bootstrap,
        *,
        engine=None,
        timeout_s: float | None = None,
    ) -> None:
        super().__init__(shards, bootstrap, "decode", engine=engine, timeout_s=timeout_s)
        self._pending: dict[str, PostedAttempt] = {}
        self._quarantine = Quarantine(2 * self.timeout_s + self.engine.call_timeout_s())
        self._released: list[tuple[str, np.ndarray]] = []
        self._staging_holder: dict[int, PostedAttempt] = {}
        """hosted decode rank -> the attempt its staging region is granted to."""
        self._responder = Responder(bootstrap, self.incarnation, self.timeout_s)

    @property
    def posts(self) -> bool:
        """Whether this receiver hosts decode rank 0 (the one that opens attempts)."""
        return 0 in self.shards

    @property
    def quarantined(self) -> dict[str, np.ndarray]:
        """Failed requests whose pages (hosted here) may still receive late bytes: request id -> pages."""
        return self._quarantine.pages()

    # ------------------------------------------------------------------------------------------ post
    def post_request(
        self,
        request_id: str,
        dst_pages: object,
        *,
        num_tokens: int | None = None,
        dst_meta_slot: int | None = None,
        staging: bool = True,
    ) -> None:
        """Publish where each position of ``request_id`` goes (``dst_pages``: int ``[num_positions]``).

        Every argument is checked before anything changes: a rejected post writes nothing to the store and takes
        no staging grant.

        Raises:
            TypeError: ``dst_pages`` is not a list of ints, or ``dst_meta_slot`` or ``num_tokens`` not an int.
            ValueError: ``dst_pages`` holds a page outside the pool ``[0, num_pages)`` or one page twice,
                ``dst_meta_slot`` is not a metadata row of every decode rank, ``num_tokens`` is negative,
                ``request_id`` is already posted here and not waited for, or ``dst_pages`` (or ``dst_meta_slot``)
                holds pages of a request posted here and not waited for yet, or of a failed one still in quarantine.
            TransferError: the store did not take the request in time (its pages are then quarantined too).
        """
        request_id = check_request_id(request_id)
        dst = as_pages("dst_pages", dst_pages)
        if self.prefill is None or self.decode is None:
            self.connect()
        dst_meta_slot = self._check_post(request_id, dst, num_tokens, dst_meta_slot)
        self._refresh(deadline_after(min(self.timeout_s, 0.5)))
        mine = self._mine(dst)
        self._quarantine.check_free(mine, dst_meta_slot)
        grants = {d: bool(staging) and d not in self._staging_holder for d in self.shards}
        att = PostedAttempt(
            request_id=request_id, dst=dst, mine=mine, num_tokens=num_tokens, meta_slot=dst_meta_slot, staging=grants
        )
        for d, granted in grants.items():
            if granted:
                self._staging_holder[d] = att
        self._pending[request_id] = att
        deadline = deadline_after(self.timeout_s)
        try:
            if self.posts:
                self._open_attempt(att, deadline)
            else:
                self._bind(att, deadline, wait=False)
        except BaseException:
            self._fail(att)
            raise
        if att.keys is not None:
            self._responder.add(att)

    def _check_post(self, request_id: str, dst: np.ndarray, num_tokens: object, meta_slot: object) -> int | None:
        """Raise unless the post's arguments are valid now (changing nothing); the metadata slot as an int."""
        if request_id in self._pending:
            raise ValueError(
                f"request_id must not be pending on this receiver already (wait for it first), got "
                f"request_id={request_id!r}"
            )
        check_pages("dst_pages", dst, next(iter(self.shards.values())).ownership)
        if num_tokens is not None:
            if isinstance(num_tokens, bool | np.bool_) or not isinstance(num_tokens, int | np.integer):
                raise TypeError(f"num_tokens must be None or an int >= 0, got {num_tokens!r}")
            if num_tokens < 0:
                raise ValueError(f"num_tokens must be None or an int >= 0, got {num_tokens}")
        if meta_slot is not None:
            if isinstance(meta_slot, bool | np.bool_) or not isinstance(meta_slot, int | np.integer):
                raise TypeError(f"dst_meta_slot must be an int or None, got {meta_slot!r}")
            meta_slot = int(meta_slot)
            for ep in self.decode:
                if ep.meta_num_rows == 0:
                    raise ValueError(
                        f"dst_meta_slot needs metadata rows on decode rank {ep.rank}, which registered none"
                    )
                if not 0 <= meta_slot < ep.meta_num_rows:
                    raise ValueError(
                        f"dst_meta_slot must be in [0, {ep.meta_num_rows}) (the metadata rows of decode rank "
                        f"{ep.rank}), got dst_meta_slot={meta_slot}"
                    )
        check_not_pending(self._pending.values(), dst, meta_slot)
        return meta_slot

    def _mine(self, pages: np.ndarray) -> np.ndarray:
        own = next(iter(self.shards.values())).ownership
        if pages.size == 0:
            return pages
        owner = own.owner(torch.from_numpy(pages)).numpy()
        return np.unique(pages[np.isin(owner, list(self.shards))])

    def _ready(self, keys: AttemptKeys, att: PostedAttempt, d: int) -> Ready:
        return Ready(epoch=keys.epoch, rank=d, incarnation=self.incarnation, staging=att.staging[d])

    def _open_attempt(self, att: PostedAttempt, deadline: float) -> None:
        """(Decode rank 0.) Create the attempt's slots, then point ``req/{request_id}`` at it."""
        keys = AttemptKeys(att.request_id, new_epoch(), len(self.prefill), len(self.decode))
        att.keys, att.bound = keys, tuple(sorted(self.shards))
        req = DstRequest(
            request_id=att.request_id,
            epoch=keys.epoch,
            dst_pages=att.dst,
            num_tokens=att.num_tokens,
            dst_meta_slot=att.meta_slot,
            num_prefill=keys.num_prefill,
            num_decode=keys.num_decode,
            timeout_ms=int(self.timeout_s * 1e3),
        )
        values = [(keys.slot("prefill", r), SlotOpen(epoch=keys.epoch)) for r in range(keys.num_prefill)]
        for d in range(keys.num_decode):
            msg = self._ready(keys, att, d) if d in self.shards else SlotOpen(epoch=keys.epoch)
            values.append((keys.slot("decode", d), msg))
        values.append((request_key(att.request_id), req))
        raws = [(k, self.bootstrap.encode(k, m)) for k, m in values]

        def job(s: dist.Store) -> None:
            self._hold(keys, True)  # listed open before any of its keys exists: a restart finishes what a death
            self._write_open(s)  # between the two would otherwise leave behind
            keys.create(s)  # the counter words before any slot (AttemptKeys.deleting relies on them)
            for k, raw in raws[:-1]:
                s.set(k, raw)
            s.set(*raws[-1])  # last: prefill finds every slot once it sees the request

        self.bootstrap.call(
            job, deadline=deadline, what=f"open {keys.prefix}", request_id=att.request_id, peer="store", write=True
        )

    def _bind(self, att: PostedAttempt, deadline: float, *, wait: bool) -> None:
        """(Decode ranks other than 0.) Take part in decode rank 0's current attempt: claim the hosted slots.

        The compare-and-set runs on the store worker and may land after this call gave up (a slow store): the
        job records what it bound on ``att`` itself, and :meth:`_fail` fences it (its abort runs after it).
        """
        key = request_key(att.request_id)
        hosted = sorted(self.shards)

        def job(s: dist.Store):
            if att.closed:  # given up before this call ran: take part in nothing
                return None
            if not s.check([key]):
                return None
            req = self.bootstrap.decode(key, s.get(key), DstRequest, request_id=att.request_id, peer="decode rank 0")
            keys = AttemptKeys(att.request_id, req.epoch, req.num_prefill, req.num_decode)
            att.cas_keys, att.cas_resolved = keys, False
            self._hold(keys, True)  # listed open before a READY of ours can land (a restart finishes it)
            self._write_open(s)
            got = {}
            for d in hosted:
                slot = keys.slot("decode", d)
                ready = self.bootstrap.encode(slot, self._ready(keys, att, d))
                raw = s.compare_set(slot, self.bootstrap.encode(slot, SlotOpen(epoch=keys.epoch)), ready)
                got[d] = "bound" if raw == ready else self._slot_state(slot, raw)
            bound = tuple(d for d in hosted if got[d] == "bound")
            if bound:
                att.keys, att.bound = keys, bound
            else:  # no slot of ours: nothing to finish
                self._hold(keys, False)
                self._write_open(s)
            att.cas_resolved = True
            return req, keys, got

        backoff = Backoff(
            deadline,
            lambda: TransferError(f"timed out waiting for {key!r}", request_id=att.request_id, peer="decode rank 0"),
        )
        while True:
            out = self.bootstrap.call(
                job,
                deadline=deadline,
                what=f"take part in {key}",
                request_id=att.request_id,
                peer="decode rank 0",
                write=True,
            )
            if out is not None:
                req, keys, got = out
                if att.keys is not None or "stale" not in got.values():  # a stale attempt is an earlier one
                    if len(att.bound) < len(hosted):
                        raise TransferError(
                            "decode gave the request up before this rank took part",
                            request_id=att.request_id,
                            peer="decode",
                        )
                    if not np.array_equal(req.dst_pages, att.dst):
                        raise TransferError(
                            f"decode rank 0 posted other pages for the request: {format_pages(req.dst_pages)}",
                            request_id=att.request_id,
                            peer="decode rank 0",
                        )
                    self._check_party_counts(keys, deadline)
                    return
            if not wait:
                return
            backoff.wait()

    def _slot_state(self, slot: str, raw: bytes) -> str:
        msg = self.bootstrap.decode(slot, raw, SlotOpen, Ready, Aborted)
        if isinstance(msg, Ready) and msg.incarnation == self.incarnation:
            return "stale"
        return "closed"

    # ------------------------------------------------------------------------------------------ wait
    def wait_request(self, request_id: str, *, timeout_s: float | None = None) -> ReceiveReport:
        """Wait until every prefill rank sent its share, check coverage, unpack staging (blocking).

        Raises:
            KeyError: ``request_id`` was not posted here.
            TransferError: a prefill rank reported a failure, or did not finish within the timeout (naming it
                and the request's pages), the positions reported do not cover the request exactly once, or the
                store did not answer in time. The request's pages are then quarantined (see the class docstring).
        """
        if request_id not in self._pending:
            raise KeyError(f"request_id must be posted first with post_request, got request_id={request_id!r}")
        att = self._pending[request_id]
        deadline = deadline_after(self.timeout_s if timeout_s is None else timeout_s)
        t0 = time.perf_counter()
        try:
            if att.keys is None:
                self._bind(att, deadline, wait=True)
            self._responder.extend(att, deadline)
            starts, outcomes, unpack_s = self._wait_outcomes(att, deadline)
            t1 = time.perf_counter()
            self._check_coverage(att, starts)
        except BaseException:
            self._fail(att)
            raise
        self._succeed(att)
        got, dt = sum(o.num_bytes for o in outcomes), time.perf_counter() - t0
        logger.info(
            "received %r (decode ranks %s): the request's %d bytes from %d prefill ranks in %.3f s (%.3f GB/s)",
            request_id,
            sorted(self.shards),
            got,
            len(outcomes),
            dt,
            got / max(dt, 1e-9) / 1e9,
        )
        return ReceiveReport(
            request_id=request_id,
            num_positions=int(att.dst.shape[0]),
            num_entries=sum(o.num_entries for o in outcomes),
            min_entries=max(o.min_entries for o in outcomes),
            num_calls=sum(o.num_calls for o in outcomes),
            num_bytes=sum(o.num_bytes for o in outcomes),
            staged=any(any(st.unpack.values()) for st in starts),
            wait_s=t1 - t0 - unpack_s[1],
            unpack_s=unpack_s[0],
            tail_s=unpack_s[1],
        )

    def receive_request(self, request_id: str, dst_pages: object, **kwargs) -> ReceiveReport:
        """:meth:`post_request` then :meth:`wait_request` (``timeout_s`` goes to the wait)."""
        timeout_s = kwargs.pop("timeout_s", None)
        self.post_request(request_id, dst_pages, **kwargs)
        return self.wait_request(request_id, timeout_s=timeout_s)

    # ------------------------------------------------------------------------------------------ outcome
    def _succeed(self, att: PostedAttempt) -> None:
        self._pending.pop(att.request_id, None)
        att.closed = True
        self._release_staging(att)
        keys = att.keys
        parties = [keys.party("decode", d) for d in att.bound]

        def job(s: dist.Store) -> None:
            if self.posts:
                self._drop_request_key(s, keys)
            self._finish(s, keys, parties)  # the bits first, then un-listed: a death in between is adopted

        self.bootstrap.post(job, what=f"finish {keys.prefix}")

    def _fail(self, att: PostedAttempt) -> None:
        """Give the attempt up: close the open slots, tell the claimed senders, quarantine the pages.

        The abort is queued behind every earlier store call of this receiver, so it runs after a bind that was
        still queued or running when its caller gave up (:meth:`_fence`): until it ran, which senders to wait for
        is not known and the pages stay quarantined.
        """
        self._pending.pop(att.request_id, None)
        att.closed = True  # no bind that has not started runs, no claim is answered any more
        att.abort = self.bootstrap.post(lambda s: self._fence(s, att), what=f"abort {att.request_id!r}")
        self._quarantine.add(att)
        try:
            att.abort.result(timeout=_ABORT_WAIT_S)
        except Exception:  # noqa: BLE001 - a stalled store: the quarantine waits for the abort to land
            pass
        self._refresh(deadline_after(0.0))

    def _fence(self, s: dist.Store, att: PostedAttempt):
        """(On the store worker, after every earlier call for ``att``.) Abort what ``att`` took part in, if anything.

        Returns ``(claimed prefill rank -> (Claim, drained), when the abort took effect)``: nothing claimed when
        this receiver never bound a slot of the attempt (nobody can send into the pages then).
        """
        if att.keys is None and att.cas_keys is not None and not att.cas_resolved:
            self._read_bind(s, att)  # the bind failed inside the store call: whether its READY landed is unknown
        if att.keys is None:
            return {}, time.monotonic()
        return self._abort(s, att.keys, set(att.bound), att.answered)

    def _read_bind(self, s: dist.Store, att: PostedAttempt) -> None:
        """(On the store worker.) Record the hosted slots of ``att.cas_keys`` that hold this receiver's READY."""
        keys = att.cas_keys
        bound = []
        for d in sorted(self.shards):
            slot = keys.slot("decode", d)
            if s.check([slot]) and s.get(slot) == self.bootstrap.encode(slot, self._ready(keys, att, d)):
                bound.append(d)
        if bound:
            att.keys, att.bound = keys, tuple(bound)
        self._hold(keys, bool(bound))  # the bind listed it before its compare-and-set
        self._write_open(s)
        att.cas_resolved = True

    def _abort(self, s: dist.Store, keys: AttemptKeys, parties: set[int], answered: dict[int, Claim] | None = None):
        """(On the store worker.) Close every OPEN slot of ``keys`` except decode ``parties``' and finish those
        slots; add ABORT to every claimed prefill rank's progress, and to every rank whose claim this receiver
        answered (``answered``: it may send whatever its slot holds now). Returns ``(claimed, when)``."""
        closed: list[int] = []
        claimed: dict[int, tuple[Claim, bool]] = {}
        aborted = Aborted(epoch=keys.epoch, by=self.uid)
        slots = [("prefill", r) for r in range(keys.num_prefill)]
        slots += [("decode", d) for d in range(keys.num_decode) if d not in parties]
        for role, rank in slots:
            slot = keys.slot(role, rank)
            mine = self.bootstrap.encode(slot, aborted)
            raw = s.compare_set(slot, self.bootstrap.encode(slot, SlotOpen(epoch=keys.epoch)), mine)
            if raw == mine:
                closed.append(keys.party(role, rank))
                continue
            if role == "prefill" and s.check([slot]):
                msg = self.bootstrap.decode(slot, raw, SlotOpen, Claim, Aborted)
                if isinstance(msg, Claim):
                    claimed[rank] = (msg, SendProgress(s.add(keys.progress(rank), ABORT)).drained)
        for r, claim in (answered or {}).items():
            if r not in claimed:
                claimed[r] = (claim, SendProgress(s.add(keys.progress(r), ABORT)).drained)
        when = time.monotonic()
        if self.posts and 0 in parties:
            self._drop_request_key(s, keys)
        if closed:
            self._finish(s, keys, closed, unlist=False)
        return claimed, when

    def _drop_request_key(self, s: dist.Store, keys: AttemptKeys) -> None:
        key = request_key(keys.request_id)
        if s.check([key]):
            req = self.bootstrap.decode(key, s.get(key), DstRequest)
            if req.epoch == keys.epoch:
                s.delete_key(key)

    def _refresh(self, deadline: float) -> None:
        """Release every quarantined attempt whose claimed senders all drained, or whose grace period passed
        (polling their progress counters once, bounded by ``deadline``)."""
        done, waiting = self._quarantine.due()
        for att in done:
            self._release(att)
        if not waiting or time_left(deadline) <= 0:
            return
        counters = [att.keys.progress(r) for att, ranks in waiting.items() for r in ranks]
        try:
            values = self.bootstrap.call(
                lambda s: [s.add(k, 0) for k in counters], deadline=deadline, what="poll quarantined attempts"
            )
        except TransferError:
            return  # still quarantined; the next call polls again
        for att in self._quarantine.record_drained(waiting, values):
            self._release(att)

    def _release(self, att: PostedAttempt) -> None:
        """Return a failed attempt's pages, metadata slot and staging region; finish it in the store."""
        self._quarantine.remove(att)
        self._release_staging(att)
        self._released.append((att.request_id, att.dst))

        def job(s: dist.Store) -> None:
            keys = att.keys  # read here: after every bind and abort of the attempt
            if keys is None:
                return
            self._finish(s, keys, [keys.party("decode", d) for d in att.bound])  # the bits, then un-listed

        self.bootstrap.post(job, what=f"finish {att.request_id!r}")

    def _release_staging(self, att: PostedAttempt) -> None:
        for d in [d for d, holder in self._staging_holder.items() if holder is att]:
            del self._staging_holder[d]

    def reclaim(self, timeout_s: float = 0.0) -> list[tuple[str, np.ndarray]]:
        """Failed requests whose pages may be reused now, each once: ``[(request_id, dst_pages), ...]``.

        Waits up to ``timeout_s`` for the quarantine to end (polling the store).
        """
        deadline = deadline_after(timeout_s)
        backoff = Backoff(deadline)
        while True:
            self._refresh(deadline_after(min(0.5, max(time_left(deadline), 0.05))))
            if not self._quarantine or not backoff.sleep():
                break
        out, self._released = self._released, []
        return out

    # ------------------------------------------------------------------------------------------ close, restart
    def _release_attempts(self) -> None:
        """(Close, memory unregistered: late bytes can no longer land.) Give up and finish every attempt."""
        self._responder.close()
        for att in list(self._pending.values()):
            self._pending.pop(att.request_id, None)
            att.closed = True
            att.abort = self.bootstrap.post(lambda s, a=att: self._fence(s, a), what="abort")
            self._release(att)
        for att in list(self._quarantine.attempts):
            self._release(att)

    def _finish_dead(self, s: dist.Store, keys: AttemptKeys, ranks: list[int], dead: set[str]) -> None:
        """(On the store worker.) A dead incarnation (uids ``dead``) of decode ``ranks`` held ``keys``: give it up
        and finish it: the bits of the hosted slots it bound and of the slots it closed that are not set yet."""
        held = set()
        for d in ranks:
            slot = keys.slot("decode", d)
            if s.check([slot]) and isinstance(
                self.bootstrap.decode(slot, s.get(slot), SlotOpen, Ready, Aborted), Ready
            ):
                held.add(d)
        self._abort(s, keys, held)
        parties = [keys.party("decode", d) for d in sorted(held)]
        slots = [("prefill", r) for r in range(keys.num_prefill)] + [("decode", d) for d in range(keys.num_decode)]
        for role, rank in slots:
            slot = keys.slot(role, rank)
            if not s.check([slot]):
                continue
            msg = self.bootstrap.decode(slot, s.get(slot), SlotOpen, Ready, Claim, Aborted)
            if isinstance(msg, Aborted) and msg.by in dead:
                parties.append(keys.party(role, rank))
        self._finish(s, keys, keys.unfinished(s, parties))
