"""What the prefill sender and the decode receiver share: shards, engine, registration, rendezvous."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Literal

from dtkv._env import transfer_timeout_s
from dtkv.transfer.bootstrap import Bootstrap
from dtkv.transfer.descriptors import RankEndpoint, check_compatible
from dtkv.transfer.engine import MooncakeEngine
from dtkv.transfer.shard import KVShard

__all__ = ["TransferSide"]


class TransferSide:
    """One side of a PD transfer hosting one or more ranks' :class:`KVShard` on one engine.

    Registers every shard with the engine and publishes its endpoint under ``role`` in the bootstrap store.

    Args:
        shards: the ranks this process hosts.
        bootstrap: the rendezvous store shared by both sides.
        role: ``"prefill"`` or ``"decode"``.
        engine: a :class:`MooncakeEngine` (default: a new one on 127.0.0.1) or :class:`LocalEngine`.
        timeout_s: bound on every wait (default ``DTKV_TRANSFER_TIMEOUT_S``).
    """

    def __init__(
        self,
        shards: KVShard | Sequence[KVShard],
        bootstrap: Bootstrap,
        role: Literal["prefill", "decode"],
        *,
        engine=None,
        timeout_s: float | None = None,
    ) -> None:
        shard_list = [shards] if isinstance(shards, KVShard) else list(shards)
        if not shard_list:
            raise ValueError("shards must hold at least one KVShard, got none")
        self.shards = {s.rank: s for s in shard_list}
        self.bootstrap = bootstrap
        self.timeout_s = transfer_timeout_s() if timeout_s is None else float(timeout_s)
        self._own_engine = engine is None
        self.engine = MooncakeEngine(timeout_s=self.timeout_s) if engine is None else engine
        for s in shard_list:
            self.engine.register(s.registered_tensors())
            bootstrap.publish(s.endpoint(role, self.engine.session))
        self.prefill: list[RankEndpoint] | None = None
        self.decode: list[RankEndpoint] | None = None

    def connect(self, timeout_s: float | None = None) -> None:
        """Wait for every prefill and decode endpoint and check that they are compatible."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        self.prefill = self.bootstrap.endpoints("prefill", deadline=deadline)
        self.decode = self.bootstrap.endpoints("decode", deadline=deadline)
        check_compatible(self.prefill, self.decode)

    def close(self) -> None:
        """Unregister the shards; close the engine too if this side created it."""
        if self._own_engine:
            self.engine.close()
        else:
            self.engine.unregister([t for s in self.shards.values() for t in s.registered_tensors()])
