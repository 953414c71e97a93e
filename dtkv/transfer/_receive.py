"""Decode's wait for one attempt: poll every sender's progress, check its start before any copy, unpack each layer
group once it landed, and check that the positions reported cover the request exactly once.

:class:`ReceiveLoop` is a part of :class:`dtkv.transfer.DecodeReceiver` (it uses the receiver's shards, store
access and pending attempts); the protocol is :mod:`dtkv.transfer.protocol`.
"""

from __future__ import annotations

import time

import numpy as np
import torch.distributed as dist

from dtkv.transfer.bootstrap import Bootstrap
from dtkv.transfer.errors import TransferError, format_pages
from dtkv.transfer.messages import SendOutcome, SendStart
from dtkv.transfer.protocol import AttemptKeys, Backoff, SendProgress, time_left
from dtkv.transfer.quarantine import PostedAttempt
from dtkv.transfer.shard import KVShard

__all__ = ["ReceiveLoop"]


class ReceiveLoop:
    """The waiting half of :class:`dtkv.transfer.DecodeReceiver`."""

    shards: dict[int, KVShard]
    bootstrap: Bootstrap
    _pending: dict[str, PostedAttempt]

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
                p = SendProgress(s.add(keys.progress(r), 0))
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
            polled = backoff.poll(
                lambda: self.bootstrap.call(
                    poll, deadline=deadline, what=f"poll {keys.prefix}", request_id=rid, peer="prefill"
                )
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
