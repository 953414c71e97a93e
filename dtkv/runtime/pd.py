"""PD with the runtime: a prefill CP group of N ranks hands its requests to a decode group of M ranks, N != M allowed.

Each prefill rank sends the pages it owns, with their positions; the transfer planner
(:func:`dtkv.transfer.plan_request`) sends every position once, from its prefill owner straight into its decode
owner's page -- whatever the two groups' sizes and ownership schemes are. Nothing is relaid out afterwards and no
decode rank ever holds a page it does not own: the decode group's pool is sharded (``PageOwnership(M, ...)``) from
the first byte, and it decodes on its shards (``decode_mode="sharded"``) or over full views. A decode "group" of one
process (``group=None``) is the non-CP decode.

- :func:`send_prefilled` (every prefill rank, same order): after ``runtime.prefill(...)``, one
  ``PrefillSender.send_request`` per request, with the metadata row ``(num_tokens, first_token, prompt digest)``
  from one rank (:func:`dtkv.transfer.prefilled.meta_row`).
- :func:`receive_prefilled` (every decode rank, same order, each with its own :class:`dtkv.transfer.DecodeReceiver`
  over :func:`shard_for`): adds each prompt, allocates its pages (the SPMD allocator gives every rank the same
  pages), waits for this rank's share, then the decode ranks agree on the outcome -- every rank raises together when
  any rank failed or the ranks' metadata rows differ, so no rank reports a request OK that another lost. A failed
  request is finished at once (never decoded) and its pages stay held until :func:`reclaim` finds that no decode
  rank keeps them in quarantine any longer (late bytes of abandoned engine calls can still land in them until then).
- :func:`reclaim` (every decode rank): free the pages of failed requests no rank quarantines any more.
- :func:`shard_for`, :func:`request_bytes`, :func:`kv_digest`: the transfer view of a runtime's pool, a staging size,
  and a hash of stored KV bytes (what tests and the demo compare across the two sides).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from dtkv._agree import agree
from dtkv._collectives import cpu_channel
from dtkv._util import cdiv
from dtkv.runtime import _batch
from dtkv.transfer import DecodeReceiver, KVShard, PrefillSender, ReceiveReport, SendReport, TransferError
from dtkv.transfer import prefilled as _prefilled
from dtkv.transfer.prefilled import META_ROW_BYTES, kv_digest

__all__ = [
    "META_ROW_BYTES",
    "kv_digest",
    "reclaim",
    "receive_prefilled",
    "request_bytes",
    "request_id",
    "send_prefilled",
    "shard_for",
]


def request_id(index: int, tag: str = "") -> str:
    """The transfer id of the ``index``-th request of a hand-over (both sides name a request by its place in the
    batch handed over; give each batch its own ``tag`` when one bootstrap namespace serves several)."""
    return f"{tag}req-{index}"


def shard_for(runtime, *, staging_bytes: int = 0) -> KVShard:
    """This rank's :class:`dtkv.transfer.KVShard` over ``runtime.pool`` (zero copy) with one metadata row."""
    return _prefilled.shard_for_runner(runtime, staging_bytes=staging_bytes)


def request_bytes(runtime, prompt_lens: Sequence[int]) -> int:
    """Bytes of the largest request's prompt pages over every layer and pool (a staging size that fits)."""
    spec = runtime.model_spec
    return _prefilled.request_bytes(spec.layouts, spec.num_layers, spec.page_size, prompt_lens)


def send_prefilled(
    runtime, sender: PrefillSender, *, requests=None, tag: str = "", timeout_s: float | None = None
) -> list[SendReport]:
    """Send requests of ``runtime`` (blocking; every prefill rank, same order).

    Args:
        runtime: a :class:`dtkv.runtime.Runtime` whose requests to send finished prefill (each has its first token).
        sender: a connected :class:`dtkv.transfer.PrefillSender` over ``shard_for(runtime)``.
        requests: the requests to send, in order (default: every live request); the ``i``-th is
            :func:`request_id` ``(i, tag)``.
        tag: prefix of the request ids.

    Raises:
        ValueError: a request is finished (its pages are released) or has not finished prefill; checked for every
            request first: nothing is sent.
        TransferError: see :meth:`dtkv.transfer.PrefillSender.send_request`.
    """
    reqs = [r for r in runtime.requests if not r.finished] if requests is None else list(requests)
    for r in reqs:
        if r.finished:
            raise ValueError(f"request {r.rid} must be live to be sent, got a finished one (its pages are released)")
    return _prefilled.send_prefilled(
        runtime, sender, page_size=runtime.page_size, tag=tag, timeout_s=timeout_s, requests=reqs
    )


def _channel(group):
    return None if group is None else cpu_channel(group)


