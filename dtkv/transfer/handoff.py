"""The hand-off of pools in host or device memory: :class:`HandoffSender` and :class:`HandoffReceiver`.

Each side hands its pages to the engine in place where the engine can register the pool's memory, and through a
bounded pinned host *window* where it cannot (a CUDA pool under Mooncake's non-cuda wheel: see
:mod:`dtkv.transfer.memory` for which engine builds register device memory). Either side decides alone
(:func:`dtkv.transfer.memory.needs_host_staging`), so a staged side and an in-place side work together.

**Rounds.** A request of ``n`` positions travels in ``ceil(n / R)`` rounds of ``R = round_pages`` consecutive
positions (at least one round); round ``k`` is the protocol request ``f"{request_id}#{k}"``
(:meth:`dtkv.transfer.PrefillSender.send_request` / :meth:`dtkv.transfer.DecodeReceiver.receive_request`, with
every check and bound of the protocol), and the metadata row travels with the last round. ``R`` must be the same on
both sides: its default (:func:`default_round_pages`) depends only on the layouts and the layer count, which both
sides share; a side that posts or sends rounds of another size fails the first round at once, naming the rule.

**The window** of a staging rank holds ``2 * R`` pages per layer and buffer, in pinned host memory (when the pool is
on a GPU): two slots used alternately, registered once, reused by every round of every request. Round ``k`` uses
slot ``k % 2``; the positions a rank owns in the round fill its slot in position order, so the engine moves a
contiguous run per (rank pair, layer, buffer). On prefill the copies of round ``k + 1`` into the other slot (a
gather on the GPU, then device-to-host copies, on a side stream) run while round ``k`` is on the wire; on decode
the copies of round ``k`` into the pool (host-to-device, then a scatter) run while round ``k + 1`` is on the wire,
and the call returns once every copy has landed. Host memory per rank: ``2 * R * num_layers * page bytes``.

**Failures.** Every wait is bounded by the call's ``timeout_s`` (one deadline over all rounds). A round that fails
raises its :class:`dtkv.transfer.TransferError`; nothing is copied into the pool from it. On a staged decode side
late bytes of abandoned engine calls can land only in the window, never in the pool: the failed request's pool
pages are free to reuse at once (:attr:`HandoffReceiver.quarantined` does not list them), and a later round waits
(bounded) until its slot's quarantine ended. On an in-place decode side the round's pool pages stay quarantined as
:class:`dtkv.transfer.DecodeReceiver` keeps them, listed under the request's own id. Rounds before the failed one
have written the request's own pages; no other page of the pool changes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np

from dtkv._checks import check_int
from dtkv._util import cdiv
from dtkv.transfer._window import (
    DEFAULT_WINDOW_BYTES,
    HandoffSide,
    default_round_pages,
    round_request_id,
    round_tokens,
)
from dtkv.transfer.bootstrap import Bootstrap
from dtkv.transfer.decode import DecodeReceiver, ReceiveReport
from dtkv.transfer.engine import MAX_ENTRIES_PER_CALL
from dtkv.transfer.errors import TransferError
from dtkv.transfer.plan import PlanOptions
from dtkv.transfer.prefill import PrefillSender, SendReport
from dtkv.transfer.protocol import Backoff, deadline_after, time_left
from dtkv.transfer.shard import KVShard

__all__ = ["DEFAULT_WINDOW_BYTES", "HandoffReceiver", "HandoffSender", "default_round_pages", "round_request_id"]

logger = logging.getLogger(__name__)


class _HandoffEnd:
    """What both ends of a hand-off share: the window side (:class:`dtkv.transfer._window.HandoffSide`) and the
    protocol's sender or receiver over it (``_end``), whose shards, engine and timeout they are."""

    _side: HandoffSide
    _end: PrefillSender | DecodeReceiver

    def _log_start(self, what: str) -> None:
        logger.info(
            "%s %s, in rounds of %d pages%s",
            what,
            "through pinned host memory" if self.staged else "in place",
            self.round_pages,
            f" ({self._side.window_bytes() / 2**20:.1f} MiB of host windows)" if self.staged else "",
        )

    def _log_done(self, what: str, request_id: str, pages: int, rounds: int, nbytes: int, dt: float) -> None:
        """One line per request: INFO where it went through the window or in several rounds (else the protocol's
        own line of its one round says it), DEBUG otherwise."""
        staged = self.staged
        logger.log(
            logging.INFO if staged or rounds > 1 else logging.DEBUG,
            "%s %r over (%s ranks %s): %d pages in %d round(s)%s, %d bytes in %.3f s (%.3f GB/s)",
            what,
            request_id,
            "prefill" if isinstance(self._end, PrefillSender) else "decode",
            sorted(self._side.pools),
            pages,
            rounds,
            " through pinned host memory" if staged else "",
            nbytes,
            dt,
            nbytes / max(dt, 1e-9) / 1e9,
        )

    @property
    def staged(self) -> bool:
        """Whether this end hands over through the host window."""
        return self._side.staged

    @property
    def round_pages(self) -> int:
        return self._side.round_pages

    @property
    def shards(self) -> dict[int, KVShard]:
        """The shards the engine registered (the windows when staged: a decode window's metadata row receives the
        row), by rank."""
        return self._end.shards

    @property
    def engine(self):
        return self._end.engine

    @property
    def timeout_s(self) -> float:
        return self._end.timeout_s

    def connect(self, timeout_s: float | None = None) -> None:
        """Wait for every prefill and decode endpoint (:meth:`dtkv.transfer.TransferSide.connect`)."""
        self._end.connect(timeout_s)

    def close(self) -> None:
        """Close the protocol's sender or receiver (unregistering the windows or pools). Idempotent."""
        self._side.drain()
        self._end.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class HandoffSender(_HandoffEnd):
    """The prefill side of a hand-off (pools in host or device memory), over a :class:`dtkv.transfer.PrefillSender`.

    Args:
        shards: this process's prefill ranks over their pools (``KVShard.from_pool(pool, ...)``, zero copy; on a
            staging side the pools are never registered, and their staging buffer goes unused).
        bootstrap: the rendezvous store shared with decode.
        engine: a :class:`dtkv.transfer.MooncakeEngine` (default: a new one on 127.0.0.1) or
            :class:`dtkv.transfer.LocalEngine`.
        options, timeout_s, max_entries_per_call: as :class:`dtkv.transfer.PrefillSender`.
        round_pages: positions per round, the same on both sides (default :func:`default_round_pages`).
        staged: hand over through the host window (default: where the engine cannot register the pools' memory).
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
        round_pages: int | None = None,
        staged: bool | None = None,
    ) -> None:
        self._side = HandoffSide(shards, engine, round_pages, staged)
        self.sender = PrefillSender(
            self._side.engine_shards(), bootstrap, engine=engine, options=options, timeout_s=timeout_s,
            max_entries_per_call=max_entries_per_call,
        )  # fmt: skip
        """The protocol's sender (over the windows when staged)."""
        self._end = self.sender
        self._log_start(f"prefill ranks {sorted(self._side.pools)} hand over")

    def send_request(
        self,
        request_id: str,
        src_pages: object,
        *,
        meta: bytes | None = None,
        src_meta_slot: int = 0,
        timeout_s: float | None = None,
    ) -> SendReport:
        """Send this process's owned pages of one request, round after round (blocking; every prefill rank, same
        ``src_pages``).

        Args and Raises: as :meth:`dtkv.transfer.PrefillSender.send_request`, with ``timeout_s`` bounding every
        round together. Also ``TransferError`` when decode posted a round of another size (the two sides'
        ``round_pages`` differ).
        """
        src, rounds = self._side.check(request_id, src_pages, "src_pages")
        if meta is not None:
            rows = self.sender.shards.get(self.sender.options.meta_sender)
            width = 0 if rows is None or rows.meta is None else int(rows.meta.shape[1])
            if rows is not None and len(meta) > width:
                raise ValueError(f"meta must fit a metadata row of {width} bytes, got {len(meta)}")
        deadline = deadline_after(self.sender.timeout_s if timeout_s is None else timeout_s)
        t0 = time.perf_counter()
        side, reports, copy_s = self._side, [], 0.0
        placed = [side.place(src[sl], k % 2) for k, sl in enumerate(rounds)]
        for w in side.windows.values():
            w.follow_compute()
        try:
            for w in side.windows.values():
                w.gather(0, placed[0][1].get(w.rank, np.zeros(0, np.int64)))
            for k in range(len(rounds)):
                tc = time.perf_counter()
                for w in side.windows.values():
                    w.wait(k % 2)
                    if k + 1 < len(rounds):  # the other slot's round k - 1 has left: fill it while round k travels
                        w.gather((k + 1) % 2, placed[k + 1][1].get(w.rank, np.zeros(0, np.int64)))
                copy_s += time.perf_counter() - tc
                last = k == len(rounds) - 1
                left = time_left(deadline)
                if left <= 0:
                    raise TransferError(
                        f"timed out before round {k} of {len(rounds)}", request_id=request_id, peer="decode"
                    )
                rid = round_request_id(request_id, k)
                try:
                    rep = self.sender.send_request(
                        rid, placed[k][0], meta=meta if last else None, src_meta_slot=src_meta_slot, timeout_s=left
                    )
                except ValueError as e:
                    raise TransferError(
                        f"round {k} does not match decode's post ({e}): both sides must hand over in rounds of the "
                        f"same round_pages, {self.round_pages} here",
                        request_id=request_id, peer="decode",
                    ) from e  # fmt: skip
                reports.append(rep)
                logger.debug("sent round %d/%d of %r: %d bytes", k + 1, len(rounds), request_id, rep.num_bytes)
        finally:
            side.drain()
        dt = time.perf_counter() - t0
        nbytes = sum(r.num_bytes for r in reports)
        self._log_done("handed", request_id, int(src.shape[0]), len(rounds), nbytes, dt)
        return SendReport(
            request_id=request_id,
            ranks=tuple(sorted(side.pools)),
            num_positions=sum(r.num_positions for r in reports),
            num_entries=sum(r.num_entries for r in reports),
            num_calls=sum(r.num_calls for r in reports),
            num_bytes=nbytes,
            plan_entries=sum(r.plan_entries for r in reports),
            min_entries=sum(r.min_entries for r in reports),
            plan_s=sum(r.plan_s for r in reports),
            pack_s=sum(r.pack_s for r in reports) + copy_s,
            send_s=sum(r.send_s for r in reports),
        )


