"""PD transfer over Mooncake: each prefill CP rank sends the KV pages it owns, with their positions, to decode.

Entry points:

- :func:`plan_request` -- pure, placement-aware descriptors: per prefill rank, coalesced
  ``(src, dst, length)`` entries for its owned pages only, to a non-CP decode or a decode with its own
  :class:`dtkv.PageOwnership` of any cp size and ownership scheme, with optional staging and layer groups
  (:class:`PlanOptions`).
- :class:`KVShard` -- one rank's registered buffers (``KVShard.from_pool(pool)``), staging and metadata rows;
  layer-major or page-major (``ShardedKVPool(page_major=True)``: a run of pages is one entry for every layer), either
  layout on either side.
- :class:`PrefillSender` / :class:`DecodeReceiver` -- ``send_request`` / ``receive_request`` over a
  :class:`Bootstrap` store, on a :class:`MooncakeEngine` (TCP, P2PHANDSHAKE; sglang's transport), a
  :class:`NixlEngine` (UCX; vLLM's) or the in-process :class:`LocalEngine` (``engine="mooncake" | "nixl" |
  "local"``, :func:`create_engine`); a failed request's decode pages stay quarantined until
  :meth:`DecodeReceiver.reclaim` returns them.
- :class:`HandoffSender` / :class:`HandoffReceiver` -- the same, for pools in host or device memory: through a
  bounded pinned host window where the engine cannot register the pool's memory (a CUDA pool under Mooncake's
  non-cuda wheel), in rounds (:mod:`dtkv.transfer.handoff`; which engine builds register device memory:
  :mod:`dtkv.transfer.memory`).
- :class:`TransferError` -- every failure or timeout, naming the peer, the request and the pages;
  :class:`StoreTimeout` is its case of a store call that ran into the caller's deadline.

What a plan is: :mod:`dtkv.transfer.descriptors`; how it is chosen: :mod:`dtkv.transfer.plan`; the store keys,
deadlines and the protocol: :mod:`dtkv.transfer.protocol`; the byte format of stored values (no pickle, optional
HMAC): :mod:`dtkv.transfer.wire`; why a signed value is not a live one, and decode's answers to prefill's claims:
:mod:`dtkv.transfer.liveness`; the metadata row a prefilled request travels with, checked on arrival:
:mod:`dtkv.transfer.prefilled`. PD with a runtime (any model; a runtime's requests sent and received) is
:mod:`dtkv.runtime.pd`, the ``demo --pd`` wiring :mod:`dtkv.demo._pd`.
The page-table format is in :mod:`dtkv.page_table`.
"""

from __future__ import annotations

from dtkv.transfer._create import create_engine
from dtkv.transfer._nixl import NixlEngine, apply_nixl_env, nixl_available
from dtkv.transfer._side import TransferSide
from dtkv.transfer.bootstrap import Bootstrap, create_store
from dtkv.transfer.coalesce import coalesce_entries, expand_layers, expand_runs, page_runs, split_batches
from dtkv.transfer.decode import DecodeReceiver, ReceiveReport
from dtkv.transfer.descriptors import (
    BufferSpec,
    PeerEntries,
    RankEndpoint,
    RequestPlan,
    SenderPlan,
    StageCopy,
    check_compatible,
)
from dtkv.transfer.engine import (
    ENGINES,
    MAX_ENTRIES_PER_CALL,
    LocalEngine,
    MooncakeEngine,
    apply_mooncake_env,
    mooncake_available,
    send_entries,
)
from dtkv.transfer.errors import StoreTimeout, TransferError
from dtkv.transfer.handoff import HandoffReceiver, HandoffSender, default_round_pages
from dtkv.transfer.memory import needs_host_staging
from dtkv.transfer.messages import DstRequest, SendOutcome, SendStart
from dtkv.transfer.plan import PlanOptions, disable_staging, layer_bounds, plan_request
from dtkv.transfer.prefill import PrefillSender, SendReport
from dtkv.transfer.shard import KVShard

__all__ = [
    "ENGINES",
    "MAX_ENTRIES_PER_CALL",
    "Bootstrap",
    "BufferSpec",
    "DecodeReceiver",
    "DstRequest",
    "HandoffReceiver",
    "HandoffSender",
    "KVShard",
    "LocalEngine",
    "MooncakeEngine",
    "NixlEngine",
    "PeerEntries",
    "PlanOptions",
    "PrefillSender",
    "RankEndpoint",
    "ReceiveReport",
    "RequestPlan",
    "SendOutcome",
    "SendReport",
    "SendStart",
    "SenderPlan",
    "StageCopy",
    "StoreTimeout",
    "TransferError",
    "TransferSide",
    "apply_mooncake_env",
    "apply_nixl_env",
    "check_compatible",
    "coalesce_entries",
    "create_engine",
    "create_store",
    "default_round_pages",
    "disable_staging",
    "expand_layers",
    "expand_runs",
    "layer_bounds",
    "mooncake_available",
    "needs_host_staging",
    "nixl_available",
    "page_runs",
    "plan_request",
    "send_entries",
    "split_batches",
]
