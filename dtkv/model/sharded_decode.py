"""Greedy decode of the reference model straight on its page-sharded pool (``decode_mode="sharded"``).

Every rank runs the dense part of each decode token (embedding, projections, MLP, logits) for the whole batch,
so every rank holds every query; per layer it then

1. writes the token's new KV and indexer rows into its pool, keeping only rows of pages it owns (owner-filtered
   write: the row reaches its owner with no collective, since every rank computed it);
2. runs the layer of a :class:`dtkv.decode.DecodeStep` (the production decode step, eager here, float64 on the
   torch paths): indexer over its own pages (:func:`dtkv.ops.indexer_scores`), global top-k from the all-gathered
   local candidates, attention over the selected rows it owns through the attention seam (:mod:`dtkv.attention`),
   LSE merge of the partials.

No page moves and no full view is built. Only the merged attention output continues, identical on every rank,
so the ranks stay in lockstep. A request that crosses a page boundary gets its next page on the rank holding the
fewest of its pages (:func:`dtkv.decode.alloc_decode_pages`).

Against full-view decode only float64 summation order changes (the split softmax, batched GEMMs): outputs agree
to ~1e-15 relative and tokens are equal; the top-k is the same set in the same order (see :mod:`dtkv.decode.topk`;
``DTKV_DEBUG`` checks every layer of every step against the full view).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from dtkv import _env
from dtkv._util import cdiv
from dtkv.decode import (
    DecodePlan,
    DecodeStep,
    DecodeStepConfig,
    StepInputs,
    alloc_decode_pages,
    check_selection,
    plan_decode,
    sharded_decode_comm_bytes,
)
from dtkv.model.kvio import token_rows

__all__ = ["plan_sharded_step", "sharded_decode_step"]


def plan_sharded_step(engine, reqs: Sequence) -> DecodePlan:
    """Allocate each request's next page if its new token needs one, then plan the step (host; SPMD)."""
    ps = engine.cfg.page_size
    seq_lens = [r.num_computed + 1 for r in reqs]
    needs = [max(0, cdiv(n, ps) - len(r.pages)) for r, n in zip(reqs, seq_lens)]
    for r, new in zip(reqs, alloc_decode_pages(engine.allocator, [r.pages for r in reqs], needs)):
        r.pages.extend(new)
    return plan_decode(
        [r.pages for r in reqs],
        seq_lens,
        engine.ownership,
        engine.pool.rank,
        page_size=ps,
        topk=engine.cfg.index_topk,
        device=engine.device,
    )


def sharded_decode_step(engine, reqs: Sequence) -> torch.Tensor:
    """One greedy decode step of ``reqs`` on ``engine``'s sharded pool: logits float64 ``[len(reqs), V]``."""
    model, cfg = engine.model, engine.cfg
    for r in reqs:
        if r.num_computed >= len(r.tokens):
            raise ValueError(
                f"request {r.rid} has no token to decode (num_computed={r.num_computed}, {len(r.tokens)} tokens): "
                "append the next token to its output first"
            )
    plan = plan_sharded_step(engine, reqs)
    ids = torch.tensor([r.tokens[r.num_computed] for r in reqs], dtype=torch.int64, device=engine.device)
    n = len(reqs)
    h = model.embed_tokens(ids)
    step = _decode_step(engine, reqs)
    for layer in range(cfg.num_layers):
        q = model.project(layer, h, plan.query_pos)
        x = StepInputs(iq=q["iq"], iw=q["iw"], q=torch.cat((q["q_nope"], q["q_rope"]), dim=-1), kv_row=q["kv"],
                       index_k=q["index_k"])  # fmt: skip
        res = step.layer(layer, x)  # writes the new rows (owner filter), selects, attends, merges
        if _env.debug_enabled():
            _check_against_full_view(engine, layer, reqs, plan, q, DecodeStep.positions(res))
        h = model.finish_layer(layer, h, res.out.reshape(n, -1))
    comm = sharded_decode_comm_bytes(
        num_queries=n,
        topk=cfg.index_topk,
        num_heads=cfg.num_heads,
        kv_lora_rank=cfg.kv_lora_rank,
        cp_size=plan.cp_size,
        partial_itemsize=8,
    ).scaled(cfg.num_layers)
    engine.stats["decode_comm_bytes"] += comm.sent
    engine.stats["sharded_decode_steps"] += 1
    for r in reqs:
        r.num_computed += 1
    return model.logits(h)


def _decode_step(engine, reqs: Sequence) -> DecodeStep:
    """A :class:`DecodeStep` sized for exactly this step (eager; the runner's attention backend, the torch indexer:
    float64 on the reference model), its plan set (host)."""
    cfg = engine.cfg
    width = max(len(r.pages) for r in reqs)
    config = DecodeStepConfig(
        mode="sharded", num_heads=cfg.num_heads, topk=cfg.index_topk,
        softmax_scale=1.0 / math.sqrt(cfg.kv_lora_rank + cfg.rope_dim), max_batch=len(reqs), max_pages=width,
        scored_pages=width, attention=engine.attention.name, indexer="torch",
    )  # fmt: skip
    step = DecodeStep(engine.pool, config)
    step.set_plan([r.pages for r in reqs], [r.num_computed + 1 for r in reqs])
    step.exchange.begin_step()
    return step


def _check_against_full_view(engine, layer: int, reqs: Sequence, plan: DecodePlan, q, positions: torch.Tensor) -> None:
    """``DTKV_DEBUG``: the layer's sharded top-k against :meth:`TinyDSA.select` over the full view (collective)."""
    cfg, ps = engine.cfg, engine.cfg.page_size
    index_keys = token_rows(engine.pool.gather_full(layer, "index"), cfg.index_layout)
    reference = torch.full_like(positions, -1)
    for b, r in enumerate(reqs):
        kv_len = int(plan.query_pos[b]) + 1
        pos = torch.arange(kv_len, device=engine.device)
        rows = torch.tensor(r.pages, dtype=torch.int64, device=engine.device)[pos // ps] * ps + pos % ps
        idx, valid = engine.model.select(
            {"iq": q["iq"][b : b + 1], "iw": q["iw"][b : b + 1]}, pos[-1:], index_keys[rows]
        )
        reference[b, : idx.shape[1]] = torch.where(valid[0], idx[0], torch.full_like(idx[0], -1))
    check_selection(positions, reference, engine.pool.group, what=f"layer {layer}")
    engine.stats["topk_checks"] += 1
