"""``PrefillSender``: each prefill CP rank sends the pages it owns, with their positions, to decode.

The protocol (keys, slots, progress, quarantine, cleanup) is :mod:`dtkv.transfer.protocol`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from dtkv._util import cdiv
from dtkv.transfer._claim import Attempt, ClaimSteps, check_not_aborted
from dtkv.transfer._side import TransferSide
from dtkv.transfer.bootstrap import Bootstrap
from dtkv.transfer.descriptors import RequestPlan, as_pages
from dtkv.transfer.engine import MAX_ENTRIES_PER_CALL, send_entries
from dtkv.transfer.errors import TransferError
from dtkv.transfer.messages import Aborted, Claim, DstRequest, SendOutcome, SendStart, SlotOpen
from dtkv.transfer.plan import PlanOptions, plan_request
from dtkv.transfer.protocol import (
    DONE,
    DRAINED,
    STARTED,
    AttemptKeys,
    SendProgress,
    check_request_id,
    deadline_after,
    time_left,
)
from dtkv.transfer.shard import KVShard

__all__ = ["PrefillSender", "SendReport"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class SendReport:
    """What this process sent for one request (summed over the prefill ranks it hosts)."""

    request_id: str
    ranks: tuple[int, ...]
    num_positions: int
    """Positions (pages) sent by these ranks."""
    num_entries: int
    num_calls: int
    num_bytes: int
    plan_entries: int
    """Entries of the whole request, every prefill rank."""
    min_entries: int
    """The fewest entries any plan of the request needs (:attr:`dtkv.transfer.RequestPlan.min_entries`)."""
    plan_s: float
    pack_s: float
    """Time spent packing staging regions (all but the first layer group overlap the sending)."""
    send_s: float
    """The rest: engine calls not overlapped by packing, and store updates."""


class PrefillSender(ClaimSteps, TransferSide):
    """The prefill side of PD transfer for the CP ranks hosted by this process (normally one).

    Registers the shards with the engine and publishes their endpoints at construction; :meth:`connect` then
    waits for every prefill and decode endpoint. Each prefill rank calls :meth:`send_request` for a request
    (SPMD, with the same ``src_pages``); it waits for decode's attempt, claims its slot, waits until every decode
    rank took part, computes the shared :class:`dtkv.transfer.RequestPlan`, packs its staging regions, sends its
    entries and reports its positions.

    Args:
        shards: this process's prefill ranks (:class:`dtkv.transfer.KVShard`, e.g. ``KVShard.from_pool(pool)``).
        bootstrap: the rendezvous store shared with decode.
        engine: an engine, or the name of one to create (``"mooncake"``, the default, ``"nixl"``, ``"local"``;
            :class:`dtkv.transfer.TransferSide`).
        options: planner options (staging policy, metadata sender, layer groups).
        timeout_s: bound on every wait (default ``DTKV_TRANSFER_TIMEOUT_S``).
        max_entries_per_call: entries per engine call (<= 1024 for Mooncake 0.3.13 TCP).
    """

    def __init__(
        self,
        shards: KVShard | Sequence[KVShard],
        bootstrap: Bootstrap,
        *,
        engine=None,
        options: PlanOptions | None = None,
        timeout_s: float | None = None,
        max_entries_per_call: int = MAX_ENTRIES_PER_CALL,
    ) -> None:
        # set once the drained report of a concluded attempt with engine calls still running is queued
        # (close() waits for them: see _release_attempts); before super().__init__, which may adopt attempts
        self._drains: set[threading.Event] = set()
        self._drains_lock = threading.Lock()
        super().__init__(shards, bootstrap, "prefill", engine=engine, timeout_s=timeout_s)
        self.options = options or PlanOptions()
        self.max_entries_per_call = max_entries_per_call

    def plan(
        self, src_pages: object, req: DstRequest, src_meta_slot: int | None, *, staging: Sequence[bool] | None = None
    ) -> RequestPlan:
        """The request's plan (host-side; identical on every prefill rank).

        Args:
            staging: per decode rank, whether its staging region was granted (default: all of them).
        """
        if self.prefill is None or self.decode is None:
            self.connect()
        decode = [
            ep if staging is None or staging[d] else replace(ep, staging_bytes=0) for d, ep in enumerate(self.decode)
        ]
        return plan_request(
            src_pages,
            req.dst_pages,
            prefill=self.prefill,
            decode=decode,
            options=self.options,
            src_meta_slot=src_meta_slot if req.dst_meta_slot is not None else None,
            dst_meta_slot=req.dst_meta_slot if src_meta_slot is not None else None,
        )

    def send_request(
        self,
        request_id: str,
        src_pages: object,
        *,
        meta: bytes | None = None,
        src_meta_slot: int = 0,
        timeout_s: float | None = None,
    ) -> SendReport:
        """Send this process's owned pages of one request to decode (blocking).

        Args:
            request_id: the id decode posted the request under (no ``/``); a retry after a failure reuses it.
            src_pages: int ``[num_positions]``: the request's logical prefill pages in token order (identical on
                every prefill rank).
            meta: the replicated metadata row; only ``options.meta_sender`` sends it (to every decode rank).
            src_meta_slot: the metadata row of the sender that stages ``meta``.
            timeout_s: bound on the whole call (default: the sender's); no engine call starts after it.

        Returns:
            A :class:`SendReport`.

        Raises:
            TransferError: decode did not post the request in time or gave it up, an engine call failed or timed
                out, or the store did not answer in time (decode is told through the store whenever it can be).
        """
        request_id = check_request_id(request_id)
        deadline = deadline_after(self.timeout_s if timeout_s is None else timeout_s)
        t0 = time.perf_counter()
        if self.prefill is None or self.decode is None:
            self.connect(time_left(deadline))
        ranks = tuple(sorted(self.shards))
        req, att = self._claim(request_id, ranks, deadline)
        keys = att.keys
        try:
            src = as_pages("src_pages", src_pages)
            if req.num_tokens is not None:
                page_size = next(iter(self.shards.values())).page_size
                want = cdiv(req.num_tokens, page_size)
                if src.shape[0] != want:
                    raise ValueError(
                        f"src_pages must hold ceil(num_tokens / page_size) = {want} pages for num_tokens="
                        f"{req.num_tokens}, got {src.shape[0]}"
                    )
            use_meta = meta is not None and self.options.meta_sender in self.shards
            if use_meta:
                row = self.shards[self.options.meta_sender].meta
                if row is None or len(meta) > row.shape[1]:
                    raise ValueError(
                        f"meta must fit a metadata row of {0 if row is None else row.shape[1]} bytes, got {len(meta)}"
                    )
                row[src_meta_slot].zero_()
                row[src_meta_slot, : len(meta)].copy_(_as_u8(meta))
            ready = self._wait_ready(att, deadline)
            plan = self.plan(src, req, src_meta_slot if meta is not None else None, staging=[r.staging for r in ready])
            t_plan = time.perf_counter()
            senders = [plan.senders[r] for r in ranks]
            bounds = plan.layer_bounds
            pack_s = [0.0]

            def pack(g: int) -> None:
                tp = time.perf_counter()
                for sp in senders:
                    self.shards[sp.rank].pack(sp.pack, slice(int(bounds[g]), int(bounds[g + 1])))
                pack_s[0] += time.perf_counter() - tp

            starts = {
                sp.rank: self.bootstrap.encode(
                    keys.start(sp.rank),
                    SendStart(rank=sp.rank, positions=sp.positions, unpack=sp.unpack, layer_bounds=bounds),
                )
                for sp in senders
            }
            pack(0)  # while decode answers the claims
            self._wait_answers(att, deadline, ready)  # no byte is sent to an attempt whose liveness is not proven
            self._advance(att, deadline, starts=starts)
            calls = 0
            peers = [p for sp in senders for p in sp.peers]
            for g in range(plan.num_layer_groups):
                # while group g is in flight: announce group g - 1 (decode unpacks it) and pack group g + 1
                def overlap(g: int = g) -> None:
                    if g > 0:
                        self._advance(att, deadline)
                    if g + 1 < plan.num_layer_groups:
                        pack(g + 1)

                calls += send_entries(
                    self.engine,
                    peers,
                    request_id=request_id,
                    deadline=deadline,
                    max_entries_per_call=self.max_entries_per_call,
                    group=g,
                    overlap=overlap,
                    track=att.calls,
                )
        except BaseException as e:
            self._conclude(att, error=f"{type(e).__name__}: {e}")
            raise
        t_pack = t_plan + pack_s[0]
        outcomes = {
            sp.rank: SendOutcome(
                rank=sp.rank,
                ok=True,
                num_entries=sp.num_entries,
                num_calls=calls if i == 0 else 0,
                num_bytes=sp.num_bytes,
                plan_entries=plan.num_entries,
                min_entries=plan.min_entries,
            )
            for i, sp in enumerate(senders)
        }
        self._conclude(att, outcomes=outcomes, deadline=deadline)
        t_end = time.perf_counter()
        sent = sum(sp.num_bytes for sp in senders)
        logger.info(
            "sent %r (prefill ranks %s): %d bytes in %.3f s (%.3f GB/s), %d entries in %d calls",
            request_id,
            list(ranks),
            sent,
            t_end - t0,
            sent / max(t_end - t0, 1e-9) / 1e9,
            plan.num_entries,
            calls,
        )
        return SendReport(
            request_id=request_id,
            ranks=ranks,
            num_positions=sum(int(sp.positions.shape[0]) for sp in senders),
            num_entries=sum(sp.num_entries for sp in senders),
            num_calls=calls,
            num_bytes=sum(sp.num_bytes for sp in senders),
            plan_entries=plan.num_entries,
            min_entries=plan.min_entries,
            plan_s=t_plan - t0,
            pack_s=t_pack - t_plan,
            send_s=t_end - t_pack,
        )

    # ------------------------------------------------------------------------------------------ protocol steps
    def _advance(self, att: Attempt, deadline: float, *, starts: dict[int, bytes] | None = None) -> None:
        """Post the ranks' starts (+STARTED), or announce one more layer group landed (+1); stop on ABORT."""
        keys = att.keys

        def job(s: dist.Store) -> list[int]:
            if starts is None:
                return [s.add(keys.progress(r), 1) for r in att.ranks]
            out = []
            for r in att.ranks:
                s.set(keys.start(r), starts[r])
                out.append(s.add(keys.progress(r), STARTED))
            return out

        what = "post start" if starts is not None else "announce a layer group"
        progress = self.bootstrap.call(
            job,
            deadline=deadline,
            what=f"{what} of {keys.prefix}",
            request_id=keys.request_id,
            peer="decode",
            write=True,
        )
        check_not_aborted(keys, progress)

    def _conclude(
        self,
        att: Attempt,
        *,
        outcomes: dict[int, SendOutcome] | None = None,
        error: str = "",
        deadline: float | None = None,
    ) -> None:
        """Report the attempt's outcome on every hosted rank whose slot this side holds, and finish it.

        On success decode learns DONE and DRAINED at once and this waits (until ``deadline``) for the report to
        land, raising ``TransferError`` if decode gave the request up meanwhile. On failure the report is queued,
        and DRAINED follows once every engine call of the attempt ended; only then does this side count itself
        finished. A slot that is not this side's (its claim never landed, or decode closed it first) is left
        alone: whoever closed it finished it.
        """
        if att.concluded:
            return
        att.concluded = True
        keys = att.keys
        if outcomes is None:
            outcomes = {r: SendOutcome(rank=r, ok=False, error=error) for r in att.ranks}
        done_raw = {r: self.bootstrap.encode(keys.done(r), o) for r, o in outcomes.items()}
        pending = [f for f in att.calls if not f.done()]

        def mine(s: dist.Store) -> list[int]:
            return [
                r
                for r in att.ranks
                if s.check([keys.slot("prefill", r)]) and s.get(keys.slot("prefill", r)) == att.claims[r]
            ]

        def finish(s: dist.Store, ranks: list[int]) -> None:  # the bits first, then un-listed
            self._finish(s, keys, [keys.party("prefill", r) for r in ranks])

        ok = all(o.ok for o in outcomes.values())

        def report(s: dist.Store) -> list[int]:
            ranks = list(att.ranks) if ok else mine(s)  # a sender that succeeded holds every slot it claimed
            progress = []
            for r in ranks:
                s.set(keys.done(r), done_raw[r])
                progress.append(s.add(keys.progress(r), DONE + (0 if pending else DRAINED)))
            if not pending:
                finish(s, ranks)
            return progress

        fut = self.bootstrap.post(report, what=f"report {keys.prefix}")
        if pending:
            queued = threading.Event()
            with self._drains_lock:
                self._drains.add(queued)

            def drained() -> None:
                try:
                    self.bootstrap.post(lambda s: self._drained(s, mine, finish, keys), what=f"drained {keys.prefix}")
                finally:
                    queued.set()
                    with self._drains_lock:
                        self._drains.discard(queued)

            self._when_ended(pending, drained)
        if ok and deadline is not None:
            try:
                progress = fut.result(timeout=time_left(deadline))
            except FutureTimeout:
                raise TransferError(
                    "the store did not take the completion report in time (stalled?); decode may time out",
                    request_id=keys.request_id,
                    peer="store",
                ) from None
            except Exception as e:  # noqa: BLE001
                raise TransferError(
                    f"posting the completion report failed: {e}", request_id=keys.request_id, peer="store"
                ) from e
            check_not_aborted(keys, progress)  # decode gave up while the last layer group was in flight

    def _release_attempts(self) -> None:
        """(Close, after the engine calls ended: the memory is unregistered.) Wait (bounded) until the drained
        report of every attempt whose calls outlived its conclusion is queued, so that close()'s flush runs it: an
        engine's own bookkeeping of a call ends before the call's later callbacks run, so a close that follows
        the last call at once would otherwise return before the attempt is finished (its keys left behind). A
        call still running past the engine's timeout (its unregister deferred) is not waited for beyond the
        bound: DRAINED is never reported under a running call."""
        deadline = deadline_after(self.timeout_s)
        with self._drains_lock:
            waiting = list(self._drains)
        for queued in waiting:
            if not queued.wait(max(0.0, time_left(deadline))):
                logger.warning(
                    "prefill close: an attempt's engine calls are still running; it is finished when they end"
                )
                return

    @staticmethod
    def _drained(s: dist.Store, mine, finish, keys: AttemptKeys) -> None:
        ranks = mine(s)
        for r in ranks:
            s.add(keys.progress(r), DRAINED)
        finish(s, ranks)

    @staticmethod
    def _when_ended(calls: list[Future], then) -> None:
        """Run ``then()`` once every future of ``calls`` is done (on the thread that ends the last one)."""
        left = [len(calls)]
        lock = threading.Lock()

        def one(_: Future) -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                then()

        for f in calls:
            f.add_done_callback(one)

    def _finish_dead(self, s: dist.Store, keys: AttemptKeys, ranks: list[int], dead: set[str]) -> None:
        """(On the store worker.) A dead incarnation claimed these ranks' slots: report its failure, set the bits
        it had not set."""
        mine = []
        for r in ranks:
            slot = keys.slot("prefill", r)
            if not s.check([slot]):
                continue
            msg = self.bootstrap.decode(slot, s.get(slot), SlotOpen, Claim, Aborted)
            if not isinstance(msg, Claim) or msg.incarnation == self.incarnation:
                continue
            mine.append(r)
            progress = SendProgress(s.add(keys.progress(r), 0))
            if not progress.done:
                raw = self.bootstrap.encode(keys.done(r), SendOutcome(rank=r, ok=False, error="prefill rank restarted"))
                s.set(keys.done(r), raw)
            s.add(keys.progress(r), (0 if progress.done else DONE) + (0 if progress.drained else DRAINED))
        self._finish(s, keys, keys.unfinished(s, [keys.party("prefill", r) for r in mine]))


def _as_u8(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)
