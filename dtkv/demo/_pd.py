"""``--pd``: the decode group (``--decode-cp M`` processes) and the prefill ranks' send.

:func:`start_decode_group` hosts the rendezvous store on 127.0.0.1 and spawns the decode ranks: each loads the same
model (same seed, or the same checkpoint) on ``--decode-device`` (CPU, gloo among the ranks; or decode rank ``d`` on
GPU ``d`` mod the GPU count, NCCL among them: one GPU may serve prefill and decode), builds a runtime over
``PageOwnership(M, ...)`` (one process: a whole pool), receives every request into its own pages over
``--transfer-engine`` (Mooncake or NIXL; :func:`dtkv.runtime.pd.receive_prefilled`) and decodes (``--decode``).
:func:`send_from_rank` runs in each prefill rank after prefill. Both sides hand over through
:class:`dtkv.transfer.HandoffSender` / :class:`dtkv.transfer.HandoffReceiver`: a pool in GPU memory that the engine
cannot register (Mooncake's non-cuda wheel) goes through a bounded pinned host window, in rounds both sides size
alike (:func:`handoff_shard`). :meth:`DecodeGroup.finish` collects the decode ranks' answers and checks them against
the prefill ranks' (``pd`` check); a decode rank that fails logs it at once and :meth:`DecodeGroup.failure` lets the
parent stop the prefill ranks waiting on it.
"""

from __future__ import annotations

import logging
import os
import queue as queue_mod
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from dtkv._log import progress, setup_cli_logging
from dtkv.demo import _verdict as verdict
from dtkv.demo._procs import drain, process_context, rank_threads, remove_store_file, silent_rank

__all__ = ["DecodeGroup", "handoff_shard", "send_from_rank", "start_decode_group", "transfer_timeout"]

logger = logging.getLogger("dtkv.demo")

_REPORT_MARGIN_S = 5.0
"""Seconds a rank keeps, before the parent's deadline, to report its own error."""


def transfer_timeout(args: dict) -> float:
    """The bound of a rank's hand-off waits: ``--timeout``, cut to end before the parent gives the ranks up
    (``args["deadline_unix"]``, set by :func:`dtkv.demo._launch.spawn`) so that the rank's own error is reported."""
    timeout = float(args.get("timeout", 300.0))
    deadline = args.get("deadline_unix")
    if deadline is not None:
        timeout = min(timeout, max(1.0, deadline - time.time() - _REPORT_MARGIN_S))
    return timeout


def handoff_shard(runtime, prompts: list[list[int]]):
    """``(this rank's KVShard over runtime.pool, round_pages)`` for the hand-off of ``prompts``: no staging buffer
    where the pool goes through the host window (a GPU pool on a host-only engine), and rounds of
    ``min(default_round_pages, the largest prompt's pages)``, which both sides compute alike."""
    from dtkv._util import cdiv
    from dtkv.runtime.pd import request_bytes, shard_for
    from dtkv.transfer import default_round_pages, needs_host_staging

    lens = [len(p) for p in prompts]
    staged = needs_host_staging(runtime.pool.buffer(name) for name in runtime.pool.layouts)
    shard = shard_for(runtime, staging_bytes=0 if staged else request_bytes(runtime, lens))
    most = max((cdiv(n, runtime.page_size) for n in lens), default=1)
    return shard, max(1, min(default_round_pages(shard.layouts, shard.num_layers), most))


