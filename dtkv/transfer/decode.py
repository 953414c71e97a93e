"""``DecodeReceiver``: decode posts where each position goes, waits for every prefill rank, rebuilds its layout."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dtkv.transfer._side import TransferSide
from dtkv.transfer.bootstrap import DONE, MAX_POLL_S, Bootstrap, DstRequest, SendOutcome, SendStart
from dtkv.transfer.descriptors import as_pages
from dtkv.transfer.errors import TransferError, format_pages
from dtkv.transfer.shard import KVShard

__all__ = ["DecodeReceiver", "ReceiveReport"]


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

    A non-CP decode hosts one shard of ``PageOwnership(1, num_pages)``; a CP decode runs one receiver per rank,
    or hosts all of its ranks in one process (tests, benchmarks). Only the receiver hosting decode rank 0
    posts a request's page list; every receiver waits for all prefill ranks and unpacks its own staging.

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
        self._pending: dict[str, tuple[np.ndarray, bool]] = {}
        self._staging_request: str | None = None
        self._staging_blocked_until = 0.0

    @property
    def posts(self) -> bool:
        """Whether this receiver hosts decode rank 0 (the one that posts page lists)."""
        return 0 in self.shards

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

        Staging is used by one request at a time: while an earlier request holding it is not yet received
        (or for ``timeout_s`` after one failed, as a straggling sender may still write), this one is posted
        without staging.
        """
        dst = as_pages("dst_pages", dst_pages)
        use_staging = staging and self._staging_request is None and time.monotonic() >= self._staging_blocked_until
        if use_staging:
            self._staging_request = request_id
        self._pending[request_id] = (dst, use_staging)
        if self.posts:
            req = DstRequest(dst_pages=dst, num_tokens=num_tokens, dst_meta_slot=dst_meta_slot, staging=use_staging)
            self.bootstrap.set(f"req/{request_id}/dst", req)

    def wait_request(self, request_id: str, *, timeout_s: float | None = None) -> ReceiveReport:
        """Wait until every prefill rank sent its share, check coverage, unpack staging (blocking).

        Raises:
            TransferError: a prefill rank reported a failure, or did not finish within the timeout (naming it
                and the request's pages), or the positions reported do not cover the request exactly once.
        """
        if request_id not in self._pending:
            raise KeyError(f"request_id must be posted first with post_request, got request_id={request_id!r}")
        if self.prefill is None:
            self.connect(timeout_s)
        dst, _ = self._pending[request_id]
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        t0 = time.perf_counter()
        try:
            starts, outcomes, unpack_s = self._wait_outcomes(request_id, dst, deadline)
            t1 = time.perf_counter()
            counts = np.bincount(np.concatenate([st.positions for st in starts] + [np.zeros(0, np.int64)]))
            counts = np.pad(counts, (0, max(0, dst.shape[0] - counts.shape[0])))
            if counts.shape[0] != dst.shape[0] or not np.all(counts == 1):
                missing = np.flatnonzero(counts[: dst.shape[0]] == 0)
                repeated = np.flatnonzero(counts > 1)
                raise TransferError(
                    f"positions must arrive exactly once, got missing {format_pages(missing)} and repeated "
                    f"{format_pages(repeated)}",
                    request_id=request_id,
                    peer="prefill",
                    pages=dst[missing] if missing.size else (),
                )
        except BaseException:
            self._finish(request_id, ok=False)
            raise
        self._finish(request_id, ok=True)
        return ReceiveReport(
            request_id=request_id,
            num_positions=int(dst.shape[0]),
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

    def _wait_outcomes(self, request_id: str, dst: np.ndarray, deadline: float):
        """Poll every sender's progress counter; read its start and done keys, unpack each group once it landed.

        Returns ``(starts, outcomes, (unpack seconds, unpack seconds after the last done))``.
        """
        num_prefill = len(self.prefill)
        starts: dict[int, SendStart] = {}
        done: dict[int, SendOutcome] = {}
        unpacked = dict.fromkeys(range(num_prefill), 0)  # layer groups of each sender unpacked so far
        unpack_s = [0.0, 0.0]

        def unpack_upto(r: int, stop: int, tail: bool) -> None:
            st = starts[r]
            t = time.perf_counter()
            for c in range(unpacked[r], stop):
                layers = slice(int(st.layer_bounds[c]), int(st.layer_bounds[c + 1]))
                for d, shard in self.shards.items():
                    shard.unpack(st.unpack.get(d, ()), layers)
            unpacked[r] = max(unpacked[r], stop)
            dt = time.perf_counter() - t
            unpack_s[0] += dt
            unpack_s[1] += dt if tail else 0.0

        prefix = f"req/{request_id}"
        delay = 0.001
        while len(done) < num_prefill:
            progressed = False
            for r in range(num_prefill):
                if r in done:
                    continue
                peer = f"prefill rank {r}"
                value = self.bootstrap.add(f"{prefix}/progress/{r}", 0, request_id=request_id, peer=peer)
                if value >= DONE:
                    out: SendOutcome = self.bootstrap.get(
                        f"{prefix}/done/{r}", deadline=deadline, request_id=request_id
                    )
                    if not out.ok:
                        raise TransferError(out.error, request_id=request_id, peer=peer, pages=dst)
                    done[r] = out
                    progressed = True
                if value % DONE >= 1 and r not in starts:
                    starts[r] = self.bootstrap.get(f"{prefix}/start/{r}", deadline=deadline, request_id=request_id)
                    progressed = True
                landed = value % DONE - 1
                if r in starts and landed > unpacked[r]:
                    unpack_upto(r, landed, tail=False)
                    progressed = True
            if len(done) == num_prefill:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(num_prefill)) - set(done))
                raise TransferError(
                    f"timed out waiting for prefill ranks {missing}",
                    request_id=request_id,
                    peer=f"prefill rank {missing[0]}",
                    pages=dst,
                )
            delay = 0.001 if progressed else min(delay * 2, MAX_POLL_S)
            time.sleep(min(delay, left))
        for r in range(num_prefill):  # the groups not announced separately (at least the last one)
            unpack_upto(r, int(starts[r].layer_bounds.shape[0]) - 1, tail=True)
        order = range(num_prefill)
        return [starts[r] for r in order], [done[r] for r in order], unpack_s

    def _finish(self, request_id: str, *, ok: bool) -> None:
        self._pending.pop(request_id, None)
        if self._staging_request == request_id:
            self._staging_request = None
            if not ok:  # a straggling sender may still write into staging: keep it out of use for a while
                self._staging_blocked_until = time.monotonic() + self.timeout_s
        if ok and self.posts and len(self.shards) == len(self.decode or ()):  # no other decode process reads them
            self.bootstrap.delete(f"req/{request_id}/dst")
            for r in range(len(self.prefill or ())):
                for kind in ("start", "done", "progress"):
                    self.bootstrap.delete(f"req/{request_id}/{kind}/{r}")
