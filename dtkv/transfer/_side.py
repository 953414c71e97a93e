"""What the prefill sender and the decode receiver share: shards, engine, registration, rendezvous, open attempts."""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Iterable, Sequence
from typing import Literal

import torch.distributed as dist

from dtkv._env import transfer_timeout_s
from dtkv.transfer._create import create_engine
from dtkv.transfer.bootstrap import Bootstrap
from dtkv.transfer.descriptors import RankEndpoint, check_compatible
from dtkv.transfer.errors import TransferError
from dtkv.transfer.messages import AgentRecord, OpenList
from dtkv.transfer.protocol import AttemptKeys, deadline_after, open_key, time_left
from dtkv.transfer.shard import KVShard

__all__ = ["TransferSide"]

logger = logging.getLogger(__name__)


class TransferSide:
    """One side of a PD transfer hosting one or more ranks' :class:`KVShard` on one engine.

    Construction registers every shard with the engine, finishes the attempts a dead earlier incarnation of these
    ranks left open (``{role}/{rank}/open``, see :mod:`dtkv.transfer.protocol`) and publishes each rank's endpoint
    under a fresh random incarnation. If any step fails, what was done is undone (registrations, the engine it
    created) before the error propagates.

    Args:
        shards: the ranks this process hosts.
        bootstrap: the rendezvous store shared by both sides.
        role: ``"prefill"`` or ``"decode"``.
        engine: an engine (:class:`MooncakeEngine`, :class:`NixlEngine`, :class:`LocalEngine`), or the name of
            one to create and own (``"mooncake"``, the default, ``"nixl"``, ``"local"``: :func:`create_engine`).
        timeout_s: bound on every wait (default ``DTKV_TRANSFER_TIMEOUT_S``).
    """

    role: Literal["prefill", "decode"]

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
        self.role = role
        self.timeout_s = transfer_timeout_s() if timeout_s is None else float(timeout_s)
        self.incarnation = secrets.randbits(62)
        """Random id of this side (published with every endpoint; a restarted rank gets a new one)."""
        self.uid = f"{role}-{self.incarnation:016x}"
        self.prefill: list[RankEndpoint] | None = None
        self.decode: list[RankEndpoint] | None = None
        self._open: dict[tuple[str, str], AttemptKeys] = {}
        self._adopted: dict[tuple[str, str], frozenset[str]] = {}
        """Attempts adopted from dead incarnations, still held: the dead uids their listings named."""
        self._open_lock = threading.Lock()
        self._closed = False
        self._own_engine = engine is None or isinstance(engine, str)
        self.agent: AgentRecord | None = None
        """The engine's agent record this side published next to its endpoints (NIXL; ``None`` otherwise)."""
        self.engine = None
        registered: list[KVShard] = []
        try:
            made = create_engine(engine or "mooncake", timeout_s=self.timeout_s) if self._own_engine else engine
            self.engine = made
            for s in shard_list:
                self.engine.register(s.registered_tensors())
                registered.append(s)
            deadline = deadline_after(self.timeout_s)
            self._adopt(deadline)
            self.agent = self.engine.agent_record()
            if self.agent is not None:  # before the endpoints: a peer that sees one finds the record
                for s in shard_list:
                    bootstrap.publish_agent(role, s.rank, self.agent, deadline=deadline)
            for s in shard_list:
                bootstrap.publish(self.endpoint(s.rank), deadline=deadline)
        except BaseException:
            self._unwind(registered)
            raise

    def endpoint(self, rank: int) -> RankEndpoint:
        """The endpoint hosted rank ``rank`` publishes."""
        return self.shards[rank].endpoint(self.role, self.engine.session, self.incarnation)

    def _unwind(self, registered: list[KVShard]) -> None:
        try:
            if self.engine is None:
                return
            if self._own_engine:
                self.engine.close()
            elif registered:
                self.engine.unregister([t for s in registered for t in s.registered_tensors()])
            self._unpublish_agent()
        except Exception as e:  # noqa: BLE001 - the construction error matters more
            logger.warning("undoing a failed %s construction failed: %s", self.role, e)

    # ------------------------------------------------------------------------------------------ rendezvous
    def connect(self, timeout_s: float | None = None) -> None:
        """Wait for every prefill and decode endpoint and check that they are compatible."""
        deadline = deadline_after(self.timeout_s if timeout_s is None else timeout_s)
        self.prefill = self.bootstrap.endpoints("prefill", deadline=deadline)
        self.decode = self.bootstrap.endpoints("decode", deadline=deadline)
        check_compatible(self.prefill, self.decode)
        if self.role == "prefill":  # prefill writes into decode's memory: its engine needs decode's agents
            self._load_agents(self.decode, deadline)

    def _load_agents(self, peers: Sequence[RankEndpoint], deadline: float) -> None:
        """Check that ``peers`` run this side's kind of engine; hand a NIXL engine their agent records."""
        self.engine.check_sessions([ep.session for ep in peers])
        if self.agent is None:
            return
        for ep in peers:
            record = self.bootstrap.agent(ep.role, ep.rank, deadline=deadline)
            if ep.session != f"nixl:{record.name}":
                raise TransferError(
                    f"{ep.role} rank {ep.rank}'s agent record names agent {record.name!r}, its endpoint the session "
                    f"{ep.session!r} (it restarted meanwhile: connect again)",
                    request_id="-",
                    peer=f"{ep.role} rank {ep.rank}",
                )
            self.engine.add_peer(record, deadline=deadline)

    def _unpublish_agent(self) -> None:
        if self.agent is not None:
            for rank in self.shards:
                self.bootstrap.unpublish_agent(self.role, rank, self.agent)

    def _check_party_counts(self, keys: AttemptKeys, deadline: float) -> None:
        """Re-read the endpoints when the attempt names other party counts than ours (a side was resized)."""
        if (keys.num_prefill, keys.num_decode) != (len(self.prefill), len(self.decode)):
            self.connect(time_left(deadline))
        if (keys.num_prefill, keys.num_decode) != (len(self.prefill), len(self.decode)):
            raise TransferError(
                f"the request was posted for {keys.num_prefill} prefill and {keys.num_decode} decode ranks, but "
                f"{len(self.prefill)} and {len(self.decode)} are published",
                request_id=keys.request_id,
                peer="decode rank 0",
            )

    # ------------------------------------------------------------------------------------------ open attempts
    def _hold(self, keys: AttemptKeys, held: bool) -> None:
        """Add ``keys`` to (or drop it from) the attempts this side holds open; :meth:`_write_open` records them."""
        with self._open_lock:
            if held:
                self._open[(keys.request_id, keys.epoch)] = keys
            else:
                self._open.pop((keys.request_id, keys.epoch), None)
                self._adopted.pop((keys.request_id, keys.epoch), None)

    def _open_list(self) -> OpenList:
        with self._open_lock:
            held = list(self._open.values())
            dead = {u for k, uids in self._adopted.items() if k in self._open for u in uids}
        return OpenList(
            by=(self.uid, *sorted(dead)),
            attempts=tuple((k.request_id, k.epoch, k.num_prefill, k.num_decode) for k in held),
        )

    def _write_open(self, store: dist.Store) -> None:
        """(On the store worker.) Record this side's open attempts under every hosted rank's ``open`` key."""
        listing = self._open_list()
        for rank in self.shards:
            key = open_key(self.role, rank)
            if listing.attempts:
                store.set(key, self.bootstrap.encode(key, listing))
            else:
                store.delete_key(key)

    def _adopt(self, deadline: float) -> None:
        """Finish the attempts a dead earlier incarnation of the hosted ranks left open."""
        seen: dict[tuple[str, str], tuple[AttemptKeys, list[int], set[str]]] = {}
        for rank in self.shards:
            key = open_key(self.role, rank)
            listing = self.bootstrap.try_get(key, OpenList, deadline=deadline, peer=f"{self.role} rank {rank}")
            if listing is None:
                continue
            for rid, epoch, num_p, num_d in listing.attempts:
                keys = AttemptKeys(rid, epoch, num_p, num_d)
                entry = seen.setdefault((rid, epoch), (keys, [], set()))
                entry[1].append(rank)
                entry[2].update(listing.by)
        for keys, _, dead in seen.values():  # held (and listed as this incarnation's) until finished: a restart
            self._hold(keys, True)  # dying meanwhile leaves them to the next one
            with self._open_lock:
                self._adopted[(keys.request_id, keys.epoch)] = frozenset(dead)
        for keys, ranks, dead in seen.values():
            logger.warning(
                "%s ranks %s restarted: finishing request %r (attempt %s) they left open",
                self.role,
                ranks,
                keys.request_id,
                keys.epoch,
            )
            self.bootstrap.post(lambda s, k=keys, r=ranks, u=dead: self._adopt_one(s, k, r, u), what="adopt")
        if seen:
            self.bootstrap.post(self._write_open, what="open attempts")

    def _adopt_one(self, store: dist.Store, keys: AttemptKeys, ranks: list[int], dead: set[str]) -> None:
        """(On the store worker.) One attempt a dead incarnation (``dead``: its uids) of ``ranks`` left open:
        complete its deletion if that was under way (:meth:`dtkv.transfer.protocol.AttemptKeys.deleting`), else
        finish it for them."""
        if keys.deleting(store):
            keys.delete(store)
            self._hold(keys, False)
            self._write_open(store)
        else:
            self._finish_dead(store, keys, ranks, dead)

    def _finish_dead(self, store: dist.Store, keys: AttemptKeys, ranks: list[int], dead: set[str]) -> None:
        """(On the store worker.) Finish ``keys`` for ``ranks`` of a dead incarnation of this side: set the bits it
        had not set (:meth:`dtkv.transfer.protocol.AttemptKeys.unfinished`)."""
        raise NotImplementedError

    def _finish(self, store: dist.Store, keys: AttemptKeys, parties: Iterable[int], *, unlist: bool = True) -> None:
        """(On the store worker.) Set the bits of ``parties`` in ``keys``' counter words, after this side's last
        write to the attempt for them; then (``unlist``) drop the attempt from this side's open ones. In that
        order: a rank killed in between leaves the attempt listed, and its restart sets only the bits that are
        not set. The add that completes the words deletes the attempt's keys; this side lists the attempt among
        its open ones while it does, so that a restart of a rank that dies in between completes the deletion
        (:meth:`_adopt_one`) rather than leave the rest of the keys behind."""

        def reopen() -> None:
            self._hold(keys, True)
            self._write_open(store)

        if keys.finish(store, parties, before_delete=reopen):
            unlist = True
        if unlist:
            self._hold(keys, False)
            self._write_open(store)

    # ------------------------------------------------------------------------------------------ close
    def _release_attempts(self) -> None:
        """Hook: finish every attempt this side still holds (called once the memory is unregistered)."""

    def close(self) -> None:
        """Unregister the shards once no engine call touches them (bounded), finish open attempts, unpublish the
        endpoints (and agent records); close the engine too if this side created it. Idempotent."""
        if self._closed or self.engine is None:
            return
        self._closed = True
        if self._own_engine:
            self.engine.close()
        else:
            self.engine.unregister([t for s in self.shards.values() for t in s.registered_tensors()])
        self._unpublish_agent()
        self._release_attempts()
        self.bootstrap.flush(self.timeout_s)
        for rank in self.shards:
            self.bootstrap.unpublish(self.endpoint(rank))
        self.bootstrap.post(self._write_open, what="open attempts")
        if not self.bootstrap.flush(self.timeout_s):
            logger.warning(
                "%s close: store calls still queued after %.1f s (store stalled?)", self.role, self.timeout_s
            )
