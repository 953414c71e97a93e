"""``DSAModelRunner``: chunked CP prefill and greedy decode of a transformers DSA model over dtkv's sharded KV.

==================  ==========================================================================================
mode                what each CP rank stores and how rows get there
==================  ==========================================================================================
``single``          one process (``group`` None or of size 1): the whole pool
``sharded``         page-ownership-sharded pools: each layer's rows are all-gathered and every rank keeps the
                    pages it owns (owner-filtered write); attention reads a materialized full view
``sharded_direct``  sharded pools with compute-owner direct writes (zigzag, page-aligned split): pages are
                    allocated on the rank that computes them and written with no KV all-gather; only the rows
                    of pages a rank does not own (a request's partly filled first page, fallback requests) go
                    through a small all-gather + owner-filtered write
==================  ==========================================================================================

The model runs its own forward (``model.model``: embedding, decoder layers, norms, MoE, rotary embedding) on
this rank's rows, with the attention modules bound to :func:`dtkv.integrations.transformers.dsa_attention`;
the final hidden states are all-gathered and the model's ``lm_head`` gives the logits.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Literal

import torch
import torch.distributed as dist

from dtkv import _batch
from dtkv._checks import check_int
from dtkv._collectives import all_gather_rows, group_rank, group_size
from dtkv._util import cdiv
from dtkv.allocator import PageAllocator
from dtkv.attention import AttentionBackend, AttentionName, AttentionSpec, resolve_attention
from dtkv.integrations.transformers._family import KV_DTYPES, KVDtype, family_of, geometry_of, kv_layouts
from dtkv.integrations.transformers._plan import Request, StepPlan, plan_step
from dtkv.integrations.transformers.attention import AttentionContext, check_unbound, install, uninstall
from dtkv.layouts import IndexerFp8Layout
from dtkv.materialize import Materializer
from dtkv.ownership import PageOwnership
from dtkv.pool import ShardedKVPool, gather_pages

__all__ = ["DSAModelRunner", "KVMode", "num_pages_for"]

KVMode = Literal["single", "sharded", "sharded_direct"]


def num_pages_for(prompt_lens: Sequence[int], *, page_size: int, decode_steps: int = 0, cp_size: int = 1) -> int:
    """Logical pages a pool needs for these prompts plus ``decode_steps`` generated tokens each.

    Every request may waste up to one page to owner-aware allocation, and each owner one more; the count is
    rounded up to a multiple of ``cp_size`` so every rank stores the same number of pages.
    """
    pages = sum(cdiv(n + decode_steps + 1, page_size) + 1 for n in prompt_lens) + cp_size
    return cdiv(pages, cp_size) * cp_size


class DSAModelRunner:
    """Runs a loaded ``DeepseekV32ForCausalLM`` / ``GlmMoeDsaForCausalLM`` with its KV in dtkv pools (SPMD).

    Every rank of ``group`` wraps the same model (same weights) with the same arguments and calls the same
    methods. Construction binds the replacement attention to the model's attention modules (:meth:`close`
    unbinds it); in between, the model still runs its own forward whenever no step is active.

    Args:
        model: the causal LM, on this rank's device, in eval mode, any dtype.
        num_pages: logical KV pages of the pool (:func:`num_pages_for` sizes it).
        group: the CP process group; ``None`` (or a group of one) for a single process.
        page_size: tokens per KV page.
        kv_dtype: stored formats, see :func:`dtkv.integrations.transformers.kv_layouts`: ``"bf16"``,
            ``"fp32"`` or ``"fp8"``.
        split: CP split, ``"zigzag"`` (page-aligned where a request touches >= 2cp pages) or ``"round_robin"``.
        direct_writes: compute-owner direct writes (mode ``sharded_direct``); default: with zigzag. Needs zigzag.
        scheme: ownership scheme of the pool, ``"interleave"`` or ``"block"``.
        attention: the attention backend (:mod:`dtkv.attention`): ``"auto"`` (the fastest available on the model's
            device that fits: torch on a CPU), ``"torch"`` (the expanded form, float32 inside: the parity reference),
            ``"triton"`` or ``"flashmla"`` (the absorbed form: ``q_nope`` through ``kv_b_proj``'s key half into the
            latent, the output through its value half; FlashMLA needs 64 or 128 heads, ``kv_lora_rank`` 512,
            ``qk_rope_head_dim`` 64, ``kv_dtype`` bf16 or fp8 with ``page_size`` 64), or a resolved backend.

    Attributes:
        pool: the :class:`dtkv.ShardedKVPool` (``"kv"`` and ``"index"``, one layer per decoder layer).
        requests: the :class:`Request` objects, in the order they were added.
        stats: ``steps``, ``direct_rows``, ``handoff_rows``, ``scratch_bytes`` (largest materialization scratch).
        attention: the resolved backend (its ``name``, and ``reason`` for the choice).

    Raises:
        TypeError: ``model`` is not a supported DSA causal LM.
        ValueError: bad ``kv_dtype``, ``split``, ``page_size``, ``num_pages``, ``direct_writes`` with round-robin,
            or ``model`` is already wrapped by a runner that was not closed.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        num_pages: int,
        group: dist.ProcessGroup | None = None,
        page_size: int = 64,
        kv_dtype: KVDtype = "bf16",
        split: Literal["zigzag", "round_robin"] = "zigzag",
        direct_writes: bool | None = None,
        scheme: Literal["interleave", "block"] = "interleave",
        attention: AttentionName | AttentionBackend = "auto",
    ) -> None:
        self.family = family_of(model)
        self.geometry = geometry_of(model)
        check_unbound(model)
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got kv_dtype={kv_dtype!r}")
        if split not in ("zigzag", "round_robin"):
            raise ValueError(f"split must be 'zigzag' or 'round_robin', got split={split!r}")
        if direct_writes and split != "zigzag":
            raise ValueError(
                "direct_writes=True needs split='zigzag': round-robin never gives a page one compute owner"
            )
        self.model = model
        self.group = group if group_size(group) > 1 else None
        self.cp_size, self.rank = group_size(self.group), group_rank(self.group)
        if self.group is None:
            self.mode: KVMode = "single"
        else:
            self.mode = (
                "sharded_direct" if (split == "zigzag" if direct_writes is None else direct_writes) else "sharded"
            )
        self.split_mode, self.kv_dtype, self.page_size = split, kv_dtype, page_size
        self.layouts = kv_layouts(self.geometry, kv_dtype, page_size)
        self.device = next(model.parameters()).device
        if isinstance(attention, AttentionBackend):
            self.attention = attention
        else:
            spec = AttentionSpec(
                num_heads=model.config.num_attention_heads, layout=self.layouts["kv"], topk=self.geometry.index_topk
            )
            self.attention = resolve_attention(attention, spec=spec, device=self.device)
        self.ownership = PageOwnership(self.cp_size, num_pages, scheme)
        self.pool = ShardedKVPool(
            self.layouts, self.ownership, num_layers=self.geometry.num_layers, group=self.group, device=self.device
        )
        self.allocator = PageAllocator(self.ownership)
        self.requests: list[Request] = []
        self.stats = {"steps": 0, "direct_rows": 0, "handoff_rows": 0, "scratch_bytes": 0}
        self._masks = {t: None for t in model.config.layer_types}  # the replacement attention needs no mask
        self.ctx = AttentionContext(
            pool=self.pool,
            layouts=self.layouts,
            ownership=self.ownership,
            rank=self.rank,
            group=self.group,
            mode=self.mode,
            family=self.family,
            geometry=self.geometry,
            attention=self.attention,
        )
        install(model, self.ctx)

    def close(self) -> None:
        """Unbind the replacement attention (the model is then exactly as loaded)."""
        uninstall(self.model)

    def __enter__(self) -> DSAModelRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------ requests
    def add_request(self, prompt: Sequence[int]) -> Request:
        """Queue a prompt (token ids in ``[0, vocab_size)``); identical calls on every rank.

        Raises:
            TypeError: a token id is not an int (floats and bools are refused, never truncated).
            ValueError: an empty prompt, an id outside the vocabulary, or more pages than the pool could ever hand
                out (:func:`dtkv._batch.check_prompt`); nothing is queued.
        """
        alloc = self.allocator
        ids = _batch.check_prompt(
            prompt,
            vocab_size=self.geometry.vocab_size,
            page_size=self.page_size,
            num_pages=alloc.ownership.num_pages - len(alloc.reserved),
        )
        req = Request(rid=len(self.requests), prompt=ids)
        self.requests.append(req)
        return req

    def free_request(self, rid: int) -> None:
        """Return request ``rid``'s pages to the allocator and end it: its KV is gone, and the request is never
        stepped, prefilled, decoded or inspected again (those calls refuse or skip it).

        Raises:
            TypeError / ValueError: ``rid`` is not an int naming a live request (:func:`dtkv._batch.check_rid`).
        """
        req = _batch.check_rid(rid, self.requests)
        self.allocator.free(req.pages)
        req.pages, req.num_computed, req.finished = [], 0, True

    # ------------------------------------------------------------------------------------------ plan / run
    def plan_step(self, reqs: Sequence[Request], extend_lens: Sequence[int]) -> StepPlan:
        """Split, allocate and index one step of ``reqs`` (host, plan phase; same on every rank).

        The inputs are checked first, on every rank together (:func:`dtkv._batch.agreed_step`: collective with a
        group); a refused step changes nothing.

        Raises:
            TypeError / ValueError: the batch breaks a rule of :func:`dtkv._batch.check_batch` (empty, a request
                not of this runner, finished or repeated, a length not an int in ``[1, tokens not yet computed]``).
            AllocationError: the step's new pages exceed the free pages.
        """
        lens = self._check_step(reqs, extend_lens)
        with _batch.undo_new_pages(self.allocator, reqs):
            return self._plan(reqs, lens)

    def _check_step(self, reqs: Sequence[Request], extend_lens: Sequence[int] | None, *, decode: bool = False):
        """The step's input rules and its page budget, on every rank together (nothing changes)."""

        def check() -> list[int]:
            lens = _batch.check_batch(self.requests, reqs, extend_lens, decode=decode)
            _batch.check_capacity(reqs, lens, page_size=self.page_size, allocator=self.allocator)
            return lens

        value = functools.partial(_batch.batch_value, reqs)
        return _batch.agreed_step(self.group, what="DSAModelRunner step", check=check, value=value)

    def _plan(self, reqs: Sequence[Request], lens: list[int]) -> StepPlan:
        return plan_step(
            reqs, lens, allocator=self.allocator, ownership=self.ownership, rank=self.rank,
            page_size=self.page_size, split_mode=self.split_mode, mode=self.mode, device=self.device, group=self.group,
        )  # fmt: skip

    @torch.no_grad()
    def forward(self, plan: StepPlan, *, prefetch: bool = False, all_logits: bool = False) -> torch.Tensor:
        """Run one step (collective): writes every layer's KV and returns logits (model dtype).

        Args:
            plan: from :meth:`plan_step`.
            prefetch: gather the next layer's history pages while the current layer computes (eager only).
            all_logits: logits of every token of the step in natural order ``[sum(extend_lens), V]``, instead
                of each request's last token ``[num_reqs, V]``.
        """
        ctx = self.ctx
        ctx.plan = plan
        try:
            if prefetch and plan.mat_plan is not None:
                ctx.materializer = Materializer(self.pool, plan.mat_plan)
                ctx.materializer.prefetch(0)
            out = self.model.model(
                input_ids=plan.ids[None], position_ids=plan.positions[None], attention_mask=self._masks, use_cache=False
            )
            hidden = out.last_hidden_state[0]
            if self.group is not None:
                padded = hidden.new_zeros((plan.max_local, hidden.shape[1]))
                padded[: hidden.shape[0]] = hidden
                hidden = all_gather_rows(padded, self.group)
            return self.model.lm_head(hidden[plan.restore_rows if all_logits else plan.last_rows])
        finally:
            ctx.plan = None
            ctx.materializer = None

    def step(
        self, reqs: Sequence[Request], extend_lens: Sequence[int], *, prefetch: bool = False, all_logits: bool = False
    ) -> torch.Tensor:
        """Plan and run one step; advances each request by its extend length. Returns :meth:`forward`'s logits.

        Raises what :meth:`plan_step` raises, with nothing changed. A run that fails gives the step's new pages
        back (the requests keep the pages and computed tokens they had).
        """
        return self._run_step(reqs, self._check_step(reqs, extend_lens), prefetch=prefetch, all_logits=all_logits)

    def _run_step(self, reqs: Sequence[Request], lens: list[int], *, prefetch: bool, all_logits: bool) -> torch.Tensor:
        with _batch.undo_new_pages(self.allocator, reqs):
            plan = self._plan(reqs, lens)
            logits = self.forward(plan, prefetch=prefetch, all_logits=all_logits)
        for r, n in zip(reqs, lens):
            r.num_computed += n
        self.stats["steps"] += 1
        self.stats["direct_rows"] += int(plan.direct_rows.numel())
        self.stats["handoff_rows"] += int(plan.handoff_rows.numel())
        if plan.mat_plan is not None:
            per_page = sum(lay.page_bytes for lay in self.layouts.values())
            scratch = plan.mat_plan.scratch_pages * per_page * (2 if prefetch else 1)
            self.stats["scratch_bytes"] = max(self.stats["scratch_bytes"], scratch)
        return logits

    def prefill(
        self, chunk_size: int, *, prefetch: bool = True, return_logits: bool = False
    ) -> list[int] | tuple[list[int], list[torch.Tensor]]:
        """Chunked prefill of every queued request, ``chunk_size`` tokens per request per step.

        Returns:
            Each request's first generated token (greedy), also appended to ``request.output``; with
            ``return_logits``, also each request's logits over its prompt, ``[len(prompt), V]`` float32.
        """
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be an int >= 1, got chunk_size={chunk_size!r}")
        todo_all = [r for r in self.requests if not r.finished and r.num_computed < len(r.prompt)]
        logits: dict[int, list[torch.Tensor]] = {r.rid: [] for r in todo_all}
        while todo := [r for r in self.requests if not r.finished and r.num_computed < len(r.prompt)]:
            lens = [min(chunk_size, len(r.prompt) - r.num_computed) for r in todo]
            out = self.step(todo, lens, prefetch=prefetch, all_logits=return_logits).float()
            rows = torch.tensor(lens).cumsum(0) - 1 if return_logits else torch.arange(len(todo))
            for i, r in enumerate(todo):
                if return_logits:
                    logits[r.rid].append(out[int(rows[i]) - lens[i] + 1 : int(rows[i]) + 1])
                if r.num_computed == len(r.prompt) and not r.output:
                    r.output.append(int(out[int(rows[i])].argmax()))
        first = [r.output[0] for r in todo_all]
        if return_logits:
            return first, [torch.cat(logits[r.rid]) for r in todo_all]
        return first

    def decode(self, steps: int, *, return_logits: bool = False):
        """``steps`` greedy decode steps of every request that has a first token (one query each).

        Returns:
            Every request's generated tokens; with ``return_logits``, also per step the logits
            ``[num_decoding, V]`` float32 that chose the next tokens.
        """
        check_int("steps", steps, min_value=0)
        step_logits = []
        for _ in range(steps):
            reqs = [r for r in self.requests if not r.finished and r.output and r.num_computed == len(r.tokens) - 1]
            if not reqs:
                break
            out = self.decode_step(reqs).float()
            step_logits.append(out)
            for r, row in zip(reqs, out):
                r.output.append(int(row.argmax()))
        outputs = [list(r.output) for r in self.requests]
        return (outputs, step_logits) if return_logits else outputs

    def decode_step(self, reqs: Sequence[Request]) -> torch.Tensor:
        """Run each request's next token (its last generated one) through the model: logits ``[len(reqs), V]``.

        Writes the token's KV and advances ``num_computed``; the caller appends the next token to ``output``.
        Raises what :meth:`plan_step` raises (every request decodes one token), with nothing changed.
        """
        return self._run_step(reqs, self._check_step(reqs, None, decode=True), prefetch=False, all_logits=False)

    # ------------------------------------------------------------------------------------------ inspection
    def kv_bytes(self, rid: int) -> dict[str, torch.Tensor]:
        """The stored bytes of request ``rid``'s computed tokens in token order (collective when sharded).

        Returns:
            name -> uint8 CPU ``[num_layers, num_tokens, token_bytes]`` (fp8 indexer: key bytes then scale bytes).

        Raises:
            TypeError / ValueError: ``rid`` is not an int naming a live request (negative ids never wrap).
        """
        rule = f"request {rid} is finished: its pages were released, got rid={rid}"
        r = _batch.agreed_step(
            self.group, what="DSAModelRunner.kv_bytes", value=lambda req: req.rid,
            check=lambda: _batch.check_rid(rid, self.requests, finished_rule=rule),
        )  # fmt: skip
        ps, n = self.page_size, r.num_computed
        pos = torch.arange(n)
        pg, off = torch.tensor(r.pages, dtype=torch.int64)[pos // ps], pos % ps
        out = {}
        for name, lay in sorted(self.layouts.items()):
            per_layer = []
            for layer in range(self.geometry.num_layers):
                full = gather_pages(self.pool.local(name, layer), self.ownership, self.group).cpu()
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
