"""The decode process of the demos' ``--pd`` (reference model and transformers models): spawn it, collect it.

:func:`spawn_decode` hosts the rendezvous store on 127.0.0.1 and starts ``target(conn, args, prompts, port,
namespace)`` in a spawned process; :meth:`DecodeProcess.finish` waits for its answer (bounded) and compares it
with the prefill ranks' results.
"""

from __future__ import annotations

import multiprocessing as mp
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["DecodeProcess", "spawn_decode"]


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

        ``pd_parity`` is true when the KV decode received hashes equal to what every prefill rank reports
        (``pd_kv_digest``) and decode's generated tokens equal the CP run's (``rank_results[0]["outputs"]``).
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


def spawn_decode(target: Callable, args: dict, prompts: Sequence[Sequence[int]]) -> DecodeProcess:
    """Host the rendezvous ``TCPStore`` on 127.0.0.1 and spawn ``target`` as the decode process."""
    from dtkv.transfer import create_store

    store = create_store(port=0, is_master=True, timeout_s=args.get("timeout", 300.0))
    namespace = uuid.uuid4().hex
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(
        target=target, args=(child, dict(args), [list(p) for p in prompts], store.port, namespace), daemon=True
    )
    proc.start()
    return DecodeProcess(
        process=proc, conn=parent, store=store, rank_args={"pd_port": store.port, "pd_namespace": namespace}
    )
