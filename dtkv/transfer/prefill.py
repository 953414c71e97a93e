"""``PrefillSender``: each prefill CP rank sends the pages it owns, with their positions, to decode."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dtkv.transfer._side import TransferSide
from dtkv.transfer.bootstrap import DONE, Bootstrap, DstRequest, SendOutcome, SendStart
from dtkv.transfer.descriptors import PlanOptions, RequestPlan, as_pages
from dtkv.transfer.engine import MAX_ENTRIES_PER_CALL, send_entries
from dtkv.transfer.errors import TransferError
from dtkv.transfer.plan import disable_staging, plan_request
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


class PrefillSender(TransferSide):
    """The prefill side of PD transfer for the CP ranks hosted by this process (normally one).

    Registers the shards with the engine and publishes their endpoints at construction; :meth:`connect` then
    waits for every prefill and decode endpoint. Each prefill rank calls :meth:`send_request` for a request
    (SPMD, with the same ``src_pages``); it waits for decode's page list, computes the shared
    :class:`dtkv.transfer.RequestPlan`, packs its staging regions, sends its entries and reports its positions.

    Args:
        shards: this process's prefill ranks (:class:`dtkv.transfer.KVShard`, e.g. ``KVShard.from_pool(pool)``).
        bootstrap: the rendezvous store shared with decode.
        engine: a :class:`MooncakeEngine` (default: a new one on 127.0.0.1) or :class:`LocalEngine`.
        options: planner options (staging policy, metadata sender).
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
        super().__init__(shards, bootstrap, "prefill", engine=engine, timeout_s=timeout_s)
        self.options = options or PlanOptions()
        self.max_entries_per_call = max_entries_per_call

    def plan(self, src_pages: object, req: DstRequest, src_meta_slot: int | None) -> RequestPlan:
        """The request's plan (host-side; identical on every prefill rank)."""
        if self.prefill is None or self.decode is None:
            self.connect()
        decode = self.decode if req.staging else disable_staging(self.decode)
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
            request_id: unique per bootstrap namespace; decode posts its pages under the same id.
            src_pages: int ``[num_positions]``: the request's logical prefill pages in token order (identical on
                every prefill rank).
            meta: the replicated metadata row; only ``options.meta_sender`` sends it (to every decode rank).
            src_meta_slot: the metadata row of the sender that stages ``meta``.
            timeout_s: bound on the whole call (default: the sender's).

        Returns:
            A :class:`SendReport`.

        Raises:
            TransferError: decode did not post its pages in time, an engine call failed or timed out (decode is
                told through the store so it does not wait for its own timeout).
        """
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        t0 = time.perf_counter()
        ranks = tuple(sorted(self.shards))
        req: DstRequest = self.bootstrap.get(
            f"req/{request_id}/dst", deadline=deadline, request_id=request_id, peer="decode"
        )
        try:
            src = as_pages("src_pages", src_pages)
            if req.num_tokens is not None:
                page_size = next(iter(self.shards.values())).page_size
                want = -(-req.num_tokens // page_size)
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
            plan = self.plan(src, req, src_meta_slot if meta is not None else None)
        except Exception as e:
            for r in ranks:
                self._report(request_id, SendOutcome(rank=r, ok=False, error=f"{type(e).__name__}: {e}"))
            raise
        t_plan = time.perf_counter()
        senders = [plan.senders[r] for r in ranks]
        bounds = plan.layer_bounds
        pack_s = [0.0]

        def pack(c: int) -> None:
            tp = time.perf_counter()
            for sp in senders:
                self.shards[sp.rank].pack(sp.pack, slice(int(bounds[c]), int(bounds[c + 1])))
            pack_s[0] += time.perf_counter() - tp

        def landed(c: int) -> None:  # layer group c is on decode: it may unpack it
            for sp in senders:
                if any(sp.unpack.values()):
                    self.bootstrap.add(f"req/{request_id}/progress/{sp.rank}", 1)

        try:
            for sp in senders:
                start = SendStart(rank=sp.rank, positions=sp.positions, unpack=sp.unpack, layer_bounds=bounds)
                self.bootstrap.set(f"req/{request_id}/start/{sp.rank}", start)
                self.bootstrap.add(f"req/{request_id}/progress/{sp.rank}", 1)
            pack(0)
            calls = 0
            peers = [p for sp in senders for p in sp.peers]
            for c in range(plan.num_chunks):
                # while group c is in flight: announce group c - 1 and pack group c + 1
                def overlap(c: int = c) -> None:
                    if c > 0:
                        landed(c - 1)
                    if c + 1 < plan.num_chunks:
                        pack(c + 1)

                calls += send_entries(
                    self.engine,
                    peers,
                    request_id=request_id,
                    deadline=deadline,
                    max_entries_per_call=self.max_entries_per_call,
                    chunk=c,
                    overlap=overlap,
                )
        except Exception as e:
            for r in ranks:
                self._report(request_id, SendOutcome(rank=r, ok=False, error=f"{type(e).__name__}: {e}"))
            raise
        t_pack = t_plan + pack_s[0]
        for i, sp in enumerate(senders):
            outcome = SendOutcome(
                rank=sp.rank,
                ok=True,
                num_entries=sp.num_entries,
                num_calls=calls if i == 0 else 0,
                num_bytes=sp.num_bytes,
                plan_entries=plan.num_entries,
                min_entries=plan.min_entries,
            )
            self._report(request_id, outcome)
        entries = sum(sp.num_entries for sp in senders)
        nbytes = sum(sp.num_bytes for sp in senders)
        positions = sum(int(sp.positions.shape[0]) for sp in senders)
        t_end = time.perf_counter()
        return SendReport(
            request_id=request_id,
            ranks=ranks,
            num_positions=positions,
            num_entries=entries,
            num_calls=calls,
            num_bytes=nbytes,
            plan_entries=plan.num_entries,
            min_entries=plan.min_entries,
            plan_s=t_plan - t0,
            pack_s=t_pack - t_plan,
            send_s=t_end - t_pack,
        )

    def _report(self, request_id: str, outcome: SendOutcome) -> None:
        try:
            self.bootstrap.set(f"req/{request_id}/done/{outcome.rank}", outcome)
            self.bootstrap.add(f"req/{request_id}/progress/{outcome.rank}", DONE)
        except TransferError as e:  # decode (or the store) may be gone; the caller's error matters more
            logger.warning("could not report request %r of prefill rank %d: %s", request_id, outcome.rank, e)


def _as_u8(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)