def receive_prefilled(
    runtime,
    receiver: DecodeReceiver,
    prompts: Sequence[Sequence[int]],
    *,
    tag: str = "",
    timeout_s: float | None = None,
) -> list[ReceiveReport]:
    """Add ``prompts`` to a decode ``runtime`` and receive their KV and first tokens (blocking, in order; SPMD).

    Every decode rank calls it with the same prompts and its own receiver; the requests become ready for
    ``runtime.decode(steps)`` on every rank, or on none.

    Args:
        runtime: the decode side's :class:`dtkv.runtime.Runtime` (same model and pool layouts as prefill, any group
            size and ownership scheme, no prefix cache); its pool is the receiver's shard (:func:`shard_for`).
        receiver: this rank's connected :class:`dtkv.transfer.DecodeReceiver`.
        prompts: token ids of each request, in the prefill side's order (the ``i``-th is :func:`request_id`
            ``(i, tag)``).
        tag: prefix of the request ids (the prefill side's must match).

    Returns:
        One :class:`dtkv.transfer.ReceiveReport` per request (this rank's share).

    Raises:
        TypeError / ValueError: a prompt breaks :func:`dtkv.runtime._batch.check_prompt`, the prompts' pages do not
            fit the free pages, or the runtime has a prefix cache; checked before anything changes, on every rank
            together.
        TransferError: on every decode rank together, when any rank's transfer failed, the ranks' metadata rows
            differ, or the row disagrees with the prompt (its length, or its digest: the prefill side sent another
            prompt under this request id, e.g. prompts in another order) or holds a first token outside the
            vocabulary. The failed request is finished and its pages are held for :func:`reclaim`; the requests
            before it are ready, the ones after it were not added.
    """
    group = runtime.group
    ps = runtime.page_size

    def check() -> list[list[int]]:
        if runtime.prefix_cache is not None:
            raise ValueError("runtime must have no prefix cache to receive prefilled requests (prefix_cache=False)")
        ids = [
            _batch.check_prompt(
                p, vocab_size=runtime.model_spec.vocab_size, page_size=ps,
                num_pages=runtime.allocator.ownership.num_pages - len(runtime.allocator.reserved),
            )
            for p in prompts
        ]  # fmt: skip
        need, free = sum(cdiv(len(p), ps) for p in ids), runtime.allocator.num_free()
        if need > free:
            raise ValueError(f"prompts must fit the free pages: they need {need} pages, the pool has {free} free")
        return ids

    ids = _batch.agreed_step(group, what="receive_prefilled", check=check, value=lambda ids: [len(p) for p in ids])
    meta = next(iter(receiver.shards.values())).meta
    if meta is None:
        raise ValueError("receiver's shard must have a metadata row (build it with shard_for(runtime))")
    channel = _channel(group)
    reports: list[ReceiveReport] = []
    for i, prompt in enumerate(ids):
        req = runtime.add_request(prompt)
        req.pages = runtime.allocator.alloc_balanced(cdiv(len(prompt), ps)).tolist()  # the same pages on every rank
        rid = request_id(i, tag)
        error: Exception | None = None
        row = b""
        try:
            meta.zero_()
            report = receiver.receive_request(
                rid, req.pages, num_tokens=len(prompt), dst_meta_slot=0, timeout_s=timeout_s
            )
            row = bytes(meta[0, :META_ROW_BYTES].tolist())
        except Exception as e:  # noqa: BLE001 - exchanged with the other decode ranks first
            error = e
        try:
            agree(error, channel, what=f"the receive of {rid!r}", value=row.hex() if error is None else None)
            first = _prefilled.read_meta(row, prompt=prompt, vocab_size=runtime.model_spec.vocab_size, request_id=rid)
        except Exception as e:
            runtime.transfer_held[rid] = list(req.pages)
            req.pages, req.finished = [], True
            if isinstance(e, TransferError):
                raise
            raise TransferError(f"the decode ranks do not all hold the request: {e}", request_id=rid,
                                peer="decode group", pages=runtime.transfer_held[rid]) from e  # fmt: skip
        req.num_computed = len(prompt)
        req.output = [first]
        reports.append(report)  # set: the agreement raised otherwise
    return reports


def reclaim(runtime, receiver: DecodeReceiver, *, timeout_s: float = 0.0) -> list[int]:
    """Free the pages of failed requests that no decode rank keeps in quarantine any more (collective; SPMD).

    Each rank first lets its receiver end quarantines whose engine calls have ended
    (:meth:`dtkv.transfer.DecodeReceiver.reclaim`), then the ranks combine what they still hold: a failed request's
    pages go back to the allocator on every rank at once, when no rank holds them.

    Returns:
        The pages freed (the same on every rank).
    """
    receiver.reclaim(timeout_s)
    held = sorted(runtime.transfer_held)
    still = torch.tensor([rid in receiver.quarantined for rid in held], dtype=torch.int32)
    channel = _channel(runtime.group)
    if channel is not None and held:
        dist.all_reduce(still, op=dist.ReduceOp.MAX, group=channel)
    freed: list[int] = []
    for rid, busy in zip(held, still.tolist()):
        if not busy:
            pages = runtime.transfer_held.pop(rid)
            runtime.allocator.free(pages)
            freed += pages
    return freed
