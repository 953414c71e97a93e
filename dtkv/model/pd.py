"""Deprecated (one release): PD for every model is :mod:`dtkv.runtime.pd` (a prefill group of N ranks into a decode
group of M ranks), the demo's wiring :mod:`dtkv.demo._pd`.

The 0.1 names keep working: :func:`send_prefilled`, :func:`receive_prefilled`, :func:`kv_digest`,
:func:`shard_for_runner`, :data:`META_ROW_BYTES`, and the ``demo --pd`` wiring :func:`start_decode` /
:func:`send_from_rank` (the reference model's defaults filled in).
"""

from __future__ import annotations

from collections.abc import Sequence

from dtkv._util import deprecated_alias, warn_deprecated
from dtkv.runtime import pd as _pd
from dtkv.transfer.prefilled import META_ROW_BYTES, kv_digest, shard_for_runner

__all__ = [
    "META_ROW_BYTES",
    "kv_digest",
    "receive_prefilled",
    "send_from_rank",
    "send_prefilled",
    "shard_for_runner",
    "start_decode",
]

_DEMO_DEFAULTS = {"model": "reference", "decode": "full", "attention": "torch", "seed": 0, "dtype": None,
                  "decode_cp": 1, "timeout": 300.0}  # fmt: skip


send_prefilled = deprecated_alias("dtkv.model.pd.send_prefilled", "dtkv.runtime.pd.send_prefilled", _pd.send_prefilled)
receive_prefilled = deprecated_alias(
    "dtkv.model.pd.receive_prefilled", "dtkv.runtime.pd.receive_prefilled", _pd.receive_prefilled
)


class _DecodeProcess:
    """The 0.1 decode process of ``demo --pd``: one decode rank's answer (``result``), the PD verdict (``finish``)."""

    def __init__(self, group) -> None:
        self.group, self.rank_args = group, group.rank_args

    def result(self, timeout_s: float = 300.0) -> dict:
        got = self.group.result(timeout_s)
        errors = [g for g in got if "error" in g]
        return {"error": errors[0]["error"]} if errors else got[0]

    def finish(self, rank_results: Sequence[dict], timeout_s: float = 300.0) -> dict:
        out = self.group.finish(list(rank_results), timeout_s)
        out.pop("pd_check", None)
        return out


def start_decode(args: dict, prompts: Sequence[Sequence[int]]):
    """Deprecated: :func:`dtkv.demo._pd.start_decode_group` (one decode process, the reference model)."""
    from dtkv.demo._pd import start_decode_group

    warn_deprecated("dtkv.model.pd.start_decode", "python -m dtkv.demo --pd (dtkv.demo._pd.start_decode_group)")
    return _DecodeProcess(start_decode_group({**_DEMO_DEFAULTS, **args}, [list(p) for p in prompts]))


def send_from_rank(runner, args: dict, baseline_kv=None) -> dict:
    """Deprecated: :func:`dtkv.demo._pd.send_from_rank` (``baseline_kv``'s digest replaces the runner's own)."""
    from dtkv.demo._pd import send_from_rank as send

    warn_deprecated("dtkv.model.pd.send_from_rank", "python -m dtkv.demo --pd (dtkv.demo._pd.send_from_rank)")
    out = send(runner, {**_DEMO_DEFAULTS, **args})
    if baseline_kv is not None:
        out["pd_kv_digest"] = kv_digest(baseline_kv, [len(r.prompt) for r in runner.requests])
    return out
