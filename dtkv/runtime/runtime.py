"""``Runtime``: the SPMD serving loop of every model over dtkv's pools (see :mod:`dtkv.runtime` for the design)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Literal

import torch
import torch.distributed as dist

from dtkv import _env
from dtkv._agree import agree
from dtkv._checks import check_int
from dtkv._collectives import cpu_channel, gather_padded, group_rank, group_size
from dtkv._util import cdiv
from dtkv.allocator import AllocationError, PageAllocator
from dtkv.attention import AttentionBackend, AttentionName, AttentionSpec, resolve_attention
from dtkv.layouts import MLAFp8Layout, MLALatentLayout
from dtkv.materialize import Materializer
from dtkv.ownership import OwnershipScheme, PageOwnership, ownership_spec
from dtkv.pool import ShardedKVPool, gather_pages
from dtkv.prefix_cache import PrefixCache
from dtkv.runtime import _batch, _prefix
from dtkv.runtime._decode import ShardedDecodeAttention, plan_sharded_step
from dtkv.runtime._graphs import CudaGraphs, DecodeGraphs, PendingTokens, resolve_cuda_graphs
from dtkv.runtime._invariant import _BatchInvariant
from dtkv.runtime._outcome import StepOutcome
from dtkv.runtime._plan import ExtendPlan, plan_extend
from dtkv.runtime._request import Request
from dtkv.runtime.adapter import ModelAdapter
from dtkv.runtime.context import StepContext

__all__ = ["DECODE_MODES", "KV_MODES", "DecodeMode", "KVMode", "Runtime", "num_pages_for"]

KVMode = Literal["single", "replicated", "sharded", "sharded_direct"]
KV_MODES: tuple[str, ...] = ("single", "replicated", "sharded", "sharded_direct")
DecodeMode = Literal["full", "sharded"]
DECODE_MODES: tuple[str, ...] = ("full", "sharded")
_SPLITS = ("zigzag", "round_robin")


def num_pages_for(prompt_lens: Sequence[int], *, page_size: int, decode_steps: int = 0, cp_size: int = 1) -> int:
    """Logical pages a pool needs for these prompts plus ``decode_steps`` generated tokens each.

    Every request may waste up to one page to owner-aware allocation, and each owner one more; the count is
    rounded up to a multiple of ``cp_size`` so every rank stores the same number of pages.
    """
    pages = sum(cdiv(n + decode_steps + 1, page_size) + 1 for n in prompt_lens) + cp_size
    return cdiv(pages, cp_size) * cp_size


class Runtime:
    """Chunked CP prefill, the prefix cache and greedy decode of any :class:`ModelAdapter` (SPMD).

    Every rank of ``group`` builds a runtime with the same arguments over the same model (same weights) and calls
    the same methods in the same order. Construction checks that the ranks agree on the configuration (collective,
    every rank raises together otherwise) and binds the adapter (:meth:`close` unbinds it).

    Args:
        adapter: the model (:class:`dtkv.model.ReferenceAdapter`,
            :class:`dtkv.integrations.transformers.TransformersAdapter`, or your own).
        num_pages: logical KV pages of the pool (:func:`num_pages_for` sizes it).
        group: the CP process group; ``None`` (or a group of one) for a single process.
        mode: KV mode (:mod:`dtkv.runtime` table); default ``"single"`` without a group, else
            ``"sharded_direct"`` with the zigzag split and ``"sharded"`` with round-robin.
        split: CP split, ``"zigzag"`` (page-aligned where a request touches ``>= 2 cp`` pages) or ``"round_robin"``.
        scheme: ownership scheme of the sharded pools, ``"interleave"`` or ``"block"``.
        decode_mode: ``"full"`` (each decode token is a one-token extend step over a full view) or ``"sharded"``
            (attention where the pages are: no full view, no page movement; not with ``mode="replicated"``).
        prefix_cache: keep a :class:`dtkv.PrefixCache`: new requests start from their prompt's longest cached
            prefix of full pages; finished requests' full pages stay cached until evicted (LRU).
        attention: the attention backend of prefill and full-view decode (:mod:`dtkv.attention`; the model's
            attention reads it as ``ctx.attention``): ``"auto"`` (the fastest available on the model's device that
            fits: torch on a CPU), ``"torch"`` (the parity reference), ``"triton"``, ``"flashmla"`` (its fit rules:
            :func:`dtkv.attention.check_fit`), or a resolved backend. The choice is :attr:`attention` (its
            ``reason`` says why). Sharded decode runs :class:`dtkv.decode.DecodeStep` with the same backend by
            name (fp8 index pages; :mod:`dtkv.runtime._decode`).
        batch_invariant: run every step under :func:`dtkv.runtime.batch_invariant`, so a token's results do not
            depend on the tokens sharing its step (what bitwise prefix-cache parity needs from float32 models).
        cuda_graphs: decode steps as CUDA graphs, one per batch bucket (:mod:`dtkv.runtime._graphs`): ``True``
            (CUDA only), ``False``, ``"emulate"`` (the graph path's buckets and static buffers run eagerly, on any
            device), ``None`` (default: ``True`` on CUDA unless ``batch_invariant``, else ``False``). The resolved
            mode is :attr:`graph_mode`; :attr:`graphs` has the buckets and says why a step ran eager.
        page_major: store the pool page-major (:class:`dtkv.ShardedKVPool` ``page_major``): a page's layers next
            to each other, so that a PD hand-off moves a run of pages in one entry for every layer.

    Attributes:
        requests: the :class:`Request` objects, in the order they were added (``requests[rid]``).
        pool: the :class:`dtkv.ShardedKVPool` (``"kv"`` and ``"index"``, one layer per model layer).
        allocator: the SPMD :class:`dtkv.PageAllocator` (over the CP group's ownership in the sharded modes).
        prefix_cache: the :class:`dtkv.PrefixCache`, or None.
        attention: the resolved :class:`dtkv.attention.AttentionBackend`.
        graph_mode: ``"capture"``, ``"emulate"`` or ``"off"`` (from ``cuda_graphs``).
        graphs: the :class:`dtkv.runtime._graphs.DecodeGraphs` of the decode steps (``None`` when ``"off"``).
        stats: counters: ``steps``, ``direct_rows``, ``handoff_rows``, ``scratch_bytes`` (largest materialization
            scratch per rank), ``prefix_prompt_tokens``, ``prefix_hit_tokens``, ``sharded_decode_steps``,
            ``decode_comm_bytes``, ``topk_checks``.

    Raises:
        ValueError: a bad ``mode``, ``split``, ``decode_mode`` or ``scheme``, ``sharded_direct`` with round-robin,
            sharded decode over a replicated pool, ``cuda_graphs=True`` off CUDA or with ``batch_invariant``; a
            configuration the ranks do not share (every rank).
        TypeError: ``cuda_graphs`` is not a bool, ``"emulate"`` or None.
    """

    def __init__(
        self,
        adapter: ModelAdapter,
        *,
        num_pages: int,
        group: dist.ProcessGroup | None = None,
        mode: KVMode | None = None,
        split: Literal["zigzag", "round_robin"] = "zigzag",
        scheme: OwnershipScheme = "interleave",
        decode_mode: DecodeMode = "full",
        prefix_cache: bool = False,
        attention: AttentionName | AttentionBackend = "auto",
        batch_invariant: bool = False,
        cuda_graphs: CudaGraphs = None,
        page_major: bool = False,
    ) -> None:
        for name in ("spec", "device", "forward", "logits"):
            if not hasattr(adapter, name):
                raise TypeError(f"adapter must be a dtkv.runtime.ModelAdapter (it has no {name!r}), got {adapter!r}")
        check_int("num_pages", num_pages, min_value=1)
        if split not in _SPLITS:
            raise ValueError(f"split must be 'zigzag' or 'round_robin', got split={split!r}")
        if mode is None:
            mode = "single" if group_size(group) == 1 else ("sharded_direct" if split == "zigzag" else "sharded")
        if mode not in KV_MODES:
            raise ValueError(f"mode must be one of {KV_MODES}, got mode={mode!r}")
        if decode_mode not in DECODE_MODES:
            raise ValueError(f"decode_mode must be one of {DECODE_MODES}, got decode_mode={decode_mode!r}")
        if decode_mode == "sharded" and mode == "replicated":
            raise ValueError(
                "decode_mode='sharded' needs a page-sharded pool (mode 'single', 'sharded' or 'sharded_direct'), "
                "got mode='replicated'"
            )
        if mode == "sharded_direct" and split != "zigzag":
            raise ValueError(
                "mode='sharded_direct' needs split='zigzag': round-robin never gives a page one compute owner"
            )
        self.adapter, self.model_spec, self.device = adapter, adapter.spec, torch.device(adapter.device)
        self.mode, self.split_mode, self.decode_mode = mode, split, decode_mode
        self.batch_invariant = bool(batch_invariant)
        self.graph_mode = resolve_cuda_graphs(cuda_graphs, self.device, batch_invariant=self.batch_invariant)
        if isinstance(attention, AttentionBackend):
            self.attention = attention
        else:
            spec, kv = self.model_spec, self.model_spec.layouts["kv"]
            if not isinstance(kv, (MLALatentLayout, MLAFp8Layout)):
                raise TypeError(f"the adapter's 'kv' layout must be an MLA layout, got {type(kv).__name__}")
            fit = AttentionSpec(num_heads=spec.num_heads, layout=kv, topk=spec.index_topk)
            self.attention = resolve_attention(attention, spec=fit, device=self.device)
        self.group = None if mode == "single" or group_size(group) == 1 else group
        self.cp, self.rank = group_size(self.group), group_rank(self.group)
        sharded = mode in ("sharded", "sharded_direct")
        self.ownership = PageOwnership(self.cp if sharded else 1, num_pages, scheme)
        self.ownership_spec = ownership_spec(self.ownership)  # plain ints: what compiled runs pass to the ops
        self.alloc_ownership = PageOwnership(self.cp, num_pages, scheme)
        self.pool = ShardedKVPool(
            self.model_spec.layouts, self.ownership, num_layers=self.model_spec.num_layers,
            group=self.group if sharded else None, device=self.device, page_major=page_major,
        )  # fmt: skip
        self.allocator = PageAllocator(self.alloc_ownership if sharded else self.ownership)
        self.prefix_cache = PrefixCache(self.allocator, self.page_size) if prefix_cache else None
        self.requests: list[Request] = []
        self._outcome: StepOutcome | None = None  # the step running now (its evictions are noted there)
        self.closed = False
        """Whether :meth:`close` ran (a closed runtime runs no step)."""
        self.transfer_held: dict[str, list[int]] = {}
        """Pages of requests whose PD receive failed, by transfer id, held until :func:`dtkv.runtime.pd.reclaim`."""
        self.stats = {
            "steps": 0, "direct_rows": 0, "handoff_rows": 0, "scratch_bytes": 0, "prefix_prompt_tokens": 0,
            "prefix_hit_tokens": 0, "sharded_decode_steps": 0, "decode_comm_bytes": 0, "topk_checks": 0,
        }  # fmt: skip
        if self.group is not None:
            config = {
                "mode": mode, "split": split, "scheme": scheme, "decode_mode": decode_mode, "num_pages": num_pages,
                "prefix_cache": bool(prefix_cache), "batch_invariant": self.batch_invariant,
                "attention": self.attention.name, "model": adapter.describe(), "cuda_graphs": self.graph_mode,
                "page_major": self.pool.page_major,
            }  # fmt: skip
            agree(None, cpu_channel(self.group), what="Runtime", value=config)
        self._schedules: dict = {}  # the attention backend's decode schedules of full-view decode steps, by shape
        self.graphs = DecodeGraphs(self, self.graph_mode) if self.graph_mode != "off" else None
        adapter.bind()

    @property
    def page_size(self) -> int:
        """Tokens per page."""
        return self.model_spec.page_size

    def close(self) -> None:
        """Detach the adapter from its model (e.g. unbind a transformers model's attention modules); idempotent.

        Afterwards the runtime refuses every call that would run the model or take pages (``add_request``,
        ``step``, ``plan_step``, ``forward``, ``prefill``, ``decode_step``, ``decode``); ``finish_request`` and
        ``kv_bytes`` still work."""
        if not self.closed:
            self.closed = True
            self.adapter.close()

    def _check_open(self, what: str) -> None:
        if self.closed:
            raise RuntimeError(
                f"Runtime.{what}() on a closed runtime: close() ran (or its with-block ended), so its adapter is "
                "unbound from the model; build a new Runtime to run it again (nothing was allocated)"
            )

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------ requests
    def add_request(self, prompt: Sequence[int]) -> Request:
        """Queue a prompt (token ids in ``[0, vocab_size)``); identical calls on every rank.

        With a prefix cache the request starts from its prompt's longest cached prefix of full pages.

        Raises:
            TypeError: a token id is not an int (floats and bools are refused, never truncated).
            ValueError: an empty prompt, an id outside the vocabulary, or more pages than the pool could ever hand
                out (:func:`dtkv.runtime._batch.check_prompt`); nothing is queued.
        """
        self._check_open("add_request")
        alloc = self.allocator
        ids = _batch.check_prompt(
            prompt, vocab_size=self.model_spec.vocab_size, page_size=self.page_size,
            num_pages=alloc.ownership.num_pages - len(alloc.reserved),
        )  # fmt: skip
        req = Request(rid=len(self.requests), prompt=ids)
        if self.prefix_cache is not None:
            _prefix.attach_cached_prefix(self, req)
        self.requests.append(req)
        return req

    def finish_request(self, rid: int) -> None:
        """End request ``rid``: cache its full pages (with a prefix cache) and release its pages (SPMD).

        A finished request is never stepped, decoded or inspected again (those calls refuse it).

        Raises:
            TypeError / ValueError: ``rid`` is not an int naming a live request (:func:`dtkv.runtime._batch.check_rid`).
        """
        req = _batch.check_rid(rid, self.requests)
        _prefix.release_request(self, req)
        self._check_cache()

    def _check_cache(self) -> None:
        if self.prefix_cache is not None and _env.debug_enabled():
            self.prefix_cache.check_agreement(self.group)

    # ------------------------------------------------------------------------------------------ plan
    def _check_step(
        self, reqs: Sequence[Request], extend_lens, *, decode: bool = False, what: str = "step", agreed: bool = False
    ) -> list[int]:
        """The step's input rules and its page budget, on every rank together (nothing changes). ``agreed``: the
        previous step's vote compared the state these inputs follow from (the decode loop), so the rules run
        locally: a function of that state, they give every rank the same verdict with no collective."""
        cache = self.prefix_cache

        def check() -> list[int]:
            self._check_open("decode_step" if decode else what)
            lens = _batch.check_batch(self.requests, reqs, extend_lens, decode=decode)
            _batch.check_capacity(
                reqs, lens, page_size=self.page_size, allocator=self.allocator,
                evictable=cache.num_evictable if cache is not None else None,
            )  # fmt: skip
            return lens

        if agreed:
            return check()
        value = functools.partial(_batch.batch_value, reqs, allocator=self.allocator)
        return _batch.agreed_step(self.group, what="Runtime step", check=check, value=value)

    def _plan(self, reqs: Sequence[Request], lens: list[int]) -> ExtendPlan:
        make_room = functools.partial(_prefix.make_room, self) if self.prefix_cache is not None else None
        return plan_extend(
            reqs, lens, allocator=self.allocator, ownership=self.ownership, cp_size=self.cp, rank=self.rank,
            page_size=self.page_size, split_mode=self.split_mode, mode=self.mode, device=self.device,
            group=self.pool.group, make_room=make_room,
        )  # fmt: skip

    def plan_step(self, reqs: Sequence[Request], extend_lens: Sequence[int]) -> ExtendPlan:
        """Split, allocate pages and build every index the step's run needs (plan phase: host; SPMD).

        The inputs are checked first, on every rank together (:func:`dtkv.runtime._batch.agreed_step`: collective with a
        group); a refused step changes nothing.

        Raises:
            TypeError / ValueError: the batch breaks a rule of :func:`dtkv.runtime._batch.check_batch` (empty, a request
                not of this runtime, finished or repeated, a length not an int in ``[1, tokens not yet computed]``).
            AllocationError: the step's new pages exceed the free pages plus the evictable cached ones.
        """
        lens = self._check_step(reqs, extend_lens, what="plan_step")
        with StepOutcome(self, reqs, what="Runtime.plan_step"):
            plan = self._plan(reqs, lens)
        return plan

    # ------------------------------------------------------------------------------------------ run
    def context(self, plan: ExtendPlan) -> StepContext:
        """The :class:`StepContext` of an extend step's ``plan`` (what :meth:`forward` hands the adapter; for
        driving an adapter's forward, or one of its layers, yourself: e.g. to compile it)."""
        return self._context(plan=plan)

    def _context(self, **step) -> StepContext:
        if step.get("plan") is not None:  # a decode-shaped extend step reads the backend's decode kernel
            step.update(decoding=step["plan"].decoding, schedules=self._schedules)
        return StepContext(pool=self.pool, mode=self.mode, group=self.group, ownership=self.ownership,
                           spec=self.ownership_spec, attention=self.attention, **step)  # fmt: skip

    def _run_model(self, ctx: StepContext) -> torch.Tensor:
        if self.batch_invariant:
            with _BatchInvariant():
                return self.adapter.forward(ctx)
        return self.adapter.forward(ctx)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant:
            with _BatchInvariant():
                return self.adapter.logits(hidden)
        return self.adapter.logits(hidden)

    def forward(self, plan: ExtendPlan, *, prefetch: bool = False, all_logits: bool = False) -> torch.Tensor:
        """The run phase of one extend step (collective): writes every layer's KV and returns logits.

        Tensor work only (no host sync; the reference model's run compiles with fullgraph).

        Args:
            plan: from :meth:`plan_step`.
            prefetch: gather the next layer's history pages while the current layer computes (eager only; results
                are identical).
            all_logits: logits of every token of the step in natural order ``[sum(extend_lens), V]``, instead of
                each request's last token ``[num_reqs, V]``.
        """
        self._check_open("forward")
        ctx = self.context(plan)
        if prefetch and plan.mat_plan is not None:
            ctx.materializer = Materializer(self.pool, plan.mat_plan)
            ctx.materializer.prefetch(0)
        with torch.no_grad():
            hidden = self._run_model(ctx)
            if self.group is not None:
                hidden = gather_padded(hidden, plan.max_local, self.group)
            return self._logits(hidden[plan.restore_rows if all_logits else plan.last_rows])

    def step(
        self,
        reqs: Sequence[Request],
        extend_lens: Sequence[int],
        *,
        prefetch: bool = False,
        all_logits: bool = False,
    ) -> torch.Tensor:
        """Plan and run one extend step; advances each request by its extend length. Returns :meth:`forward`'s
        logits.

        Raises what :meth:`plan_step` raises, with nothing changed. A run that fails on any rank raises on every
        rank (the first failing rank's error type, naming it) and every rank undoes the step
        (:mod:`dtkv.runtime._outcome`): the requests keep the pages and computed tokens they had, and the
        allocator, the prefix cache and ``stats`` are as before.
        """
        lens = self._check_step(reqs, extend_lens)
        return self._run_step(reqs, lens, prefetch=prefetch, all_logits=all_logits)

    def _run_step(self, reqs, lens: list[int], *, prefetch: bool, all_logits: bool = False) -> torch.Tensor:
        with StepOutcome(self, reqs, what="Runtime step") as outcome:  # every rank keeps it, or every rank undoes it
            logits = self._extend(reqs, lens, outcome, prefetch=prefetch, all_logits=all_logits)
        return logits

    def _extend(self, reqs, lens: list[int], outcome: StepOutcome, *, prefetch: bool, all_logits: bool = False):
        """Plan, run and commit one extend step inside its :class:`StepOutcome`."""
        plan = self._plan(reqs, lens)
        outcome.keep_pages()
        logits = self.forward(plan, prefetch=prefetch, all_logits=all_logits)
        self._commit(reqs, lens)
        self.stats["steps"] += 1
        self.stats["direct_rows"] += int(plan.direct_rows.numel())
        self.stats["handoff_rows"] += int(plan.handoff_rows.numel())
        if plan.mat_plan is not None:
            scratch = plan.mat_plan.scratch_pages * self.model_spec.page_bytes * (2 if prefetch else 1)
            self.stats["scratch_bytes"] = max(self.stats["scratch_bytes"], scratch)
        return logits

    def _commit(self, reqs, lens: Sequence[int]) -> None:
        for r, n in zip(reqs, lens):
            r.num_computed += n
        if self.prefix_cache is not None:
            _prefix.cache_computed(self, reqs)
            self._check_cache()

    # ------------------------------------------------------------------------------------------ driver
    def prefill(
        self,
        chunk_size: int,
        *,
        prefetch: bool = True,
        return_logits: bool = False,
        progress: Callable[[int, int], object] | None = None,
    ) -> list[int] | tuple[list[int], list[torch.Tensor]]:
        """Chunked prefill of the live requests not prefilled yet, ``chunk_size`` tokens per request per step.

        Requests whose pages do not fit together queue: each step runs the requests whose remaining prompt pages
        fit beside each other (requests under way first, then in request order:
        :func:`dtkv.runtime._batch.admit_prefill`), and a waiting request joins a later step of this call once its
        pages fit. Requests that still do not fit
        when no other can progress stay queued (not prefilled, no page taken) for a later ``prefill()``, after
        ``finish_request`` made room; so a call makes progress whenever some request can complete.

        ``progress(k, n)`` is called after step ``k`` of ``n`` (``n`` is the estimate before the first step, raised
        to ``k`` where queued requests add steps; e.g. a CLI's progress line).

        Returns:
            The first generated token (greedy) of each request this call finished, in request order, also appended
            to ``request.output``; with ``return_logits``, also each such request's logits over the prompt
            positions this call computed ``[len(prompt) - computed before, V]`` (cached positions have none).

        Raises:
            TypeError / ValueError: ``chunk_size`` is not an int >= 1.
            AllocationError: no waiting request can finish its prompt in the free pages (plus the evictable cached
                ones); nothing was allocated.
        """
        self._check_open("prefill")
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be an int >= 1, got chunk_size={chunk_size!r}")
        todo_all = [r for r in self.requests if not r.finished and r.num_computed < len(r.prompt)]
        logits: dict[int, list[torch.Tensor]] = {r.rid: [] for r in todo_all}
        total = max([cdiv(len(r.prompt) - r.num_computed, chunk_size) for r in todo_all] + [0])
        done, cache = 0, self.prefix_cache
        while waiting := [r for r in self.requests if not r.finished and r.num_computed < len(r.prompt)]:
            todo, why = _batch.admit_prefill(
                waiting, page_size=self.page_size, allocator=self.allocator,
                evictable=cache.num_evictable if cache is not None else None,
            )  # fmt: skip
            if not todo:
                if done:
                    break  # the rest waits for pages: a later prefill()
                raise AllocationError(f"prefill cannot start: {why}")
            lens = [min(chunk_size, len(r.prompt) - r.num_computed) for r in todo]
            out = self.step(todo, lens, prefetch=prefetch, all_logits=return_logits)
            done += 1
            if progress is not None:
                progress(done, max(total, done))
            ends = torch.tensor(lens).cumsum(0) - 1 if return_logits else torch.arange(len(todo))
            for i, r in enumerate(todo):
                end = int(ends[i])
                if return_logits:
                    logits[r.rid].append(out[end - lens[i] + 1 : end + 1])
                if r.num_computed == len(r.prompt) and not r.output:
                    r.output.append(int(out[end].argmax()))
        finished = [r for r in todo_all if r.num_computed == len(r.prompt)]
        first = [r.output[0] for r in finished]
        if return_logits:
            return first, [torch.cat(logits[r.rid]) for r in finished]
        return first

    def decode_step(self, reqs: Sequence[Request]) -> torch.Tensor:
        """Run each request's last generated token through the model in ``decode_mode``: logits ``[len(reqs), V]``.

        Writes the token's KV rows and advances ``num_computed``; the caller appends the next token to ``output``.
        With CUDA graphs (:attr:`graph_mode`) the step runs in its batch bucket (:mod:`dtkv.runtime._graphs`:
        captured at its first use, replayed after), else eagerly; the results are those of the eager step.

        Raises:
            TypeError / ValueError: as :meth:`step` (also a request with no token to decode), nothing changed.
            A run that fails on any rank: as :meth:`step`, on every rank, the step undone everywhere.
        """
        return self._decode_step(reqs)[0]

    def _decode_step(
        self, reqs: Sequence[Request], *, agreed: bool = False, defer: bool = False,
        pending: PendingTokens | None = None,
    ):  # fmt: skip
        """One decode step: ``(logits, outcome)``; with ``defer`` the caller settles the outcome's vote.

        ``pending``: the previous step's tokens, not read by the host yet (their outputs hold placeholders): a
        bucket takes the step's ids from the device and the values are resolved once the replay is launched; the
        eager path resolves them first."""
        lens = self._check_step(reqs, None, decode=True, agreed=agreed)
        graphs = self.graphs
        reason = graphs.reason_for(reqs) if graphs is not None else "cuda_graphs is off"
        ids = pending.ids_for(reqs) if pending is not None and not reason else None
        if pending is not None and ids is None:
            pending.resolve()
        with StepOutcome(self, reqs, what="Runtime decode step", defer=defer) as outcome:
            logits = None
            if graphs is not None and not reason:
                graphs.allocate(reqs)
                outcome.keep_pages()
                logits = graphs.run(reqs, ids)
                if pending is not None:
                    pending.resolve()  # the replay is launched: the GPU runs it while the host waits for these
                if logits is None:
                    reason = graphs.refused
                else:
                    self._commit(reqs, lens)
            if logits is None:
                if graphs is not None:
                    graphs.note_eager(reason)
                if self.decode_mode == "sharded":
                    logits = self._sharded_decode(reqs, outcome)
                else:
                    logits = self._extend(reqs, lens, outcome, prefetch=False)
        return logits, outcome

    def _sharded_decode(self, reqs: Sequence[Request], outcome: StepOutcome) -> torch.Tensor:
        """The eager sharded decode step (plan, run, commit) inside its :class:`StepOutcome`."""
        if self.prefix_cache is not None:
            _prefix.make_room_for_decode(self, reqs)
        plan = plan_sharded_step(
            reqs, allocator=self.allocator, ownership=self.ownership, rank=self.pool.rank,
            page_size=self.page_size, topk=self.model_spec.index_topk, device=self.device,
        )  # fmt: skip
        outcome.keep_pages()
        ids = torch.tensor([r.token(r.num_computed) for r in reqs], dtype=torch.int64, device=self.device)
        sharded = ShardedDecodeAttention(
            pool=self.pool, spec=self.ownership_spec, attention=self.attention.name, stats=self.stats, plan=plan,
            page_tables=[r.pages for r in reqs],
        )  # fmt: skip
        ctx = self._context(sharded=sharded, ids=ids)
        with torch.no_grad():
            hidden = self._run_model(ctx)
            ctx.finish()
            logits = self._logits(hidden)
        self._commit(reqs, [1] * len(reqs))
        self.stats["sharded_decode_steps"] += 1
        return logits

    def decode(self, steps: int, *, return_logits: bool = False, progress: Callable[[int, int], object] | None = None):
        """``steps`` greedy decode steps of every live request that has its first token (one query each).

        ``progress(k, steps)`` is called after step ``k``.

        Requests without a first token (not prefilled yet) are not decoded. With nothing to decode the call is a
        no-op on every rank -- no step, no collective -- and returns the outputs as they are.

        In a CP group the step's vote (:mod:`dtkv.runtime._outcome`) travels while the step runs (its result is
        awaited before the step's tokens are appended), and it stands for the next step's input agreement: without
        ``progress`` the steps after the first of a call run no agreement collective of their own (their inputs
        follow from the voted state, the same on every rank; the input rules still run, with the same verdict
        everywhere). With ``progress`` every step agrees on its inputs first, as :meth:`decode_step` does.

        With CUDA graphs (and no ``progress``) the steps run a step ahead of the host: a step's tokens stay on the
        device as the next step's ids and are read once that step's replay is launched (:mod:`dtkv.runtime._graphs`,
        :class:`~dtkv.runtime._graphs.PendingTokens`), so the host plans step ``t + 1`` while the GPU runs step ``t``.
        The tokens are the same; every output holds its values when the call returns.

        Returns:
            Every request's generated tokens; with ``return_logits``, also per step the logits
            ``[num_decoding, V]`` that chose the next tokens.
        """
        self._check_open("decode")
        check_int("steps", steps, min_value=0)
        step_logits = []
        agreed = False
        # Graph steps run one step ahead of the host (no progress callback to show the tokens to): a step's tokens
        # stay on the device as the next step's ids while the host plans that step (PendingTokens).
        ahead = self.graphs is not None and progress is None
        pending: PendingTokens | None = None
        try:
            for _ in range(steps):
                reqs = [r for r in self.requests if r.output and not r.finished and r.num_computed == r.num_tokens - 1]
                if not reqs:
                    break
                out, outcome = self._decode_step(reqs, agreed=agreed, defer=True, pending=pending)
                try:
                    best = out.argmax(dim=-1)
                    if ahead:
                        step_tokens = PendingTokens(reqs, best)
                    else:
                        tokens = best.tolist()  # one sync for the batch (the vote travels meanwhile)
                finally:
                    outcome.settle()
                step_logits.append(out)
                if ahead:
                    step_tokens.hold()
                    pending = step_tokens
                else:
                    for r, t in zip(reqs, tokens):
                        r.output.append(t)
                agreed = progress is None and self.group is not None
                if progress is not None:
                    progress(len(step_logits), steps)
        finally:
            if pending is not None:
                pending.resolve()
        outputs = [list(r.output) for r in self.requests]
        return (outputs, step_logits) if return_logits else outputs

    # ------------------------------------------------------------------------------------------ inspection
    def kv_bytes(self, rid: int) -> dict[str, torch.Tensor]:
        """The stored bytes of request ``rid``'s computed tokens in token order (collective when sharded).

        Returns:
            name -> uint8 CPU ``[num_layers, num_tokens, token_bytes]`` (fp8 indexer: key bytes then scale bytes).

        Raises:
            TypeError / ValueError: ``rid`` is not an int naming a live request (negative ids never wrap), on every
                rank together.
        """
        rule = f"request {rid} is finished: its pages were released, got rid={rid}"
        r = _batch.agreed_step(
            self.pool.group, what="Runtime.kv_bytes", value=lambda req: [req.rid, req.num_computed, len(req.pages)],
            check=lambda: _batch.check_rid(rid, self.requests, finished_rule=rule),
        )  # fmt: skip
        from dtkv.layouts import IndexerFp8Layout

        ps, n = self.page_size, r.num_computed
        pos = torch.arange(n)
        pg, off = torch.tensor(r.pages, dtype=torch.int64)[pos // ps], pos % ps
        out = {}
        for name, lay in sorted(self.pool.layouts.items()):
            per_layer = []
            for layer in range(self.model_spec.num_layers):
                full = gather_pages(self.pool.local(name, layer), self.ownership, self.pool.group).cpu()
                full = full.contiguous().view(torch.uint8).reshape(full.shape[0], -1)
                if isinstance(lay, IndexerFp8Layout):
                    j = lay.head_dim
                    k = full[:, : ps * j].reshape(-1, ps, j)[pg, off]
                    s = full[:, ps * j :].reshape(-1, ps, 4)[pg, off]
                    per_layer.append(torch.cat((k, s), dim=1))
                else:
                    per_layer.append(full.reshape(full.shape[0], ps, -1)[pg, off])
            out[name] = torch.stack(per_layer)
        return out
