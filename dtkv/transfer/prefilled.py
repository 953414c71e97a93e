"""Hand a runner's prefilled requests across: the prefill ranks' send, the decode side's receive, a KV digest.

A *runner* is anything with ``requests`` (each with ``rid``, ``prompt``, ``pages``, ``num_computed``,
``output``), ``add_request(prompt)``, an ``allocator`` and a ``pool``: a :class:`dtkv.runtime.Runtime` (whose
:mod:`dtkv.runtime.pd` binds ``page_size`` and ``vocab_size`` and runs the receive on every rank of a CP decode
group). Per request, the prompt's pages travel (each prefill rank sends the pages it owns, with their
positions) and one rank sends a metadata row ``(num_tokens, first_token, prompt digest)``
(:data:`META_ROW_BYTES`: two little-endian int64, then :func:`prompt_digest`, the sha256 of the prompt's token ids).
The decode side checks that row before it trusts it: the token count must equal the prompt's, the digest must be
that of the prompt it was given for the request (a decode side given its prompts in another order, or another
prompt of the same length, would otherwise decode one request's KV under another prompt), the first token must lie
in the vocabulary.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import numpy as np
import torch

from dtkv._util import cdiv
from dtkv.transfer.decode import DecodeReceiver, ReceiveReport
from dtkv.transfer.errors import TransferError
from dtkv.transfer.prefill import PrefillSender, SendReport
from dtkv.transfer.shard import KVShard

__all__ = [
    "META_ROW_BYTES",
    "kv_digest",
    "meta_row",
    "prompt_digest",
    "read_meta",
    "receive_prefilled",
    "request_bytes",
    "send_prefilled",
    "shard_for_runner",
]

META_ROW_BYTES = 48
"""Metadata row of a request: ``struct.pack("<qq", num_tokens, first_token) + prompt_digest(prompt)`` (16 + 32)."""


def prompt_digest(prompt: Sequence[int]) -> bytes:
    """The 32-byte identity of a prompt in the metadata row: sha256 of its token ids as little-endian int64."""
    return hashlib.sha256(np.asarray(list(prompt), dtype="<i8").tobytes()).digest()


def meta_row(prompt: Sequence[int], first_token: int) -> bytes:
    """A request's metadata row (:data:`META_ROW_BYTES`)."""
    return struct.pack("<qq", len(prompt), int(first_token)) + prompt_digest(prompt)


def shard_for_runner(runner, *, staging_bytes: int = 0) -> KVShard:
    """This rank's :class:`KVShard` over ``runner.pool`` (zero copy), with one metadata row."""
    return KVShard.from_pool(runner.pool, staging_bytes=staging_bytes, meta_num_rows=1, meta_row_bytes=META_ROW_BYTES)


def request_bytes(layouts, num_layers: int, page_size: int, prompt_lens: Sequence[int]) -> int:
    """Bytes of the largest request's prompt pages over ``num_layers`` layers of every layout (a staging size)."""
    per_page = num_layers * sum(lay.page_bytes for lay in layouts.values())
    return max((cdiv(n, page_size) for n in prompt_lens), default=0) * per_page


def send_prefilled(
    runner,
    sender: PrefillSender,
    *,
    page_size: int,
    tag: str = "",
    timeout_s: float | None = None,
    requests: Sequence | None = None,
) -> list[SendReport]:
    """Send every prefilled request of ``runner`` (blocking; every prefill rank, same order).

    Args:
        runner: a CP runner whose requests finished prefill (each has its first token).
        sender: a connected :class:`PrefillSender` over ``shard_for_runner(runner)``.
        page_size: tokens per page of the runner's pool.
        tag: prefix of the request ids (``f"{tag}req-{i}"`` for the ``i``-th request sent), e.g. to reuse one
            bootstrap namespace.
        requests: the requests to send (default: ``runner.requests``).

    Raises:
        ValueError: a request has not finished prefill (checked for every request first: nothing is sent).
        TransferError: see :meth:`PrefillSender.send_request`.
    """
    reqs = list(runner.requests if requests is None else requests)
    for r in reqs:
        if r.num_computed < len(r.prompt) or not r.output:
            raise ValueError(
                f"request {r.rid} must finish prefill before it is sent, got num_computed={r.num_computed} "
                f"of {len(r.prompt)} prompt tokens"
            )
    reports = []
    for i, r in enumerate(reqs):
        meta = meta_row(r.prompt, r.output[0])
        pages = r.pages[: cdiv(len(r.prompt), page_size)]
        reports.append(sender.send_request(f"{tag}req-{i}", pages, meta=meta, timeout_s=timeout_s))
    return reports


