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

import hashlib
import multiprocessing as mp
import os
import struct
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from dtkv._util import cdiv
from dtkv.transfer import DecodeReceiver, KVShard, PrefillSender, ReceiveReport, SendReport, TransferError

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

META_ROW_BYTES = 16
"""Metadata row of a request: ``struct.pack("<qq", num_tokens, first_token)``."""


def shard_for_runner(runner, *, staging_bytes: int = 0) -> KVShard:
    """The :class:`KVShard` of a :class:`dtkv.model.ModelRunner`'s pool, with one metadata row."""
    return KVShard.from_pool(runner.pool, staging_bytes=staging_bytes, meta_num_rows=1, meta_row_bytes=META_ROW_BYTES)


def _prompt_pages(req, page_size: int) -> list[int]:
    return req.pages[: cdiv(len(req.prompt), page_size)]


def send_prefilled(runner, sender: PrefillSender, *, tag: str = "", timeout_s: float | None = None) -> list[SendReport]:
    """Send every prefilled request of ``runner`` (blocking; call on every prefill rank, same order).

    Args:
        runner: a CP :class:`dtkv.model.ModelRunner` in a sharded mode whose requests finished prefill.
        sender: a connected :class:`dtkv.transfer.PrefillSender` over ``shard_for_runner(runner)``.
        tag: prefix of the request ids (``f"{tag}req-{rid}"``), e.g. to reuse one bootstrap namespace.

    Raises:
        ValueError: a request has not finished prefill.
        TransferError: see :meth:`dtkv.transfer.PrefillSender.send_request`.
    """
    reports = []
    for r in runner.requests:
        if r.num_computed < len(r.prompt) or not r.output:
            raise ValueError(
                f"request {r.rid} must finish prefill before it is sent, got num_computed={r.num_computed}"
            )
        meta = struct.pack("<qq", len(r.prompt), r.output[0])
        pages = _prompt_pages(r, runner.cfg.page_size)
        reports.append(sender.send_request(f"{tag}req-{r.rid}", pages, meta=meta, timeout_s=timeout_s))
    return reports


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
        TransferError: a transfer failed, or the metadata row disagrees with the prompt length.
    """
    ps = runner.cfg.page_size
    meta = next(iter(receiver.shards.values())).meta
    reports = []
    for prompt in prompts:
        req = runner.add_request(prompt)
        req.pages = runner.allocator.alloc_balanced(cdiv(len(req.prompt), ps)).tolist()
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


# ------------------------------------------------------------------------------------------ demo wiring
def _cfg(args: dict):
    from dtkv.model import ModelConfig

    return replace(ModelConfig(), page_size=args["page_size"], kv_dtype=args["kv_dtype"])


def _request_bytes(cfg, prompts) -> int:
    per_page = cfg.num_layers * sum(lay.page_bytes for lay in cfg.layouts.values())
    return max(cdiv(len(p), cfg.page_size) for p in prompts) * per_page


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


@dataclass
class DecodeProcess:
    """The decode side of ``demo --pd``: a spawned process, the store it rendezvouses through, its pipe."""

    process: mp.Process
    conn: object
    store: object
    rank_args: dict
    """Extra demo arguments for the prefill ranks (``pd_port``, ``pd_namespace``)."""

    def result(self, timeout_s: float = 300.0) -> dict:
        """Decode's answer: ``outputs``, ``kv_digest`` and ``entries``, or ``error`` (then ends the process)."""
        try:
            if not self.conn.poll(timeout_s):
                return {"error": f"decode did not answer within {timeout_s} s"}
            return self.conn.recv()
        finally:
            self.process.join(timeout=10)
            if self.process.is_alive():
                self.process.kill()

    def finish(self, rank_results: Sequence[dict], timeout_s: float = 300.0) -> dict:
        """Collect decode's result and compare it with the ranks': the ``pd_*`` entries of the demo's JSON.

        ``pd_parity`` is true when decode's received KV hashes equal to the replicated baseline's (prompt tokens)
        and decode's generated tokens equal the CP run's (``rank_results[0]["outputs"]``).
        """
        got = self.result(timeout_s)
        if "error" in got:
            return {"pd_parity": False, "pd_error": got["error"]}
        r0 = rank_results[0]
        kv_ok = all(r.get("pd_kv_digest") == got["kv_digest"] for r in rank_results)
        tokens_ok = got["outputs"] == r0["outputs"]
        return {
            "pd_parity": kv_ok and tokens_ok,
            "pd_kv_equal": kv_ok,
            "pd_tokens_equal": tokens_ok,
            "pd_outputs": got["outputs"],
            "pd_entries": sum(r["pd_entries"] for r in rank_results),
            "pd_min_entries": r0["pd_min_entries"],
            "pd_calls": sum(r["pd_calls"] for r in rank_results),
            "pd_bytes": sum(r["pd_bytes"] for r in rank_results),
        }


def start_decode(args: dict, prompts: Sequence[Sequence[int]]) -> DecodeProcess:
    """Host the rendezvous ``TCPStore`` on 127.0.0.1 and spawn the decode process (``demo --pd``)."""
    from dtkv.transfer import create_store

    store = create_store(port=0, is_master=True, timeout_s=args.get("timeout", 300.0))
    namespace = uuid.uuid4().hex
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(
        target=_decode_main, args=(child, dict(args), [list(p) for p in prompts], store.port, namespace), daemon=True
    )
    proc.start()
    return DecodeProcess(
        process=proc, conn=parent, store=store, rank_args={"pd_port": store.port, "pd_namespace": namespace}
    )
