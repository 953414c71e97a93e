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

from dtkv.transfer._side import TransferSide
from dtkv.transfer.bootstrap import Bootstrap
from dtkv.transfer.descriptors import as_pages
from dtkv.transfer.errors import TransferError, format_pages
from dtkv.transfer.messages import Aborted, Claim, DstRequest, Ready, SendOutcome, SendStart, SlotOpen
from dtkv.transfer.protocol import (
    ABORT,
    AttemptKeys,
    Backoff,
    Progress,
    check_request_id,
    deadline_after,
    new_epoch,
    request_key,
    time_left,
)
from dtkv.transfer.quarantine import PostedAttempt, Quarantine
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


class DecodeReceiver(TransferSide):
    """The decode side of PD transfer for the decode ranks hosted by this process.

    A non-CP decode hosts one shard of ``PageOwnership(1, num_pages)``; a CP decode runs one receiver per rank
    (SPMD: every receiver posts and waits for the same requests), or hosts all of its ranks in one process
    (tests, benchmarks). The receiver hosting decode rank 0 opens each attempt; the others take part in it.

    Each decode rank grants its own staging region to at most one request at a time: to the first one posted
    while it is free, until that request was unpacked here (or, if it failed, until its quarantine ended).

    **Failures and page reuse.** When a wait fails, prefill calls abandoned after a timeout may still be writing
    into the request's pages (and staging region, and metadata slot). Those stay *quarantined* until every
    prefill rank that took part reported its calls ended, or a grace period passed (:mod:`dtkv.transfer.protocol`);
    :meth:`post_request` refuses quarantined pages. Free a failed request's pages only once :meth:`reclaim`
    lists it.

    Args:
        shards: the decode ranks hosted here (:class:`dtkv.transfer.KVShard`); give them ``staging_bytes`` to
            let prefill pack strided pages into one entry per rank pair.
        bootstrap: the rendezvous store shared with prefill.
        engine: a :class:`MooncakeEngine` (default: a new one on 127.0.0.1) or :class:`LocalEngine`.
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

        Raises:
            ValueError: ``request_id`` is already posted here and not waited for, or ``dst_pages`` (or
                ``dst_meta_slot``) holds pages of a failed request still in quarantine.
            TransferError: the store did not take the request in time (its pages are then quarantined too).
        """
        request_id = check_request_id(request_id)
        dst = as_pages("dst_pages", dst_pages)
        if self.prefill is None or self.decode is None:
            self.connect()
        if request_id in self._pending:
            raise ValueError(
                f"request_id must not be pending on this receiver already (wait for it first), got "
                f"request_id={request_id!r}"
            )
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
            for k, raw in raws[:-1]:
                s.set(k, raw)
            self._hold(keys, True)
            self._write_open(s)
            s.set(*raws[-1])  # last: prefill finds every slot once it sees the request

        self.bootstrap.call(
            job, deadline=deadline, what=f"open {keys.prefix}", request_id=att.request_id, peer="store", write=True
        )

    def _bind(self, att: PostedAttempt, deadline: float, *, wait: bool) -> None:
        """(Decode ranks other than 0.) Take part in decode rank 0's current attempt: claim the hosted slots."""
        key = request_key(att.request_id)
        hosted = sorted(self.shards)

        def job(s: dist.Store):
            if not s.check([key]):
                return None
            req = self.bootstrap.decode(key, s.get(key), DstRequest, request_id=att.request_id, peer="decode rank 0")
            keys = AttemptKeys(att.request_id, req.epoch, req.num_prefill, req.num_decode)
            got = {}
            for d in hosted:
                slot = keys.slot("decode", d)
                ready = self.bootstrap.encode(slot, self._ready(keys, att, d))
                raw = s.compare_set(slot, self.bootstrap.encode(slot, SlotOpen(epoch=keys.epoch)), ready)
                got[d] = "bound" if raw == ready else self._slot_state(slot, raw)
            if "bound" in got.values():
                self._hold(keys, True)
                self._write_open(s)
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
                if "stale" not in got.values():  # an attempt this receiver already took part in is not this one
                    att.bound = tuple(d for d in hosted if got[d] == "bound")
                    att.keys = keys if att.bound else None  # not a party of the attempt: never touch its keys
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
            starts, outcomes, unpack_s = self._wait_outcomes(att, deadline)
            t1 = time.perf_counter()
            self._check_coverage(att, starts)
        except BaseException:
            self._fail(att)
            raise
        self._succeed(att)
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

    def _check_coverage(self, att: PostedAttempt, starts: list[SendStart]) -> None:
        n = int(att.dst.shape[0])
        positions = np.concatenate([st.positions for st in starts] + [np.zeros(0, np.int64)])
        counts = np.bincount(positions[positions < n], minlength=n)
        if positions.size != n or not np.all(counts == 1):
            missing = np.flatnonzero(counts == 0)
            repeated = np.flatnonzero(counts > 1)
            raise TransferError(
                f"positions must arrive exactly once, got missing {format_pages(missing)}, repeated "
                f"{format_pages(repeated)} and {int((positions >= n).sum())} out of range",
                request_id=att.request_id,
                peer="prefill",
                pages=att.dst[missing] if missing.size else (),
            )

    def _wait_outcomes(self, att: PostedAttempt, deadline: float):
        """Poll every sender's progress counter; read its start and done records, unpack each group once it landed.

        Returns ``(starts, outcomes, (unpack seconds, unpack seconds after the last done))``.
        """
        keys = att.keys
        num_prefill = keys.num_prefill
        starts: dict[int, SendStart] = {}
        done: dict[int, SendOutcome] = {}
        unpacked = dict.fromkeys(range(num_prefill), 0)  # layer groups of each sender unpacked so far
        unpack_s = [0.0, 0.0]
        rid = att.request_id

        def unpack_upto(r: int, stop: int, tail: bool) -> None:
            st = starts[r]
            t = time.perf_counter()
            for g in range(unpacked[r], stop):
                layers = slice(int(st.layer_bounds[g]), int(st.layer_bounds[g + 1]))
                for d, shard in self.shards.items():
                    shard.unpack(st.unpack.get(d, ()), layers)
            unpacked[r] = max(unpacked[r], stop)
            dt = time.perf_counter() - t
            unpack_s[0] += dt
            unpack_s[1] += dt if tail else 0.0

        def poll(s: dist.Store) -> list:
            out = []
            for r in range(num_prefill):
                if r in done:
                    out.append(None)
                    continue
                p = Progress(s.add(keys.progress(r), 0))
                start = s.get(keys.start(r)) if p.started and r not in starts else None
                outcome = s.get(keys.done(r)) if p.done else None
                out.append((p, start, outcome))
            return out

        timeout = lambda: TransferError(
            f"timed out waiting for prefill ranks {sorted(set(range(num_prefill)) - set(done))}",
            request_id=rid,
            peer=f"prefill rank {min(set(range(num_prefill)) - set(done))}",
            pages=att.dst,
        )
        backoff = Backoff(deadline, timeout)
        while len(done) < num_prefill:
            if time_left(deadline) <= 0:
                raise timeout()
            polled = self.bootstrap.call(
                poll, deadline=deadline, what=f"poll {keys.prefix}", request_id=rid, peer="prefill"
            )
            progressed = False
            for r, item in enumerate(polled):
                if item is None:
                    continue
                p, start_raw, done_raw = item
                peer = f"prefill rank {r}"
                if p.aborted:
                    raise TransferError(
                        "a decode rank gave the request up", request_id=rid, peer="decode", pages=att.dst
                    )
                if start_raw is not None:
                    starts[r] = self._checked_start(keys, r, start_raw)
                    progressed = True
                if done_raw is not None:
                    out = self.bootstrap.decode(keys.done(r), done_raw, SendOutcome, request_id=rid, peer=peer)
                    if not out.ok:
                        raise TransferError(out.error, request_id=rid, peer=peer, pages=att.dst)
                    if r not in starts:
                        raise TransferError("reported done without a start", request_id=rid, peer=peer)
                    done[r] = out
                    progressed = True
                if r in starts and min(p.groups_landed, starts[r].layer_bounds.shape[0] - 1) > unpacked[r]:
                    unpack_upto(r, min(p.groups_landed, starts[r].layer_bounds.shape[0] - 1), tail=False)
                    progressed = True
            if len(done) < num_prefill:
                backoff.wait(progressed)
        for r in range(num_prefill):  # the groups not announced separately (at least the last one)
            unpack_upto(r, int(starts[r].layer_bounds.shape[0]) - 1, tail=True)
        order = range(num_prefill)
        return [starts[r] for r in order], [done[r] for r in order], unpack_s

    def _checked_start(self, keys: AttemptKeys, r: int, raw: bytes) -> SendStart:
        """A sender's start, checked against the hosted shards before any of its copies runs."""
        key = keys.start(r)
        st = self.bootstrap.decode(key, raw, SendStart, request_id=keys.request_id, peer=f"prefill rank {r}")
        problem = ""
        num_layers = next(iter(self.shards.values())).num_layers
        if st.rank != r:
            problem = f"it describes prefill rank {st.rank}"
        elif int(st.layer_bounds[-1]) != num_layers:
            problem = f"its layer groups end at layer {int(st.layer_bounds[-1])}, not {num_layers}"
        else:
            for d, copies in st.unpack.items():
                if d in self.shards:
                    try:
                        self.shards[d].check_copies(copies)
                    except ValueError as e:
                        problem = f"decode rank {d}: {e}"
                        break
                    if not self._pending_staging(keys.request_id, d):
                        problem = f"it unpacks decode rank {d}'s staging, which this request was not granted"
                        break
        if problem:
            raise TransferError(
                f"malformed value under key {self.bootstrap.namespace}/{key}: {problem}",
                request_id=keys.request_id,
                peer=f"prefill rank {r}",
            )
        return st

    def _pending_staging(self, request_id: str, d: int) -> bool:
        att = self._pending.get(request_id)
        return att is not None and att.staging.get(d, False)

    # ------------------------------------------------------------------------------------------ outcome
    def _succeed(self, att: PostedAttempt) -> None:
        self._pending.pop(att.request_id, None)
        self._release_staging(att)
        keys, weight = att.keys, len(att.bound)

        def job(s: dist.Store) -> None:
            if self.posts:
                self._drop_request_key(s, keys)
            self._hold(keys, False)
            self._write_open(s)
            keys.finish(s, weight)

        self.bootstrap.post(job, what=f"finish {keys.prefix}")

    def _fail(self, att: PostedAttempt) -> None:
        """Give the attempt up: close the open slots, tell the claimed senders, quarantine the pages."""
        self._pending.pop(att.request_id, None)
        if att.keys is None:  # nobody could have planned a transfer into these pages
            self._release(att)
            return
        keys, bound = att.keys, set(att.bound)
        att.abort = self.bootstrap.post(lambda s: self._abort(s, keys, bound), what=f"abort {keys.prefix}")
        self._quarantine.add(att)
        try:
            att.abort.result(timeout=_ABORT_WAIT_S)
        except Exception:  # noqa: BLE001 - a stalled store: the quarantine waits for the abort to land
            pass
        self._refresh(deadline_after(0.0))

    def _abort(self, s: dist.Store, keys: AttemptKeys, parties: set[int]):
        """(On the store worker.) Close every OPEN slot of ``keys`` except decode ``parties``' and finish those
        slots; add ABORT to every claimed prefill rank's progress. Returns ``(claimed, when)``."""
        closed = 0
        claimed: dict[int, tuple[Claim, bool]] = {}
        aborted = Aborted(epoch=keys.epoch, by=self.uid)
        slots = [("prefill", r) for r in range(keys.num_prefill)]
        slots += [("decode", d) for d in range(keys.num_decode) if d not in parties]
        for role, rank in slots:
            slot = keys.slot(role, rank)
            mine = self.bootstrap.encode(slot, aborted)
            raw = s.compare_set(slot, self.bootstrap.encode(slot, SlotOpen(epoch=keys.epoch)), mine)
            if raw == mine:
                closed += 1
                continue
            if role == "prefill" and s.check([slot]):
                msg = self.bootstrap.decode(slot, raw, SlotOpen, Claim, Aborted)
                if isinstance(msg, Claim):
                    claimed[rank] = (msg, Progress(s.add(keys.progress(rank), ABORT)).drained)
        when = time.monotonic()
        if self.posts and 0 in parties:
            self._drop_request_key(s, keys)
        if closed:
            keys.finish(s, closed)
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
        keys, weight = att.keys, len(att.bound)
        if keys is None:
            return

        def job(s: dist.Store) -> None:
            self._hold(keys, False)
            self._write_open(s)
            if weight:
                keys.finish(s, weight)

        self.bootstrap.post(job, what=f"finish {keys.prefix}")

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
        for att in list(self._pending.values()):
            self._pending.pop(att.request_id, None)
            if att.keys is not None:
                keys, bound = att.keys, set(att.bound)
                att.abort = self.bootstrap.post(lambda s, k=keys, b=bound: self._abort(s, k, b), what="abort")
            self._release(att)
        for att in list(self._quarantine.attempts):
            self._release(att)

    def _finish_dead(self, s: dist.Store, keys: AttemptKeys, ranks: list[int]) -> None:
        """(On the store worker.) A dead incarnation of decode ``ranks`` held ``keys``: give it up and finish it."""
        held = set()
        for d in ranks:
            slot = keys.slot("decode", d)
            if s.check([slot]) and isinstance(
                self.bootstrap.decode(slot, s.get(slot), SlotOpen, Ready, Aborted), Ready
            ):
                held.add(d)
        self._abort(s, keys, held)
        if held:
            keys.finish(s, len(held))