def receive_prefilled(
    runner,
    receiver: DecodeReceiver,
    prompts: Sequence[Sequence[int]],
    *,
    page_size: int,
    vocab_size: int,
    tag: str = "",
    timeout_s: float | None = None,
) -> list[ReceiveReport]:
    """Add ``prompts`` to a decode ``runner`` and receive their KV and first tokens (blocking, in order).

    Args:
        runner: the decode side's runner (same model and layouts) with no requests yet; its pool is the
            receiver's shard (:func:`shard_for_runner`).
        receiver: a connected :class:`DecodeReceiver`.
        prompts: token ids of each request, in the prefill side's request order (request ``i`` is
            ``f"{tag}req-{i}"``).
        page_size, vocab_size: of the runner's pool and model.

    Returns:
        One :class:`ReceiveReport` per request; then ``runner.decode(steps)`` continues them.

    Raises:
        TransferError: a transfer failed, or the metadata row disagrees with the prompt (its length or its digest:
            another prompt was sent under this request id) or holds a first token outside ``[0, vocab_size)``.
    """
    meta = next(iter(receiver.shards.values())).meta
    reports = []
    for i, prompt in enumerate(prompts):
        req = runner.add_request(prompt)
        req.pages = runner.allocator.alloc_balanced(cdiv(len(req.prompt), page_size)).tolist()
        rid = f"{tag}req-{i}"
        meta.zero_()
        reports.append(
            receiver.receive_request(rid, req.pages, num_tokens=len(req.prompt), dst_meta_slot=0, timeout_s=timeout_s)
        )
        first = read_meta(bytes(meta[0].tolist()), prompt=req.prompt, vocab_size=vocab_size, request_id=rid)
        req.num_computed = len(req.prompt)
        req.output = [first]
    return reports


def read_meta(row: bytes, *, prompt: Sequence[int], vocab_size: int, request_id: str) -> int:
    """The first token of a received metadata row (:func:`meta_row`), checked against ``prompt`` before it is
    trusted.

    Raises:
        TransferError: the row's token count is not the prompt's, its digest is not :func:`prompt_digest` of
            ``prompt`` (the prefill side sent another prompt under ``request_id``: prompts handed over in another
            order, or another prompt of the same length), or its first token is outside ``[0, vocab_size)``.
    """
    row = bytes(row[:META_ROW_BYTES])
    if len(row) != META_ROW_BYTES:
        raise TransferError(
            f"metadata row holds {len(row)} bytes, expected {META_ROW_BYTES}", request_id=request_id, peer="prefill"
        )
    got, first = struct.unpack("<qq", row[:16])
    if got != len(prompt):
        raise TransferError(
            f"metadata row says {got} tokens, the prompt has {len(prompt)}", request_id=request_id, peer="prefill"
        )
    if row[16:] != prompt_digest(prompt):
        raise TransferError(
            f"metadata row's prompt digest {row[16:24].hex()}... is not that of the prompt given for this request "
            f"({prompt_digest(prompt)[:8].hex()}...): the prefill side sent another prompt of {got} tokens under "
            "this request id (prompts handed over in another order?)",
            request_id=request_id, peer="prefill",
        )  # fmt: skip
    if not 0 <= first < vocab_size:
        raise TransferError(
            f"metadata row holds first token {first}, outside [0, {vocab_size})", request_id=request_id, peer="prefill"
        )
    return int(first)


def kv_digest(kv: Sequence[dict[str, torch.Tensor]], num_tokens: Sequence[int]) -> str:
    """Hash of ``kv[i][name][:, :num_tokens[i]]`` over requests and names (a runner's ``kv_bytes`` output)."""
    h = hashlib.blake2b(digest_size=16)
    for per_req, n in zip(kv, num_tokens):
        for name in sorted(per_req):
            h.update(per_req[name][:, :n].contiguous().numpy().tobytes())
    return h.hexdigest()
