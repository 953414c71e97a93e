"""PD disaggregation of a transformers DSA model: CP prefill ranks hand their requests to a decode process.

- :func:`shard_for_runner` -- the :class:`dtkv.transfer.KVShard` of a runner's pool, with one metadata row.
- :func:`send_prefilled` (every prefill rank, SPMD): after ``runner.prefill(...)``, sends each request's prompt
  pages -- the pages this rank owns, with their positions -- over a connected
  :class:`dtkv.transfer.PrefillSender`, and from one rank a metadata row ``(num_tokens, first_token)``
  (:data:`META_ROW_BYTES`: two little-endian int64).
- :func:`receive_prefilled` (decode): adds each prompt to a runner of the same model (any cp size), allocates its
  pages, receives KV and first token into them, and leaves the requests ready for ``runner.decode(steps)``.
- :func:`kv_digest` -- a hash of requests' stored KV bytes over their prompt tokens (what both sides compare).

The decode side must use the same model weights and the same pool layouts (``kv_dtype``, ``page_size``): the
transfer checks the layouts of both sides and refuses a mismatch.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import torch

from dtkv.integrations.transformers.runner import DSAModelRunner
from dtkv.transfer import DecodeReceiver, KVShard, PrefillSender, ReceiveReport, SendReport, TransferError

__all__ = ["META_ROW_BYTES", "kv_digest", "receive_prefilled", "request_bytes", "send_prefilled", "shard_for_runner"]

META_ROW_BYTES = 16
"""Metadata row of a request: ``struct.pack("<qq", num_tokens, first_token)``."""


def shard_for_runner(runner: DSAModelRunner, *, staging_bytes: int = 0) -> KVShard:
    """This rank's :class:`dtkv.transfer.KVShard` over ``runner.pool`` (zero copy), with one metadata row."""
    return KVShard.from_pool(runner.pool, staging_bytes=staging_bytes, meta_num_rows=1, meta_row_bytes=META_ROW_BYTES)


def request_bytes(runner: DSAModelRunner, prompt_lens: Sequence[int]) -> int:
    """Bytes of the largest request's prompt pages over every layer and layout (a staging size that fits)."""
    per_page = runner.geometry.num_layers * sum(lay.page_bytes for lay in runner.layouts.values())
    return max(-(-n // runner.page_size) for n in prompt_lens) * per_page


def send_prefilled(
    runner: DSAModelRunner, sender: PrefillSender, *, tag: str = "", timeout_s: float | None = None
) -> list[SendReport]:
    """Send every prefilled request of ``runner`` (blocking; every prefill rank, same order).

    Args:
        runner: a CP runner whose requests finished prefill (each has its first token).
        sender: a :class:`dtkv.transfer.PrefillSender` over ``shard_for_runner(runner)``.
        tag: prefix of the request ids (``f"{tag}req-{rid}"``).

    Raises:
        ValueError: a request has not finished prefill (nothing is sent).
        TransferError: see :meth:`dtkv.transfer.PrefillSender.send_request`.
    """
    for r in runner.requests:
        if r.num_computed < len(r.prompt) or not r.output:
            raise ValueError(
                f"request {r.rid} must finish prefill before it is sent, got num_computed={r.num_computed} "
                f"of {len(r.prompt)} prompt tokens"
            )
    ps = runner.page_size
    reports = []
    for r in runner.requests:
        meta = struct.pack("<qq", len(r.prompt), r.output[0])
        pages = r.pages[: -(-len(r.prompt) // ps)]
        reports.append(sender.send_request(f"{tag}req-{r.rid}", pages, meta=meta, timeout_s=timeout_s))
    return reports


def receive_prefilled(
    runner: DSAModelRunner,
    receiver: DecodeReceiver,
    prompts: Sequence[Sequence[int]],
    *,
    tag: str = "",
    timeout_s: float | None = None,
) -> list[ReceiveReport]:
    """Add ``prompts`` to a decode ``runner`` and receive their KV and first tokens (blocking, in order).

    Args:
        runner: the decode side's runner (same model and layouts) with no requests yet; its pool is the
            receiver's shard (:func:`shard_for_runner`).
        receiver: a :class:`dtkv.transfer.DecodeReceiver`.
        prompts: token ids of each request, in the prefill side's request order.

    Returns:
        One :class:`dtkv.transfer.ReceiveReport` per request; then ``runner.decode(steps)`` continues them.

    Raises:
        TransferError: a transfer failed, or the metadata row disagrees with the prompt length.
    """
    ps = runner.page_size
    meta = next(iter(receiver.shards.values())).meta
    reports = []
    for prompt in prompts:
        req = runner.add_request(prompt)
        req.pages = runner.allocator.alloc_balanced(-(-len(req.prompt) // ps)).tolist()
        rid = f"{tag}req-{req.rid}"
        meta.zero_()
        reports.append(
            receiver.receive_request(rid, req.pages, num_tokens=len(req.prompt), dst_meta_slot=0, timeout_s=timeout_s)
        )
        num_tokens, first = struct.unpack("<qq", bytes(meta[0].tolist()))
        if num_tokens != len(req.prompt):
            raise TransferError(
                f"metadata row says {num_tokens} tokens, the prompt has {len(req.prompt)}",
                request_id=rid,
                peer="prefill",
            )
        if not 0 <= first < runner.geometry.vocab_size:
            raise TransferError(
                f"metadata row holds first token {first}, outside [0, {runner.geometry.vocab_size})",
                request_id=rid,
                peer="prefill",
            )
        req.num_computed = len(req.prompt)
        req.output = [int(first)]
    return reports


def kv_digest(kv: Sequence[dict[str, torch.Tensor]], num_tokens: Sequence[int]) -> str:
    """Hash of ``kv[i][name][:, :num_tokens[i]]`` over requests and names (``runner.kv_bytes`` output)."""
    h = hashlib.blake2b(digest_size=16)
    for per_req, n in zip(kv, num_tokens):
        for name in sorted(per_req):
            h.update(per_req[name][:, :n].contiguous().numpy().tobytes())
    return h.hexdigest()