class HandoffReceiver(_HandoffEnd):
    """The decode side of a hand-off (pools in host or device memory), over a :class:`dtkv.transfer.DecodeReceiver`.

    Args:
        shards: the decode ranks hosted here over their pools (``KVShard.from_pool(pool, ...)``; on a staging side
            the pools are never registered).
        bootstrap: the rendezvous store shared with prefill.
        engine, timeout_s: as :class:`dtkv.transfer.DecodeReceiver`.
        round_pages: positions per round, the same on both sides (default :func:`default_round_pages`).
        staged: receive through the host window (default: where the engine cannot register the pools' memory).
    """

    def __init__(
        self,
        shards: KVShard | Sequence[KVShard],
        bootstrap: Bootstrap,
        *,
        engine=None,
        timeout_s: float | None = None,
        round_pages: int | None = None,
        staged: bool | None = None,
    ) -> None:
        self._side = HandoffSide(shards, engine, round_pages, staged)
        self.receiver = DecodeReceiver(self._side.engine_shards(), bootstrap, engine=engine, timeout_s=timeout_s)
        """The protocol's receiver (over the windows when staged)."""
        self._end = self.receiver
        self._log_start(f"decode ranks {sorted(self._side.pools)} take over")

    @property
    def quarantined(self) -> dict[str, np.ndarray]:
        """Failed requests whose pool pages (hosted here) may still receive late bytes: request id -> pages. Empty
        on a staging side (late bytes land in the window only)."""
        if self.staged:
            return {}
        out: dict[str, list[np.ndarray]] = {}
        for rid, pages in self.receiver.quarantined.items():
            out.setdefault(rid.rsplit("#", 1)[0] if "#" in rid else rid, []).append(np.asarray(pages))
        return {rid: np.unique(np.concatenate(p)) for rid, p in out.items()}

    def reclaim(self, timeout_s: float = 0.0) -> list[tuple[str, np.ndarray]]:
        """Failed requests whose pool pages may be reused now (:meth:`dtkv.transfer.DecodeReceiver.reclaim`); on a
        staging side it ends the windows' quarantines and lists nothing (the pool pages were never at risk)."""
        released = self.receiver.reclaim(timeout_s)
        return [] if self.staged else released

    def receive_request(
        self,
        request_id: str,
        dst_pages: object,
        *,
        num_tokens: int | None = None,
        dst_meta_slot: int | None = None,
        timeout_s: float | None = None,
        staging: bool = True,
    ) -> ReceiveReport:
        """Receive one request into ``dst_pages`` (int ``[num_positions]``), round after round (blocking; every
        decode rank, same pages). On return every byte is in the pools.

        Args and Raises: as :meth:`dtkv.transfer.DecodeReceiver.receive_request`, with ``timeout_s`` bounding
        every round together; ``num_tokens``, when given, must need exactly ``len(dst_pages)`` pages.
        """
        dst, rounds = self._side.check(request_id, dst_pages, "dst_pages")
        if num_tokens is not None:
            check_int("num_tokens", num_tokens, min_value=0)
            if cdiv(num_tokens, self._side.page_size) != dst.shape[0]:
                raise ValueError(
                    f"num_tokens must need len(dst_pages) = {dst.shape[0]} pages of {self._side.page_size} tokens, "
                    f"got num_tokens={num_tokens}"
                )
        deadline = deadline_after(self.receiver.timeout_s if timeout_s is None else timeout_s)
        t0 = time.perf_counter()
        side, reports, copy_s = self._side, [], 0.0
        for w in side.windows.values():
            w.follow_compute()  # the copies into the pool after whatever the current stream still does to it
        try:
            for k, sl in enumerate(rounds):
                slot = k % 2
                pages, local = side.place(dst[sl], slot)
                tc = time.perf_counter()
                for w in side.windows.values():
                    w.wait(slot)  # round k - 2's copies out of this slot have run
                copy_s += time.perf_counter() - tc
                if side.staged:
                    self._wait_slot_free(request_id, deadline)
                last = k == len(rounds) - 1
                left = time_left(deadline)
                if left <= 0:
                    raise TransferError(
                        f"timed out before round {k} of {len(rounds)}", request_id=request_id, peer="prefill",
                        pages=dst[sl.start :],
                    )  # fmt: skip
                rep = self.receiver.receive_request(
                    round_request_id(request_id, k), pages, num_tokens=round_tokens(num_tokens, sl, side.page_size),
                    dst_meta_slot=dst_meta_slot if last else None, timeout_s=left, staging=staging,
                )  # fmt: skip
                reports.append(rep)
                for w in side.windows.values():
                    w.scatter(slot, local.get(w.rank, np.zeros(0, np.int64)))
                logger.debug("received round %d/%d of %r: %d bytes", k + 1, len(rounds), request_id, rep.num_bytes)
        finally:
            tc = time.perf_counter()
            side.drain()
            tail_s = time.perf_counter() - tc
        dt = time.perf_counter() - t0
        nbytes = sum(r.num_bytes for r in reports)
        self._log_done("took", request_id, int(dst.shape[0]), len(rounds), nbytes, dt)
        return ReceiveReport(
            request_id=request_id,
            num_positions=int(dst.shape[0]),
            num_entries=sum(r.num_entries for r in reports),
            min_entries=sum(r.min_entries for r in reports),
            num_calls=sum(r.num_calls for r in reports),
            num_bytes=nbytes,
            staged=side.staged or any(r.staged for r in reports),
            wait_s=sum(r.wait_s for r in reports),
            unpack_s=sum(r.unpack_s for r in reports) + copy_s + tail_s,
            tail_s=(reports[-1].tail_s if reports else 0.0) + tail_s,
        )

    def _wait_slot_free(self, request_id: str, deadline: float) -> None:
        """Wait (bounded by ``deadline``) until no attempt on the window is quarantined after a failed round."""

        def busy() -> bool:  # any quarantined attempt: the window is small and its metadata row shared
            return bool(self.receiver.quarantined)

        if not busy():
            return
        backoff = Backoff(deadline)
        while True:
            self.receiver.reclaim(min(0.5, max(time_left(deadline), 0.0)))
            if not busy():
                return
            if not backoff.sleep():
                raise TransferError(
                    "the host window is still quarantined after a failed transfer (late bytes of its abandoned "
                    "engine calls may land in it)", request_id=request_id, peer="prefill",
                )  # fmt: skip
