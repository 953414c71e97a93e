"""``python -m dtkv.demo --model ... --pd``: the decode process and the prefill ranks' side of the hand-off.

:func:`start_decode` hosts the rendezvous ``TCPStore`` and spawns the decode process, which wraps the same tiny
model (same seed) in a single-process :class:`DSAModelRunner`, receives every request over Mooncake
(:func:`dtkv.integrations.transformers.pd.receive_prefilled`) and continues with greedy decode;
:func:`send_from_rank` runs in each prefill rank; :meth:`DecodeProcess.finish` compares the two sides.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from dtkv._pd_process import DecodeProcess, spawn_decode

__all__ = ["DecodeProcess", "send_from_rank", "start_decode"]


def send_from_rank(runner, args: dict) -> dict:
    """Prefill-rank side: send every request of ``runner`` to the decode process (after prefill).

    Returns ``pd_entries``, ``pd_min_entries``, ``pd_calls``, ``pd_bytes`` (this rank's) and ``pd_kv_digest``
    (a hash of the requests' stored prompt KV; collective over the runner's group). Every wait is bounded by
    ``args["timeout"]`` (the demo's ``--timeout``; the decode process may still be loading the model).
    """
    from dtkv.integrations.transformers.pd import kv_digest, request_bytes, send_prefilled, shard_for_runner
    from dtkv.transfer import Bootstrap, PrefillSender, create_store

    prompts = [r.prompt for r in runner.requests]
    digest = kv_digest([runner.kv_bytes(r.rid) for r in runner.requests], [len(p) for p in prompts])
    store = create_store(port=args["pd_port"], is_master=False, timeout_s=args.get("timeout", 300.0))
    shard = shard_for_runner(runner, staging_bytes=request_bytes(runner, [len(p) for p in prompts]))
    sender = PrefillSender(shard, Bootstrap(store, namespace=args["pd_namespace"]), timeout_s=args.get("timeout"))
    try:
        sender.connect()
        reports = send_prefilled(runner, sender)
    finally:
        sender.close()
    return {
        "pd_entries": sum(r.num_entries for r in reports),
        "pd_min_entries": sum(r.min_entries for r in reports),
        "pd_calls": sum(r.num_calls for r in reports),
        "pd_bytes": sum(r.num_bytes for r in reports),
        "pd_kv_digest": digest,
    }


def _decode_main(conn, args: dict, prompts: list[list[int]], port: int, namespace: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        from dtkv.integrations.transformers._demo import DTYPES
        from dtkv.integrations.transformers.pd import kv_digest, receive_prefilled, request_bytes, shard_for_runner
        from dtkv.integrations.transformers.reference import tiny_model
        from dtkv.integrations.transformers.runner import DSAModelRunner, num_pages_for
        from dtkv.transfer import Bootstrap, DecodeReceiver, create_store

        torch.set_num_threads(1)
        lm = tiny_model(args["model"], seed=args["seed"], dtype=DTYPES[args["dtype"]])
        steps = args["decode_steps"]
        num_pages = num_pages_for([len(p) for p in prompts], page_size=args["page_size"], decode_steps=steps)
        runner = DSAModelRunner(lm, num_pages=num_pages, page_size=args["page_size"], kv_dtype=args["kv_dtype"])
        store = create_store(port=port, is_master=False, timeout_s=args.get("timeout", 300.0))
        shard = shard_for_runner(runner, staging_bytes=request_bytes(runner, [len(p) for p in prompts]))
        receiver = DecodeReceiver(shard, Bootstrap(store, namespace=namespace), timeout_s=args.get("timeout"))
        try:
            receiver.connect()
            reports = receive_prefilled(runner, receiver, prompts)
        finally:
            receiver.close()
        digest = kv_digest([runner.kv_bytes(r.rid) for r in runner.requests], [len(p) for p in prompts])
        outputs = runner.decode(steps)
        conn.send({"outputs": outputs, "kv_digest": digest, "entries": sum(r.num_entries for r in reports)})
    except BaseException as e:  # report, never hang the parent
        conn.send({"error": f"{type(e).__name__}: {e}"})


def start_decode(args: dict, prompts: Sequence[Sequence[int]]) -> DecodeProcess:
    """Host the rendezvous ``TCPStore`` on 127.0.0.1 and spawn the decode process."""
    return spawn_decode(_decode_main, args, prompts)