def send_from_rank(runtime, args: dict, requests=None) -> dict:
    """Prefill-rank side: send ``requests`` of ``runtime`` (default: every live one) to the decode group (after
    prefill; collective).

    Returns ``pd_entries``, ``pd_min_entries``, ``pd_calls``, ``pd_bytes`` (this rank's), ``pd_engine`` and
    ``pd_kv_digest`` (the requests' stored prompt KV, what the decode group must hold).
    """
    from dtkv.runtime.pd import kv_digest, send_prefilled
    from dtkv.transfer import Bootstrap, HandoffSender, create_store

    reqs = [r for r in runtime.requests if not r.finished] if requests is None else list(requests)
    prompts = [r.prompt for r in reqs]
    digest = kv_digest([runtime.kv_bytes(r.rid) for r in reqs], [len(p) for p in prompts])
    timeout = transfer_timeout(args)
    store = create_store(port=args["pd_port"], is_master=False, timeout_s=timeout)
    shard, round_pages = handoff_shard(runtime, prompts)
    engine = args.get("transfer_engine") or "mooncake"
    sender = HandoffSender(shard, Bootstrap(store, namespace=args["pd_namespace"]), engine=engine, timeout_s=timeout,
                           round_pages=round_pages)  # fmt: skip
    progress("transfer: %d requests to the decode group, %s, every wait bounded by %.0f s", len(reqs),
             "through pinned host memory" if sender.staged else "in place", timeout, all_ranks=True)  # fmt: skip
    t0 = time.perf_counter()
    try:
        sender.connect()
        reports = send_prefilled(runtime, sender, requests=reqs)  # type: ignore[arg-type]  # same surface
    finally:
        sender.close()
    sent, dt = sum(r.num_bytes for r in reports), time.perf_counter() - t0
    progress("transfer: %d requests, %.1f KiB sent by this rank in %.2f s (%.3f GB/s)", len(reports), sent / 1024,
             dt, sent / max(dt, 1e-9) / 1e9, all_ranks=True)  # fmt: skip
    return {
        "pd_entries": sum(r.num_entries for r in reports),
        "pd_min_entries": sum(r.min_entries for r in reports),
        "pd_calls": sum(r.num_calls for r in reports),
        "pd_bytes": sent,
        "pd_kv_digest": digest,
        "pd_engine": engine,
    }


def _decode_rank(rank: int, world: int, args: dict, prompts: list[list[int]], port: int, namespace: str) -> dict:
    import torch
    import torch.distributed as dist

    from dtkv.demo._models import load
    from dtkv.runtime import Runtime, num_pages_for
    from dtkv.runtime.pd import kv_digest, receive_prefilled
    from dtkv.transfer import Bootstrap, HandoffReceiver, create_store

    torch.set_num_threads(1)
    group = dist.group.WORLD if world > 1 else None
    device = decode_device(args, rank)
    model = load({**args, "device": device.type}, device)
    pages = num_pages_for([len(p) for p in prompts], page_size=args["page_size"], decode_steps=args["decode_steps"],
                          cp_size=world)  # fmt: skip
    rt = Runtime(
        model.adapter(), num_pages=pages, group=group,
        mode="sharded" if world > 1 else "single", decode_mode=args["decode"], attention=args["attention"],
        page_major=args.get("page_major") in ("both", "decode"),
    )  # fmt: skip
    try:
        store = create_store(port=port, is_master=False, timeout_s=args.get("timeout", 300.0))
        shard, round_pages = handoff_shard(rt, prompts)
        receiver = HandoffReceiver(shard, Bootstrap(store, namespace=namespace),
                                   engine=args.get("transfer_engine") or "mooncake", timeout_s=args.get("timeout"),
                                   round_pages=round_pages)  # fmt: skip
        progress("transfer: waiting for %d requests on %s, %s, each wait bounded by %.0f s", len(prompts), device,
                 "through pinned host memory" if receiver.staged else "in place", receiver.timeout_s,
                 all_ranks=True)  # fmt: skip
        t0 = time.perf_counter()
        try:
            receiver.connect()
            reports = receive_prefilled(rt, receiver, prompts)  # type: ignore[arg-type]  # same surface
        finally:
            receiver.close()
        got, dt = sum(r.num_bytes for r in reports), time.perf_counter() - t0
        progress("transfer: %d requests received into this rank's pages (%.1f KiB sent by the prefill ranks, %.2f s)",
                 len(reports), got / 1024, dt, all_ranks=True)  # fmt: skip
        digest = kv_digest([rt.kv_bytes(r.rid) for r in rt.requests], [len(p) for p in prompts])
        outputs = rt.decode(args["decode_steps"])
        return {
            "rank": rank, "outputs": outputs, "kv_digest": digest, "entries": sum(r.num_entries for r in reports),
            "bytes_per_rank": rt.pool.bytes_per_rank(), "replicated_bytes": rt.pool.replicated_bytes(),
            "mode": rt.mode, "decode_comm_bytes": rt.stats["decode_comm_bytes"], "page_major": rt.pool.page_major,
        }  # fmt: skip
    finally:
        rt.close()


