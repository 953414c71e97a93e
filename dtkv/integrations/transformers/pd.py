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

from collections.abc import Sequence

from dtkv.integrations.transformers.runner import DSAModelRunner
from dtkv.transfer import DecodeReceiver, PrefillSender, ReceiveReport, SendReport
from dtkv.transfer import prefilled as _prefilled
from dtkv.transfer.prefilled import META_ROW_BYTES, kv_digest, shard_for_runner

__all__ = ["META_ROW_BYTES", "kv_digest", "receive_prefilled", "request_bytes", "send_prefilled", "shard_for_runner"]


def request_bytes(runner: DSAModelRunner, prompt_lens: Sequence[int]) -> int:
    """Bytes of the largest request's prompt pages over every layer and layout (a staging size that fits)."""
    return _prefilled.request_bytes(runner.layouts, runner.geometry.num_layers, runner.page_size, prompt_lens)


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
    return _prefilled.send_prefilled(runner, sender, page_size=runner.page_size, tag=tag, timeout_s=timeout_s)


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
        TransferError: a transfer failed, or the metadata row disagrees with the prompt length or holds a first
            token outside the vocabulary.
    """
    return _prefilled.receive_prefilled(
        runner,
        receiver,
        prompts,
        page_size=runner.page_size,
        vocab_size=runner.geometry.vocab_size,
        tag=tag,
        timeout_s=timeout_s,
    )
