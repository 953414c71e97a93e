"""Deprecated (one release): PD for every model is :mod:`dtkv.runtime.pd` (a prefill group of N ranks into a decode
group of M ranks that may decode on its shards); these 0.1 names forward to it."""

from __future__ import annotations

from dtkv._util import deprecated_alias
from dtkv.runtime import pd as _pd
from dtkv.transfer.prefilled import META_ROW_BYTES, kv_digest, shard_for_runner

__all__ = ["META_ROW_BYTES", "kv_digest", "receive_prefilled", "request_bytes", "send_prefilled", "shard_for_runner"]


_OLD = "dtkv.integrations.transformers.pd"
request_bytes = deprecated_alias(f"{_OLD}.request_bytes", "dtkv.runtime.pd.request_bytes", _pd.request_bytes)
send_prefilled = deprecated_alias(f"{_OLD}.send_prefilled", "dtkv.runtime.pd.send_prefilled", _pd.send_prefilled)
receive_prefilled = deprecated_alias(
    f"{_OLD}.receive_prefilled", "dtkv.runtime.pd.receive_prefilled", _pd.receive_prefilled
)