def decode_device(args: dict, rank: int):
    """Where decode rank ``rank`` runs: ``cuda:(rank mod GPUs)`` with ``--decode-device cuda``, else the CPU."""
    import torch

    if args.get("decode_device") == "cuda":
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def _worker(rank: int, world: int, args: dict, prompts, port: int, namespace: str, init_file: str, out) -> None:
    rank_threads()
    setup_cli_logging(rank=rank, side="decode")
    try:
        device = decode_device(args, rank)
        if device.type == "cuda":
            import torch

            torch.cuda.set_device(device)
        if world > 1:
            import datetime

            import torch.distributed as dist

            dist.init_process_group(
                "nccl" if device.type == "cuda" else "gloo", store=dist.FileStore(init_file, world), rank=rank,
                world_size=world, timeout=datetime.timedelta(seconds=args.get("timeout", 300.0)),
                device_id=device if device.type == "cuda" else None,
            )  # fmt: skip
        try:
            out.put(_decode_rank(rank, world, args, prompts, port, namespace))
        finally:
            if world > 1:
                import torch.distributed as dist

                dist.destroy_process_group()
    except BaseException as e:  # report, never hang the parent; and say so now: prefill may be waiting on this rank
        logger.error("decode rank %d failed: %s: %s", rank, type(e).__name__, e)
        out.put({"rank": rank, "error": f"{type(e).__name__}: {e}"})


