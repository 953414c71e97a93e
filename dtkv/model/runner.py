"""Chunked CP prefill and greedy decode of the reference model over paged KV, in four KV modes.

=================  ===========================================================================================
mode               what each CP rank stores and how rows get there
=================  ===========================================================================================
``single``         one process, no CP: the whole pool, every row written locally (the numerical reference)
``replicated``     CP, the baseline inference engines run today: every rank all-gathers the chunk's KV rows and stores
                   the whole logical pool (``cp`` copies)
``sharded``        CP, page-ownership-sharded pool: rows are all-gathered and each rank keeps only the pages it
                   owns (owner-filtered write); attention reads a materialized full view
``sharded_direct`` CP, sharded pool with compute-owner direct writes: pages are allocated on the rank that
                   computes them (page-aligned split), each rank writes its own rows with no KV all-gather;
                   only rows of pages it does not own (a request's partly filled first page, fallback requests)
                   go through a small all-gather + owner-filtered write
=================  ===========================================================================================

All CP modes use the same split of tokens over ranks, so they run identical arithmetic and their outputs
and stored KV bytes are bitwise equal; ``single`` differs only in float64 summation order (see
:mod:`dtkv.model.model`). Each step has a host *plan* (:class:`StepPlan`: split, allocation, locations,
materialization plan, remapped page tables) and a *run* (:meth:`ModelRunner.forward`) that only moves
tensors, so the run compiles with ``torch.compile(fullgraph=True)``.

With ``prefix_cache=True`` the runner keeps a :class:`dtkv.PrefixCache` over its allocator
(:mod:`dtkv.model._prefix`): a new request starts from its prompt's longest cached prefix of full pages and
computes only the rest; fully computed pages are shared after every step; :meth:`ModelRunner.finish_request`
caches a request's pages and releases its references, and cached pages no request holds are evicted (LRU) when a
step's pages would not fit. Results are bitwise those of the same run without the cache.

Decode runs in one of two ``decode_mode`` s:

=============  ===============================================================================================
``"full"``     each decode token is a one-token extend step: split over ranks, KV rows all-gathered, attention
               over the materialized full view (every mode)
``"sharded"``  attention where the pages are (:mod:`dtkv.model.sharded_decode`): every rank scores and attends
               over its own pages only, the ranks exchange top-k candidates and partial outputs; no full view
               and no page movement (``single``, ``sharded``, ``sharded_direct``)
=============  ===============================================================================================
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist

from dtkv import _batch, _env, ops
from dtkv._checks import check_int
from dtkv._collectives import all_gather_rows, group_rank, group_size
from dtkv._util import warn_deprecated
from dtkv.allocator import PageAllocator
from dtkv.attention import AttentionBackend, AttentionName, resolve_attention
from dtkv.debug import check_write_ownership
from dtkv.materialize import MaterializePlan, Materializer, check_view, gather_view, plan_materialize
from dtkv.model import _prefix
from dtkv.model.config import ModelConfig
from dtkv.model.kvio import token_rows, write_rows
from dtkv.model.model import TinyDSA, attention_spec
from dtkv.model.sharded_decode import sharded_decode_step
from dtkv.ownership import OwnershipScheme, PageOwnership, ownership_spec
from dtkv.pool import ShardedKVPool
from dtkv.prefix_cache import PrefixCache
from dtkv.split import allocate_for_split, plan_cp_split

__all__ = ["DecodeMode", "KVMode", "ModelRunner", "Request", "StepPlan"]

KVMode = Literal["single", "replicated", "sharded", "sharded_direct"]
_MODES = ("single", "replicated", "sharded", "sharded_direct")
DecodeMode = Literal["full", "sharded"]
_DECODE_MODES = ("full", "sharded")


@dataclass
class Request:
    """One sequence: its prompt, generated tokens and logical pages (identical on every rank)."""

    rid: int
    prompt: list[int]
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0
    output: list[int] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (not computed)
    finished: bool = False  # pages released (ModelRunner.finish_request)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


@dataclass(frozen=True, kw_only=True, eq=False)
class StepPlan:
    """Host-side metadata of one step on one rank (plan phase); :meth:`ModelRunner.forward` reads it."""

    ids_local: torch.Tensor  # int64 [n_local] token ids of the local rows
    pos_local: torch.Tensor  # int64 [n_local] absolute positions
    locs_local: torch.Tensor  # int64 [n_local] logical token locations of the local rows
    locs_gathered: torch.Tensor  # int64 [cp * max_local] locations of the rank-major gathered rows, -1 = padding
    groups: tuple[tuple[int, int, int, int], ...]  # (request index, local row lo, hi, kv_len) attention groups
    req_view_locs: tuple[torch.Tensor, ...]  # per request int64 [kv_len] rows of the view for positions 0..kv_len-1
    direct_rows: torch.Tensor  # int64 local rows direct-written (sharded_direct)
    handoff_rows: torch.Tensor  # int64 local rows sent through the filtered path (sharded_direct)
    handoff_locs_gathered: torch.Tensor  # int64 [cp * max_handoff] their locations after the all-gather
    max_handoff: int
    page_aligned: bool
    mat_plan: MaterializePlan | None
    last_rows_gathered: torch.Tensor  # int64 [num_reqs] gathered row of each request's last token this step
    max_local: int


class ModelRunner:
    """Runs chunked prefill and greedy decode of :class:`TinyDSA` with KV in one of four modes (module table).

    Every rank of ``group`` builds a runner with the same arguments and calls the same methods (SPMD).

    Args:
        cfg: model geometry.
        mode: KV mode (module table).
        split: CP split, ``"zigzag"`` (page-aligned when possible) or ``"round_robin"``.
        group: the CP process group (ignored for ``single``).
        num_pages: logical pages of the pool.
        ownership_scheme: ownership scheme of the sharded modes' page map (``"interleave"`` or ``"block"``).
        ownership_layout: deprecated name of ``ownership_scheme`` (warns).
        device: where pools and compute live.
        prefix_cache: keep a :class:`dtkv.PrefixCache` and serve new requests from cached pages (module doc).
        decode_mode: ``"full"`` (full-view decode) or ``"sharded"`` (decode on the sharded pool; module table).
        attention: the prefill / full-view attention backend (:mod:`dtkv.attention`): ``"auto"`` (the fastest that is
            available on ``device`` and fits the model: torch on a CPU), ``"torch"`` (float64, the reference),
            ``"triton"``, ``"flashmla"`` (needs FlashMLA-fitting dims: 64 or 128 heads, ``kv_lora_rank`` 512,
            ``rope_dim`` 64, fp8 pages of 64 tokens with ``quant_block`` 128), or a resolved backend. The choice is
            :attr:`attention` (its ``reason`` says why). Sharded decode uses the same backend by name (through
            :class:`dtkv.decode.DecodeStep`).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        mode: KVMode,
        split: Literal["zigzag", "round_robin"] = "zigzag",
        group: dist.ProcessGroup | None = None,
        num_pages: int,
        ownership_scheme: OwnershipScheme = "interleave",
        ownership_layout: OwnershipScheme | None = None,
        device: torch.device | str = "cpu",
        prefix_cache: bool = False,
        decode_mode: DecodeMode = "full",
        attention: AttentionName | AttentionBackend = "auto",
    ) -> None:
        if ownership_layout is not None:
            warn_deprecated("ModelRunner(ownership_layout=...)", "ModelRunner(ownership_scheme=...)")
            ownership_scheme = ownership_layout
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got mode={mode!r}")
        if decode_mode not in _DECODE_MODES:
            raise ValueError(f"decode_mode must be one of {_DECODE_MODES}, got decode_mode={decode_mode!r}")
        if decode_mode == "sharded" and mode == "replicated":
            raise ValueError(
                "decode_mode='sharded' needs a page-sharded pool (mode 'single', 'sharded' or 'sharded_direct'), "
                "got mode='replicated'"
            )
        if split not in ("zigzag", "round_robin"):
            raise ValueError(f"split must be 'zigzag' or 'round_robin', got split={split!r}")
        if mode == "sharded_direct" and split != "zigzag":
            raise ValueError(
                "mode='sharded_direct' needs split='zigzag': round-robin never gives a page one compute owner"
            )
        self.cfg, self.mode, self.split_mode, self.decode_mode = cfg, mode, split, decode_mode
        self.group = None if mode == "single" else group
        self.cp = group_size(self.group)
        self.rank = group_rank(self.group)
        self.device = torch.device(device)
        self.model = TinyDSA(cfg, self.device)
        self.attention = (
            attention
            if isinstance(attention, AttentionBackend)
            else resolve_attention(attention, spec=attention_spec(cfg), device=self.device)
        )
        sharded = mode in ("sharded", "sharded_direct")
        self.ownership = PageOwnership(self.cp if sharded else 1, num_pages, ownership_scheme)
        self.spec = ownership_spec(self.ownership)  # plain ints: what the compiled run passes to the ops
        self.pool = ShardedKVPool(
            cfg.layouts, self.ownership, num_layers=cfg.num_layers, group=self.group if sharded else None, device=device
        )
        # Allocation is SPMD over the logical pages; owner-aware for direct writes.
        self.alloc_ownership = PageOwnership(self.cp, num_pages, ownership_scheme)
        self.allocator = PageAllocator(self.alloc_ownership if sharded else self.ownership)
        self.requests: list[Request] = []
        self.stats = {"steps": 0, "kv_rows_gathered": 0, "direct_rows": 0, "handoff_rows": 0, "scratch_bytes": 0}
        self.prefix_cache = PrefixCache(self.allocator, cfg.page_size) if prefix_cache else None
        self.stats.update(prefix_prompt_tokens=0, prefix_hit_tokens=0)
        self.stats.update(sharded_decode_steps=0, decode_comm_bytes=0, topk_checks=0)

    # ------------------------------------------------------------------------------------------ requests
    def add_request(self, prompt: Sequence[int]) -> Request:
        """Queue a prompt (token ids in ``[0, vocab_size)``; identical calls on every rank).

        With a prefix cache the request starts from its prompt's longest cached prefix of full pages.

        Raises:
            TypeError: a token id is not an int (floats and bools are refused, never truncated).
            ValueError: an empty prompt, an id outside the vocabulary, or more pages than the pool could ever hand
                out (:func:`dtkv._batch.check_prompt`); nothing is queued.
        """
        alloc = self.allocator
        ids = _batch.check_prompt(
            prompt,
            vocab_size=self.cfg.vocab_size,
            page_size=self.cfg.page_size,
            num_pages=alloc.ownership.num_pages - len(alloc.reserved),
        )
        req = Request(rid=len(self.requests), prompt=ids)
        if self.prefix_cache is not None:
            _prefix.attach_cached_prefix(self, req)
        self.requests.append(req)
        return req

    def finish_request(self, rid: int) -> None:
        """End request ``rid``: cache its full pages (with a prefix cache) and release its pages (SPMD).

        A finished request is never stepped, decoded or inspected again (those calls refuse it).

        Raises:
            TypeError / ValueError: ``rid`` is not an int naming a live request (:func:`dtkv._batch.check_rid`).
        """
        req = _batch.check_rid(rid, self.requests)
        _prefix.release_request(self, req)
        if self.prefix_cache is not None and _env.debug_enabled():
            self.prefix_cache.check_agreement(self.group)

    # ------------------------------------------------------------------------------------------ plan
    def plan_step(self, reqs: Sequence[Request], extend_lens: Sequence[int]) -> StepPlan:
        """Split, allocate pages and build every index the step's run needs (host; same on every rank).

        The inputs are checked first, on every rank together (:func:`dtkv._batch.agreed_step`: collective with a
        group); a refused step changes nothing.

        Raises:
            TypeError / ValueError: the batch breaks a rule of :func:`dtkv._batch.check_batch` (empty, a request
                not of this runner, finished or repeated, a length not an int in ``[1, tokens not yet computed]``).
            AllocationError: the step's new pages exceed the free pages plus the evictable cached ones.
        """
        extend_lens = self._check_step(reqs, extend_lens)
        with _batch.undo_new_pages(self.allocator, reqs):
            return self._plan(reqs, extend_lens)

    def _check_step(
        self, reqs: Sequence[Request], extend_lens: Sequence[int] | None, *, decode: bool = False
    ) -> list[int]:
        """The step's input rules and its page budget, on every rank together (nothing changes)."""
        cache = self.prefix_cache

        def check() -> list[int]:
            lens = _batch.check_batch(self.requests, reqs, extend_lens, decode=decode)
            _batch.check_capacity(
                reqs, lens, page_size=self.cfg.page_size, allocator=self.allocator,
                evictable=cache.num_evictable if cache is not None else None,
            )  # fmt: skip
            return lens

        value = functools.partial(_batch.batch_value, reqs)
        return _batch.agreed_step(self.group, what="ModelRunner step", check=check, value=value)

    def _plan(self, reqs: Sequence[Request], extend_lens: list[int]) -> StepPlan:
        ps = self.cfg.page_size
        prefix = [r.num_computed for r in reqs]
        split = plan_cp_split(prefix, extend_lens, cp_size=self.cp, page_size=ps, mode=self.split_mode)
        self._allocate(reqs, extend_lens, split)
        # natural-order ids and locations of the step's tokens
        ids, locs = [], []
        for r, n in zip(reqs, extend_lens):
            pos = torch.arange(r.num_computed, r.num_computed + n)
            pages = torch.tensor(r.pages, dtype=torch.int64)
            ids.append(torch.tensor(r.tokens[r.num_computed : r.num_computed + n], dtype=torch.int64))
            locs.append(pages[pos // ps] * ps + pos % ps)
        ids_nat, locs_nat = torch.cat(ids), torch.cat(locs)
        loc = split.local(self.rank)
        tok = loc.token_index.cpu()
        gi = split.gather_index.cpu()
        locs_gathered = torch.where(gi >= 0, locs_nat[gi.clamp(min=0)], torch.full_like(gi, -1))
        # attention groups: prev then next segment of each request, with their causal KV extents
        groups, row = [], 0
        for i in range(len(reqs)):
            for n_q, kv_len in (
                (loc.actual_seq_q_prev[i], loc.kv_len_prev[i]),
                (loc.actual_seq_q_next[i], loc.kv_len_next[i]),
            ):
                if n_q:
                    groups.append((i, row, row + n_q, kv_len))
                row += n_q
        # pages the step reads: history (before each prefix end, prefetchable) and current (written now)
        need = [r.pages[: -(-(r.num_computed + n) // ps)] for r, n in zip(reqs, extend_lens)]
        sharded = self.mode in ("sharded", "sharded_direct")
        mat_plan = None
        if sharded:
            hist = [p for r, pages in zip(reqs, need) for p in pages[: r.num_computed // ps]]
            cur = [p for r, pages in zip(reqs, need) for p in pages[r.num_computed // ps :]]
            mat_plan = plan_materialize(hist, cur, self.ownership, self.rank, device=self.device)
            page_map = mat_plan.page_map
        req_view_locs = []
        for r, n, pages in zip(reqs, extend_lens, need):
            kv_len = r.num_computed + n
            pg = torch.tensor(pages, dtype=torch.int64, device=self.device)
            view_pages = ops.remap(pg, page_map) if sharded else pg
            pos = torch.arange(kv_len, device=self.device)
            req_view_locs.append(view_pages.to(torch.int64)[pos // ps] * ps + pos % ps)
        # direct writes: rows whose page this rank owns, in page-aligned requests; the rest are handed off
        direct_rows = handoff_rows = torch.zeros(0, dtype=torch.int64)
        handoff_locs_gathered = torch.zeros(0, dtype=torch.int64)
        max_handoff = 0
        if self.mode == "sharded_direct":
            handoff_per_rank = []
            for r_ in range(self.cp):
                lr = split.local(r_)
                lt = lr.token_index.cpu()
                req_of_row = lr.req_idx.cpu()
                aligned_row = split.page_aligned[req_of_row]
                owned = self.ownership.owner(locs_nat[lt] // ps) == r_
                keep = aligned_row & owned
                handoff_per_rank.append((torch.nonzero(~keep).flatten(), lt))
                if r_ == self.rank:
                    direct_rows = torch.nonzero(keep).flatten()
                    handoff_rows = torch.nonzero(~keep).flatten()
            max_handoff = max(int(h.numel()) for h, _ in handoff_per_rank)
            hl = torch.full((self.cp, max_handoff), -1, dtype=torch.int64)
            for r_, (h, lt) in enumerate(handoff_per_rank):
                hl[r_, : h.numel()] = locs_nat[lt[h]]
            handoff_locs_gathered = hl.flatten()
        last_nat = torch.tensor(split.extend_indptr[1:], dtype=torch.int64) - 1
        dev = self.device
        return StepPlan(
            ids_local=ids_nat[tok].to(dev),
            pos_local=loc.positions.to(dev),
            locs_local=locs_nat[tok].to(dev),
            locs_gathered=locs_gathered.to(dev),
            groups=tuple(groups),
            req_view_locs=tuple(req_view_locs),
            direct_rows=direct_rows.to(dev),
            handoff_rows=handoff_rows.to(dev),
            handoff_locs_gathered=handoff_locs_gathered.to(dev),
            max_handoff=max_handoff,
            page_aligned=split.all_page_aligned,
            mat_plan=mat_plan,
            last_rows_gathered=split.restore_index.cpu()[last_nat].to(dev),
            max_local=split.max_local_tokens,
        )

    def _allocate(self, reqs: Sequence[Request], extend_lens: Sequence[int], split) -> None:
        ps = self.cfg.page_size
        if self.prefix_cache is not None:
            _prefix.make_room(self, split)
        if self.mode == "sharded_direct":
            width = max([len(r.pages) for r in reqs] + [1])
            table = torch.full((len(reqs), width), -1, dtype=torch.int64)
            for i, r in enumerate(reqs):
                table[i, : len(r.pages)] = torch.tensor(r.pages, dtype=torch.int64)
            allocation = allocate_for_split(self.allocator, split, table)
            for r, new in zip(reqs, allocation.new_pages):
                r.pages.extend(new.tolist())
            return
        for r, n in zip(reqs, extend_lens):
            need = -(-(r.num_computed + n) // ps) - len(r.pages)
            if need > 0:
                r.pages.extend(self.allocator.alloc_balanced(need).tolist())

    # ------------------------------------------------------------------------------------------ run
    def _gather(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        """Rank-major all-gather of ``x`` padded to ``rows`` rows: ``[cp * rows, ...]`` (identity without CP)."""
        if self.group is None:
            return x
        padded = x.new_zeros((rows, *x.shape[1:]))
        padded[: x.shape[0]] = x
        return all_gather_rows(padded, self.group)

    def _write(self, name: str, layer: int, rows_local: torch.Tensor, plan: StepPlan) -> None:
        lay = self.cfg.layouts[name]
        pool = self.pool.local(name, layer)
        if self.mode == "single":
            write_rows(pool, lay, rows_local, plan.locs_local, self.spec, 0)
        elif self.mode in ("replicated", "sharded"):
            gathered = self._gather(rows_local, plan.max_local)
            write_rows(pool, lay, gathered, plan.locs_gathered, self.spec, self.pool.rank)
        else:
            if _env.debug_enabled():
                check_write_ownership(
                    plan.locs_local[plan.direct_rows], self.ownership, self.rank, self.cfg.page_size, self.group,
                    what=f"direct write of {name!r}, layer {layer}",
                )  # fmt: skip
            write_rows(
                pool,
                lay,
                rows_local[plan.direct_rows],
                plan.locs_local[plan.direct_rows],
                self.spec,
                self.rank,
                direct=True,
                page_aligned=True,
            )
            if plan.max_handoff:
                gathered = self._gather(rows_local[plan.handoff_rows], plan.max_handoff)
                write_rows(pool, lay, gathered, plan.handoff_locs_gathered, self.spec, self.rank)

    def _views(self, layer: int, plan: StepPlan, mat: Materializer | None) -> dict[str, torch.Tensor]:
        if plan.mat_plan is None:
            return {n: self.pool.local(n, layer) for n in self.cfg.layouts}
        if mat is not None:
            mat.prefetch(layer + 1)  # next layer's history gather overlaps this layer's attention
            return mat.view(layer)
        views = {n: gather_view(self.pool.local(n, layer), plan.mat_plan, self.group) for n in sorted(self.cfg.layouts)}
        if _env.debug_enabled():
            check_view(self.pool, layer, plan.mat_plan, views)
        return views

    def forward(self, plan: StepPlan, *, prefetch: bool = False) -> torch.Tensor:
        """The run phase of one step: embeds, writes KV, attends, and returns float64 logits ``[num_reqs, V]``.

        Tensor work only (no host syncs, compiles with fullgraph). With ``prefetch`` the next layer's full view
        is gathered while the current layer computes (eager only; results are identical).
        """
        model, cfg = self.model, self.cfg
        h = model.embed_tokens(plan.ids_local)
        mat = None
        if prefetch and plan.mat_plan is not None:
            mat = Materializer(self.pool, plan.mat_plan)
            mat.prefetch(0)
        for layer in range(cfg.num_layers):
            q = model.project(layer, h, plan.pos_local)
            self._write("kv", layer, q["kv"], plan)
            self._write("index", layer, q["index_k"], plan)
            views = self._views(layer, plan, mat)
            index_keys = token_rows(views["index"], cfg.index_layout)
            attn = h.new_zeros((h.shape[0], cfg.num_heads * cfg.kv_lora_rank), dtype=torch.float64)
            for req_i, lo, hi, kv_len in plan.groups:
                rows = plan.req_view_locs[req_i][:kv_len]
                qs = {k: v[lo:hi] for k, v in q.items() if k not in ("kv", "index_k")}
                attn[lo:hi] = model.attend_view(
                    qs, plan.pos_local[lo:hi], views["kv"], rows, index_keys[rows], self.attention
                )
            h = model.finish_layer(layer, h, attn)
        h_all = self._gather(h, plan.max_local)
        return model.logits(h_all[plan.last_rows_gathered])

    # ------------------------------------------------------------------------------------------ driver
    def step(self, reqs: Sequence[Request], extend_lens: Sequence[int], *, prefetch: bool = False) -> torch.Tensor:
        """Plan and run one step for ``reqs``; returns logits of each request's last token ``[len(reqs), V]``.

        Raises what :meth:`plan_step` raises, with nothing changed. A run that fails gives the step's new pages
        back (the requests keep the pages and computed tokens they had).
        """
        return self._run_step(reqs, self._check_step(reqs, extend_lens), prefetch=prefetch)

    def _run_step(self, reqs: Sequence[Request], extend_lens: list[int], *, prefetch: bool) -> torch.Tensor:
        with _batch.undo_new_pages(self.allocator, reqs):
            plan = self._plan(reqs, extend_lens)
            logits = self.forward(plan, prefetch=prefetch)
        for r, n in zip(reqs, extend_lens):
            r.num_computed += n
        if self.prefix_cache is not None:
            _prefix.cache_computed(self, reqs)
            if _env.debug_enabled():
                self.prefix_cache.check_agreement(self.group)
        self.stats["steps"] += 1
        if plan.mat_plan is not None:
            per_page = sum(lay.page_bytes for lay in self.cfg.layouts.values())
            scratch = plan.mat_plan.scratch_pages * per_page * (2 if prefetch else 1)
            self.stats["scratch_bytes"] = max(self.stats["scratch_bytes"], scratch)
        self.stats["direct_rows"] += int(plan.direct_rows.numel())
        self.stats["handoff_rows"] += int(plan.handoff_rows.numel())
        return logits

    def prefill(self, chunk: int, *, prefetch: bool = False) -> list[int]:
        """Chunked prefill of every request, ``chunk`` tokens per request per step; returns each first token."""
        check_int("chunk", chunk, min_value=1)
        first: dict[int, int] = {}
        while True:
            todo = [r for r in self.requests if r.num_computed < len(r.prompt) and not r.finished]
            if not todo:
                break
            lens = [min(chunk, len(r.prompt) - r.num_computed) for r in todo]
            logits = self.step(todo, lens, prefetch=prefetch)
            for r, row in zip(todo, logits):
                if r.num_computed == len(r.prompt):
                    first[r.rid] = int(row.argmax())
        for r in self.requests:
            if r.rid in first and not r.output:
                r.output.append(first[r.rid])
        return [first[r.rid] for r in self.requests if r.rid in first]

    def decode(self, steps: int) -> list[list[int]]:
        """``steps`` greedy decode steps for every request (one query each, reading the paged KV).

        Requests without a first token (not prefilled yet) are not decoded. With nothing to decode (no request,
        or none prefilled) the call is a no-op on every rank -- no step, no collective -- and returns the outputs
        as they are, as an idle scheduler iteration would.
        """
        check_int("steps", steps, min_value=0)
        for _ in range(steps):
            reqs = [r for r in self.requests if r.output and not r.finished]
            if not reqs:
                break
            logits = self.decode_step(reqs)
            for r, row in zip(reqs, logits):
                r.output.append(int(row.argmax()))
        return [list(r.output) for r in self.requests]

    def decode_step(self, reqs: Sequence[Request]) -> torch.Tensor:
        """Run each request's last generated token through the model in ``decode_mode``: logits ``[len(reqs), V]``.

        Writes the token's KV rows and advances ``num_computed``; the caller appends the next token to ``output``.

        Raises what :meth:`plan_step` raises (every request decodes one token), with nothing changed.
        """
        lens = self._check_step(reqs, None, decode=True)
        if self.decode_mode != "sharded":
            return self._run_step(reqs, lens, prefetch=False)
        if self.prefix_cache is not None:
            _prefix.make_room_for_decode(self, reqs)
        with _batch.undo_new_pages(self.allocator, reqs):
            logits = sharded_decode_step(self, reqs)
        if self.prefix_cache is None:
            return logits
        _prefix.cache_computed(self, reqs)
        if _env.debug_enabled():
            self.prefix_cache.check_agreement(self.group)
        return logits

    # ------------------------------------------------------------------------------------------ inspection
    def _check_inspect(self, rid: int) -> Request:
        """The live request ``rid``, checked on every rank together when reading it is collective."""
        rule = f"request {rid} is finished: its pages were released, got rid={rid}"
        return _batch.agreed_step(
            self.pool.group, what="ModelRunner.kv_bytes", value=lambda r: r.rid,
            check=lambda: _batch.check_rid(rid, self.requests, finished_rule=rule),
        )  # fmt: skip

    def kv_bytes(self, rid: int) -> dict[str, torch.Tensor]:
        """The stored bytes of request ``rid``'s computed tokens in token order (collective in sharded modes).

        Returns:
            name -> uint8 ``[num_layers, num_tokens, token_bytes]`` (indexer: K bytes then the scale bytes).

        Raises:
            TypeError / ValueError: ``rid`` is not an int naming a live request (negative ids never wrap).
        """
        from dtkv.pool import gather_pages

        r = self._check_inspect(rid)
        ps, n = self.cfg.page_size, r.num_computed
        pages = torch.tensor(r.pages, dtype=torch.int64)
        pos = torch.arange(n)
        pg, off = pages[pos // ps], pos % ps
        out = {}
        for name, lay in sorted(self.cfg.layouts.items()):
            per_layer = []
            for layer in range(self.cfg.num_layers):
                full = gather_pages(self.pool.local(name, layer), self.ownership, self.pool.group).cpu()
                full = full.view(torch.uint8).reshape(full.shape[0], -1)
                if name == "index":
                    j = lay.head_dim
                    k = full[:, : ps * j].reshape(-1, ps, j)[pg, off]
                    s = full[:, ps * j :].reshape(-1, ps, 4)[pg, off]
                    per_layer.append(torch.cat((k, s), dim=1))
                else:
                    per_layer.append(full.reshape(full.shape[0], ps, -1)[pg, off])
            out[name] = torch.stack(per_layer)
        return out
