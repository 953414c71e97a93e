"""Deprecated (one release): PD for every model is :mod:`dtkv.runtime.pd` (a prefill group of N ranks into a decode
group of M ranks that may decode on its shards); these 0.1 names forward to it."""

from __future__ import annotations

from collections.abc import Sequence

from dtkv._util import warn_deprecated
from dtkv.runtime import pd as _pd
from dtkv.transfer.prefilled import META_ROW_BYTES, kv_digest, shard_for_runner

__all__ = ["META_ROW_BYTES", "kv_digest", "receive_prefilled", "request_bytes", "send_prefilled", "shard_for_runner"]


def request_bytes(runner, prompt_lens: Sequence[int]) -> int:
    """Deprecated: :func:`dtkv.runtime.pd.request_bytes`."""
    warn_deprecated("dtkv.integrations.transformers.pd.request_bytes", "dtkv.runtime.pd.request_bytes")
    return _pd.request_bytes(runner, prompt_lens)


def send_prefilled(runner, sender, *, tag: str = "", timeout_s: float | None = None):
    """Deprecated: :func:`dtkv.runtime.pd.send_prefilled`."""
    warn_deprecated("dtkv.integrations.transformers.pd.send_prefilled", "dtkv.runtime.pd.send_prefilled")
    return _pd.send_prefilled(runner, sender, tag=tag, timeout_s=timeout_s)


def receive_prefilled(runner, receiver, prompts: Sequence[Sequence[int]], *, tag: str = "", timeout_s=None):
    """Deprecated: :func:`dtkv.runtime.pd.receive_prefilled`."""
    warn_deprecated("dtkv.integrations.transformers.pd.receive_prefilled", "dtkv.runtime.pd.receive_prefilled")
    return _pd.receive_prefilled(runner, receiver, prompts, tag=tag, timeout_s=timeout_s)
