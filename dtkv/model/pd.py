"""PD disaggregation of the reference model: CP prefill ranks hand each request to a decode process over Mooncake.

- :func:`send_prefilled` (every prefill rank, SPMD): after ``runner.prefill(...)``, sends each request's prompt
  pages -- the pages this rank owns, with their positions -- and, from one rank, a metadata row
  ``(num_tokens, first_token)`` (:data:`META_ROW_BYTES`, two little-endian int64).
- :func:`receive_prefilled` (decode): adds each prompt to a ``single``-mode :class:`dtkv.model.ModelRunner`,
  allocates its pages there, receives KV and first token into them, and leaves the requests ready for
  ``runner.decode(steps)``.
- :func:`kv_digest`: a hash of requests' stored KV bytes over their prompt tokens (what the two sides compare).

``python -m dtkv.demo --pd`` is wired through :func:`start_decode` (host the rendezvous store and spawn the
decode process), :func:`send_from_rank` (in each prefill rank) and :meth:`DecodeProcess.finish`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace

import torch

from dtkv._pd_process import DecodeProcess, spawn_decode
from dtkv._util import cdiv
from dtkv.transfer import DecodeReceiver, PrefillSender, ReceiveReport, SendReport
from dtkv.transfer import prefilled as _prefilled
from dtkv.transfer.prefilled import META_ROW_BYTES, kv_digest, shard_for_runner

__all__ = [
    "META_ROW_BYTES",
    "DecodeProcess",
    "kv_digest",
    "receive_prefilled",
    "send_from_rank",
    "send_prefilled",
    "shard_for_runner",
    "start_decode",
]


def send_prefilled(runner, sender: PrefillSender, *, tag: str = "", timeout_s: float | None = None) -> list[SendReport]:
    """Send every prefilled request of ``runner`` (blocking; call on every prefill rank, same order).

    Args:
        runner: a CP :class:`dtkv.model.ModelRunner` in a sharded mode whose requests finished prefill.
        sender: a connected :class:`dtkv.transfer.PrefillSender` over ``shard_for_runner(runner)``.
        tag: prefix of the request ids (``f"{tag}req-{rid}"``), e.g. to reuse one bootstrap namespace.

    Raises:
        ValueError: a request has not finished prefill (nothing is sent).
        TransferError: see :meth:`dtkv.transfer.PrefillSender.send_request`.
    """
    return _prefilled.send_prefilled(runner, sender, page_size=runner.cfg.page_size, tag=tag, timeout_s=timeout_s)


def receive_prefilled(
    runner, receiver: DecodeReceiver, prompts: Sequence[Sequence[int]], *, tag: str = "", timeout_s: float | None = None
) -> list[ReceiveReport]:
    """Add ``prompts`` to a decode runner and receive their KV and first tokens (blocking, in order).

    Args:
        runner: a ``single``-mode :class:`dtkv.model.ModelRunner` with no requests yet; its pool is the
            receiver's shard (``shard_for_runner(runner)``).
        receiver: a connected :class:`dtkv.transfer.DecodeReceiver`.
        prompts: the token ids of each request, in the prefill side's request order.

    Returns:
        One :class:`dtkv.transfer.ReceiveReport` per request; afterwards ``runner.decode(steps)`` continues them.

    Raises:
        TransferError: a transfer failed, or the metadata row disagrees with the prompt length or holds a first
            token outside the vocabulary.
    """
    cfg = runner.cfg
    return _prefilled.receive_prefilled(
        runner, receiver, prompts, page_size=cfg.page_size, vocab_size=cfg.vocab_size, tag=tag, timeout_s=timeout_s
    )


# ------------------------------------------------------------------------------------------ demo wiring
def _cfg(args: dict):
    from dtkv.model import ModelConfig

    return replace(ModelConfig(), page_size=args["page_size"], kv_dtype=args["kv_dtype"])


def _request_bytes(cfg, prompts) -> int:
    return _prefilled.request_bytes(cfg.layouts, cfg.num_layers, cfg.page_size, [len(p) for p in prompts])


def send_from_rank(runner, args: dict, baseline_kv: Sequence[dict[str, torch.Tensor]] | None = None) -> dict:
    """Prefill-rank side of ``demo --pd``: send every request of ``runner`` to the decode process.

    Args:
        runner: the rank's sharded :class:`dtkv.model.ModelRunner` after prefill.
        args: the demo arguments, with ``pd_port`` and ``pd_namespace`` from :func:`start_decode`.
        baseline_kv: the replicated baseline's ``kv_bytes`` per request, hashed for decode to compare against.

    Returns:
        ``pd_entries``, ``pd_min_entries``, ``pd_calls``, ``pd_bytes`` (this rank's) and ``pd_kv_digest``.
    """
    from dtkv.transfer import Bootstrap, create_store

    store = create_store(port=args["pd_port"], is_master=False, timeout_s=args.get("timeout", 300.0))
    prompts = [r.prompt for r in runner.requests]
    sender = PrefillSender(
        shard_for_runner(runner, staging_bytes=_request_bytes(runner.cfg, prompts)),
        Bootstrap(store, namespace=args["pd_namespace"]),
    )
    try:
        sender.connect()
        reports = send_prefilled(runner, sender)
    finally:
        sender.close()
    out = {
        "pd_entries": sum(r.num_entries for r in reports),
        "pd_plan_entries": sum(r.plan_entries for r in reports),
        "pd_min_entries": sum(r.min_entries for r in reports),
        "pd_calls": sum(r.num_calls for r in reports),
        "pd_bytes": sum(r.num_bytes for r in reports),
    }
    if baseline_kv is not None:
        out["pd_kv_digest"] = kv_digest(baseline_kv, [len(p) for p in prompts])
    return out


def _decode_main(conn, args: dict, prompts: list[list[int]], port: int, namespace: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        from dtkv.model import ModelRunner
        from dtkv.transfer import Bootstrap, create_store

        torch.set_num_threads(1)
        cfg = _cfg(args)
        steps = args["decode_steps"]
        num_pages = sum(cdiv(len(p) + steps + 1, cfg.page_size) + 1 for p in prompts) + 1
        runner = ModelRunner(cfg, mode="single", num_pages=num_pages)
        store = create_store(port=port, is_master=False, timeout_s=args.get("timeout", 300.0))
        receiver = DecodeReceiver(
            shard_for_runner(runner, staging_bytes=_request_bytes(cfg, prompts)), Bootstrap(store, namespace=namespace)
        )
        receiver.connect()
        reports = receive_prefilled(runner, receiver, prompts)
        digest = kv_digest([runner.kv_bytes(r.rid) for r in runner.requests], [len(p) for p in prompts])
        outputs = runner.decode(steps)
        receiver.close()
        conn.send({"outputs": outputs, "kv_digest": digest, "entries": sum(r.num_entries for r in reports)})
    except BaseException as e:  # report, never hang the parent
        conn.send({"error": f"{type(e).__name__}: {e}"})


def start_decode(args: dict, prompts: Sequence[Sequence[int]]) -> DecodeProcess:
    """Host the rendezvous ``TCPStore`` on 127.0.0.1 and spawn the decode process (``demo --pd``)."""
    return spawn_decode(_decode_main, args, prompts)
