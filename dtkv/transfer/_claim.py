"""Prefill's steps before any byte is sent: claim decode's current attempt, wait until every decode rank took part,
and prove the attempt live (every decode rank answers each claim's fresh nonce).

:class:`ClaimSteps` is a part of :class:`dtkv.transfer.PrefillSender`; the protocol (and why signed values do not
suffice) is :mod:`dtkv.transfer.protocol`.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import torch.distributed as dist

from dtkv.transfer.bootstrap import Bootstrap
from dtkv.transfer.descriptors import RankEndpoint
from dtkv.transfer.errors import TransferError
from dtkv.transfer.messages import Aborted, Answer, Claim, DstRequest, Ready, SlotOpen
from dtkv.transfer.protocol import (
    HOT_POLL_S,
    AttemptKeys,
    Backoff,
    SendProgress,
    new_nonce,
    request_key,
    time_left,
)

__all__ = ["Attempt", "ClaimSteps", "check_not_aborted"]


@dataclass(eq=False)
class Attempt:
    """This process's share of one attempt: its ranks' claims and the engine calls it submitted."""

    keys: AttemptKeys
    ranks: tuple[int, ...]
    claims: dict[int, bytes]
    """rank -> the exact bytes of its claim (a slot holding them is this side's)."""
    nonces: dict[int, str]
    """rank -> the fresh nonce of its claim, which every decode rank must answer before any byte is sent."""
    calls: list[Future] = field(default_factory=list)
    concluded: bool = False
    polled: tuple | None = None
    """The decode slots and own progress read right after claiming (saves the first poll's round trip)."""

    def poll(self, s: dist.Store) -> tuple[list[bytes | None], list[int]]:
        """(On the store worker.) Every decode rank's slot and this side's progress counters."""
        slots = [self.keys.slot("decode", d) for d in range(self.keys.num_decode)]
        return [s.get(k) if s.check([k]) else None for k in slots], [
            s.add(self.keys.progress(r), 0) for r in self.ranks
        ]

    def poll_answers(self, s: dist.Store, want: list[tuple[int, int]]) -> tuple[list[bytes | None], list[int]]:
        """(On the store worker.) The answers ``want`` (``(prefill rank, decode rank)``; ``None``: not there yet)
        and this side's progress counters."""
        keys = [self.keys.answer(r, d) for r, d in want]
        if keys and s.check(keys):  # the common case once decode answered: one call for all of them
            raws = [s.get(k) for k in keys]
        else:
            raws = [s.get(k) if s.check([k]) else None for k in keys] if len(keys) > 1 else [None] * len(keys)
        return raws, [s.add(self.keys.progress(r), 0) for r in self.ranks]


class ClaimSteps:
    """The claiming half of :class:`dtkv.transfer.PrefillSender`."""

    bootstrap: Bootstrap
    incarnation: int
    decode: list[RankEndpoint] | None

    def _claim(self, request_id: str, ranks: tuple[int, ...], deadline: float) -> tuple[DstRequest, Attempt]:
        """Wait for decode's current attempt of ``request_id`` and claim every hosted rank's slot in it, each claim
        with a fresh nonce.

        An attempt whose slots decode already closed (it gave up) is skipped; the wait goes on for a newer one.
        Claiming proves nothing about the attempt (its values may be written back): :meth:`_wait_answers` does.
        """
        key = request_key(request_id)
        peer = "decode rank 0"
        backoff = Backoff(
            deadline, lambda: TransferError(f"timed out waiting for {key!r}", request_id=request_id, peer="decode")
        )
        refused: set[str] = set()
        call_ms = int(self.engine.call_timeout_s() * 1e3) + 1
        while True:
            req = backoff.poll(
                lambda: self.bootstrap.try_get(key, DstRequest, deadline=deadline, request_id=request_id, peer=peer)
            )
            if req is not None and req.epoch not in refused:
                keys = AttemptKeys(request_id, req.epoch, req.num_prefill, req.num_decode)
                self._check_party_counts(keys, deadline)
                window_ms = int(time_left(deadline) * 1e3) + 1
                claims, opens, nonces = {}, {}, {}
                for r in ranks:
                    slot = keys.slot("prefill", r)
                    nonces[r] = new_nonce()
                    claim = Claim(
                        epoch=req.epoch,
                        rank=r,
                        incarnation=self.incarnation,
                        window_ms=window_ms,
                        call_timeout_ms=call_ms,
                        nonce=nonces[r],
                    )
                    claims[r], opens[r] = (
                        self.bootstrap.encode(slot, claim),
                        self.bootstrap.encode(slot, SlotOpen(epoch=req.epoch)),
                    )
                att = Attempt(keys=keys, ranks=ranks, claims=claims, nonces=nonces)

                def claim_job(s: dist.Store, att: Attempt = att, opens: dict = opens) -> list[int]:
                    self._hold(att.keys, True)  # listed open before a claim of ours can land (a restart
                    self._write_open(s)  # finishes it; a death between the two would leave it behind)
                    got = [
                        r
                        for r in ranks
                        if s.compare_set(att.keys.slot("prefill", r), opens[r], att.claims[r]) == att.claims[r]
                    ]
                    if got:
                        s.add(att.keys.claimed, len(got))  # decode reads the slots once this rises
                    else:  # no slot of ours: nothing to finish
                        self._hold(att.keys, False)
                        self._write_open(s)
                    if len(got) == len(ranks):
                        att.polled = att.poll(s)
                    return got

                try:
                    mine = self.bootstrap.call(
                        claim_job,
                        deadline=deadline,
                        what=f"claim {keys.prefix}",
                        request_id=request_id,
                        peer=peer,
                        write=True,
                    )
                except TransferError as e:  # the claim may still land: conclude it whenever it does
                    self._conclude(att, error=f"TransferError: {e}")
                    raise
                if len(mine) == len(ranks):
                    return req, att
                if mine:
                    error = TransferError(
                        f"prefill ranks {sorted(set(ranks) - set(mine))} found their slots closed (decode gave the "
                        "request up)",
                        request_id=request_id,
                        peer="decode",
                    )
                    self._conclude(att, error=f"TransferError: {error}")
                    raise error
                refused.add(req.epoch)
            backoff.wait()

    def _wait_ready(self, att: Attempt, deadline: float) -> list[Ready]:
        """Wait until every decode rank took part in the attempt (its slot READY, with its staging grant)."""
        keys = att.keys
        slots = [keys.slot("decode", d) for d in range(keys.num_decode)]
        backoff = Backoff(
            deadline,
            lambda: TransferError(
                "timed out waiting for every decode rank to take part", request_id=keys.request_id, peer="decode"
            ),
        )
        refreshed = False
        while True:
            if att.polled is not None:  # read by the claim itself: the store answered this loop's first poll
                polled, att.polled = att.polled, None
                raws, progress = backoff.poll(lambda polled=polled: polled)
            else:
                raws, progress = backoff.poll(
                    lambda: self.bootstrap.call(
                        att.poll,
                        deadline=deadline,
                        what=f"poll {keys.prefix}/decode",
                        request_id=keys.request_id,
                        peer="decode",
                    )
                )
            check_not_aborted(keys, progress)
            msgs = []
            for d, (k, raw) in enumerate(zip(slots, raws)):
                if raw is None:
                    raise TransferError(
                        f"key {k!r} is missing (the attempt was cleaned up)",
                        request_id=keys.request_id,
                        peer=f"decode rank {d}",
                    )
                msg = self.bootstrap.decode(
                    k, raw, SlotOpen, Ready, Aborted, request_id=keys.request_id, peer=f"decode rank {d}"
                )
                if isinstance(msg, Aborted):
                    raise TransferError(
                        "decode gave the request up before every decode rank took part",
                        request_id=keys.request_id,
                        peer=f"decode rank {d}",
                    )
                msgs.append(msg)
            if all(isinstance(m, Ready) and m.epoch == keys.epoch for m in msgs):
                stale = [d for d, m in enumerate(msgs) if m.incarnation != self.decode[d].incarnation]
                if not stale:
                    return msgs
                if refreshed:
                    raise TransferError(
                        f"decode ranks {stale} took part under incarnations not published in the store",
                        request_id=keys.request_id,
                        peer=f"decode rank {stale[0]}",
                    )
                self.connect(time_left(deadline))  # a decode rank restarted: its buffers moved
                refreshed = True
                continue
            backoff.wait()

    def _wait_answers(self, att: Attempt, deadline: float, ready: list[Ready]) -> None:
        """Wait until every decode rank answered every hosted rank's claim nonce, for the incarnation and staging
        grant its READY names: the attempt is live, held by the decode receivers this side planned for.

        Signed values prove their author, not their age: the attempt's pointer, slots and READY may be an earlier
        attempt's, written back. The nonces are fresh, so their answers are not; an answer carrying another nonce
        (an earlier claim's, replayed) is not one.
        """
        keys = att.keys
        want = [(r, d) for r in att.ranks for d in range(keys.num_decode)]
        answers: dict[tuple[int, int], Answer] = {}

        def timeout() -> TransferError:
            missing = sorted({d for r, d in want if (r, d) not in answers})
            return TransferError(
                f"decode ranks {missing} did not answer the claim of prefill ranks {list(att.ranks)} in time (no "
                "decode receiver holds this attempt: it was given up, or its values were written back)",
                request_id=keys.request_id,
                peer=f"decode rank {missing[0]}",
            )

        backoff = Backoff(deadline, timeout, hot_s=HOT_POLL_S)  # decode answers within a poll of its own
        while True:
            todo = [rd for rd in want if rd not in answers]
            raws, progress = backoff.poll(
                lambda todo=todo: self.bootstrap.call(
                    lambda s: att.poll_answers(s, todo),
                    deadline=deadline,
                    what=f"poll {keys.prefix}/answer",
                    request_id=keys.request_id,
                    peer="decode",
                )
            )
            check_not_aborted(keys, progress)
            before = len(answers)
            for (r, d), raw in zip(todo, raws):
                if raw is None:
                    continue
                peer = f"decode rank {d}"
                msg = self.bootstrap.decode(keys.answer(r, d), raw, Answer, request_id=keys.request_id, peer=peer)
                if (msg.epoch, msg.prefill_rank, msg.decode_rank, msg.nonce) != (keys.epoch, r, d, att.nonces[r]):
                    continue
                if (msg.incarnation, msg.staging) != (ready[d].incarnation, ready[d].staging):
                    raise TransferError(
                        f"decode rank {d} answered as incarnation {msg.incarnation} with staging={msg.staging}, "
                        f"but took part as {ready[d].incarnation} with staging={ready[d].staging}",
                        request_id=keys.request_id,
                        peer=peer,
                    )
                answers[(r, d)] = msg
            if len(answers) == len(want):
                return
            backoff.wait(progressed=len(answers) > before)


def check_not_aborted(keys: AttemptKeys, progress: list[int]) -> None:
    if any(SendProgress(v).aborted for v in progress):
        raise TransferError(
            "decode gave the request up (it failed or timed out)", request_id=keys.request_id, peer="decode"
        )