@dataclass
class DecodeGroup:
    """The decode side of ``--pd``: its processes, the store they rendezvous through, their answers."""

    processes: list
    results: Any
    store: Any
    rank_args: dict
    """Extra demo arguments for the prefill ranks (``pd_port``, ``pd_namespace``)."""
    size: int = 1
    answers: list = field(default_factory=list)
    init_file: str | None = None
    """The ranks' ``FileStore`` file, deleted once they are gone (:meth:`result`)."""

    def failure(self) -> str | None:
        """What failed in the decode group so far (non-blocking: the answers in, the processes' exit codes), or
        ``None``: a rank's error, or a rank that died without answering."""
        while len(self.answers) < self.size:
            try:
                self.answers.append(self.results.get_nowait())
            except queue_mod.Empty:
                break
        errors = [f"decode rank {g['rank']}: {g['error']}" for g in self.answers if "error" in g]
        answered = {g["rank"] for g in self.answers}
        died = [f"decode rank {r} exited with code {p.exitcode}" for r, p in enumerate(self.processes)
                if p.exitcode not in (None, 0) and r not in answered]  # fmt: skip
        return "; ".join(errors + died) or None

    def result(self, timeout_s: float = 300.0) -> list[dict]:
        """Every decode rank's answer (``outputs``, ``kv_digest``, ...) or ``error``, in rank order (bounded)."""
        deadline = time.monotonic() + timeout_s
        while len(self.answers) < self.size and time.monotonic() < deadline:
            try:
                self.answers.append(self.results.get(timeout=1.0))
            except queue_mod.Empty:
                if any(p.exitcode not in (None, 0) for p in self.processes):
                    break
        killed = set()
        for r, p in enumerate(self.processes):
            p.join(timeout=10)
            if p.is_alive():
                killed.add(r)
                p.kill()
                p.join(timeout=10)
        if self.init_file is not None:
            remove_store_file(self.init_file)
        self.answers += drain(self.results, self.size - len(self.answers))
        answered = {g["rank"] for g in self.answers}
        late = time.monotonic() >= deadline
        for r, p in enumerate(self.processes):
            if r not in answered:
                code = None if r in killed else p.exitcode
                self.answers.append({"rank": r, "error": silent_rank(r, code, timeout_s, late)})
        if len(self.answers) < self.size:  # no process to name
            self.answers.append({"rank": -1, "error": f"the decode group did not answer within {timeout_s} s"})
        return sorted(self.answers, key=lambda r: r["rank"])

    def finish(self, rank_results: list[dict], timeout_s: float = 300.0) -> dict:
        """Collect the decode group's answers and check them against the prefill ranks' (the ``pd_*`` JSON entries).

        The check: the decode group's KV bytes (gathered from their owners) hash to what every prefill rank sent
        (``pd_kv_digest``), its greedy tokens equal the prefill group's, and every decode rank stores its own pages
        only (``bytes_per_rank * M == replicated``).
        """
        got = self.result(timeout_s)
        errors = [g for g in got if "error" in g]
        if errors:
            msg = "; ".join(f"decode rank {g['rank']}: {g['error']}" for g in errors)
            return {"pd_parity": False, "pd_error": msg, "pd_check": verdict.check(False, _RULE, 0.0, "", msg)}
        r0, d0 = rank_results[0], got[0]
        kv_ok = all(r.get("pd_kv_digest") == g["kv_digest"] for r in rank_results for g in got)
        tokens_ok = all(g["outputs"] == r0["outputs"] for g in got)
        owners_ok = all(g["bytes_per_rank"] * self.size == g["replicated_bytes"] for g in got)
        ok = kv_ok and tokens_ok and owners_ok
        why = [w for w, bad in (("KV digests differ", not kv_ok), ("greedy tokens differ", not tokens_ok),
                                ("a decode rank holds more than its pages", not owners_ok)) if bad]  # fmt: skip
        return {
            "pd_parity": ok,
            "pd_kv_equal": kv_ok,
            "pd_tokens_equal": tokens_ok,
            "pd_outputs": d0["outputs"],
            "pd_entries": sum(r["pd_entries"] for r in rank_results),
            "pd_min_entries": r0["pd_min_entries"],
            "pd_calls": sum(r["pd_calls"] for r in rank_results),
            "pd_bytes": sum(r["pd_bytes"] for r in rank_results),
            "pd_decode_mode": d0["mode"],
            "pd_engine": r0.get("pd_engine", "mooncake"),
            "pd_kv_bytes_per_decode_rank": max(g["bytes_per_rank"] for g in got),
            "pd_kv_bytes_replicated": d0["replicated_bytes"],
            "pd_check": verdict.check(ok, _RULE, 0.0, "", "; ".join(why) or "equal on every decode rank"),
        }


_RULE = ("the decode group's KV bytes on their owners equal the prefill's (a digest of every layer and pool), its "
         "greedy tokens equal the prefill group's, each decode rank stores only its own pages")  # fmt: skip


def start_decode_group(args: dict, prompts: list[list[int]]) -> DecodeGroup:
    """Host the rendezvous ``TCPStore`` on 127.0.0.1 and spawn the ``--decode-cp`` decode ranks."""
    from dtkv.transfer import create_store

    world = int(args.get("decode_cp") or 1)
    store = create_store(port=0, is_master=True, timeout_s=args.get("timeout", 300.0))
    namespace = uuid.uuid4().hex
    ctx = process_context(args)
    results = ctx.Queue()
    fd, init_file = tempfile.mkstemp(prefix="dtkv_decode_")
    os.close(fd)
    os.unlink(init_file)
    procs = [
        ctx.Process(
            target=_worker, args=(r, world, dict(args), [list(p) for p in prompts], store.port, namespace, init_file,
                                  results), daemon=True,
        )
        for r in range(world)
    ]  # fmt: skip
    for p in procs:
        p.start()
    progress("decode group: %d rank(s) started", world)
    return DecodeGroup(
        processes=procs, results=results, store=store, size=world,
        rank_args={"pd_port": store.port, "pd_namespace": namespace}, init_file=init_file,
    )  # fmt: skip
