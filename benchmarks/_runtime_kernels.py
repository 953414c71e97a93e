"""The shapes of a runtime case through the kernels alone (``kernel_ms_per_layer`` of ``bench_runtime.py``).

**Prefill** (:func:`prefill_kernels`): after the runtime prefilled a request, every chunk of that prompt again,
layer 0's pages, one call per piece, timed alone (a warm-up call, then the median of ``reps``; on a GPU CUDA events
behind a spin kernel that hides the host's launches, as ``bench_flashmla.py`` times the device):

- ``write``: the chunk's latent rows and indexer keys stored (:func:`dtkv.ops.quantize_write_mla_fp8` and
  :func:`dtkv.ops.quantize_write_indexer_fp8` for fp8 pages, :func:`dtkv.ops.write_owned` for bf16 rows), no host
  validation (what the op's kernel costs);
- ``indexer`` (models whose indexer is dtkv's: the transformers adapter): :func:`dtkv.ops.quantize_indexer_queries`
  and :func:`dtkv.ops.indexer_logits` (float32 logits) of every query over its request's keys up to its position, in
  blocks of queries whose ``[B, K]`` logits stay within 2 GiB (as the adapter bounds them);
- ``topk``: :func:`dtkv.ops.logits_topk` of those logits (``index_topk``, the queries' column ranges), the kept
  keys' token slots;
- ``indices``: the backend's :meth:`~dtkv.attention.AttentionBackend.indices` (``dtkv::sparse_indices``);
- ``attention``: FlashMLA called directly on those indices (``flash_mla_with_kvcache`` over fp8 pages as one
  sequence of the chunk's queries, ``flash_mla_sparse_fwd`` over bf16 latent pages: the calls the seam makes), or
  the backend's ``prefill`` for the other backends (and when the direct call fails: ``note`` says why).

The reference model's indexer is the model's own float64 math, so its kernel time has no ``indexer`` and ``topk``
(its attention reads a causal random selection of ``index_topk`` keys per query). At ``cp > 1`` each rank times its
share (every ``cp``-th query of a chunk) over the layer's full pages (gathered once). Returns the pieces summed over
the chunks, per layer (the whole prompt's prefill of one layer).

**Decode** (:func:`decode_kernels`): a :class:`dtkv.decode.DecodeStep` over the runtime's own pool and requests
(its pages and lengths), in the mode that matches (``full`` -> ``full_view``, ``sharded`` -> ``sharded``; a
replicated pool -> ``replicated``), inputs from :func:`bench_decode.fill_inputs`, captured as one CUDA graph and
replayed on a GPU (eager on a CPU): what ``bench_decode.py`` times, per layer.
"""

from __future__ import annotations

import math
import statistics

import bench_decode
import torch
from bench_indexer_logits import timed

from dtkv import IndexerFp8Layout, MLAFp8Layout, PageOwnership, ops

__all__ = ["decode_kernels", "prefill_kernels"]

KEYS_BLOCK_BYTES = 1 << 31
"""Largest ``[B, K]`` float32 block of logits per indexer call (the transformers adapter's bound)."""


def _slots(pages: torch.Tensor, pos: torch.Tensor, page_size: int) -> torch.Tensor:
    """Token slots of positions ``pos`` of a request whose logical pages are ``pages`` (full-pool order)."""
    return pages[pos // page_size] * page_size + pos % page_size


def _device_ms(fn, dev: torch.device, reps: int):
    """``(ms, result)``: the median device time of ``reps`` calls of ``fn`` after a warm-up call. On a GPU each call
    is timed behind a spin kernel (``bench_flashmla``'s ``hide_host``), so the host's launches overlap it and the
    events time the kernels alone; on a CPU, wall time."""
    if dev.type != "cuda":
        ms, _, out = timed(fn, dev, reps)
        return ms, out
    import bench_flashmla

    out = fn()
    torch.cuda.synchronize(dev)
    return statistics.median(bench_flashmla._paired([fn], reps, hide_host=True)[0]), out


def _row_dim(layout) -> int:
    """Dims of a row the layout stores (an fp8 indexer key: ``head_dim``)."""
    return layout.head_dim if isinstance(layout, IndexerFp8Layout) else layout.kv_lora_rank + layout.rope_dim


def _write(pool: torch.Tensor, layout, rows: torch.Tensor, locs: torch.Tensor, spec) -> None:
    if isinstance(layout, MLAFp8Layout):
        ops.quantize_write_mla_fp8(pool, rows, locs, spec, 0, layout=layout, validate=False)
    elif isinstance(layout, IndexerFp8Layout):
        ops.quantize_write_indexer_fp8(pool, rows, locs, spec, 0, layout=layout, validate=False)
    else:
        ops.write_owned(pool, rows.to(layout.dtype), locs, spec, 0, validate=False)


class _Attention:
    """FlashMLA called directly (as the seam calls it), else the backend's ``prefill``."""

    def __init__(self, backend) -> None:
        self.backend, self.note, self.fm = backend, "", None
        if backend.name == "flashmla":
            try:
                import flash_mla

                self.fm = flash_mla
            except Exception as e:  # noqa: BLE001 - reported, the seam's call is timed instead
                self.note = f"FlashMLA direct: {type(e).__name__}: {e}"[:200] + "; timed through the seam"

    def __call__(self, q, kv, idx, scale: float):
        if self.fm is not None:
            try:
                return self._direct(q, kv, idx, scale)
            except Exception as e:  # noqa: BLE001 - reported, the seam's call is timed instead
                self.fm, self.note = None, f"FlashMLA direct: {type(e).__name__}: {e}"[:200] + "; through the seam"
        return self.backend.prefill(q, kv, idx, softmax_scale=scale)

    def _direct(self, q, kv, idx, scale: float):
        n, h, c = q.shape
        r, w = self.backend.spec.kv_lora_rank, idx.shape[1]
        if self.backend.spec.fp8:
            meta = self.fm.get_mla_metadata()[0]  # per call, as the seam's prefill (no schedule) takes it
            return self.fm.flash_mla_with_kvcache(q.view(1, n, h, c), kv.unsqueeze(2), None, None, r, meta,
                                                  softmax_scale=scale, is_fp8_kvcache=True,
                                                  indices=idx.view(1, n, w), use_legacy=True)  # fmt: skip
        return self.fm.flash_mla_sparse_fwd(q, kv.reshape(-1, 1, c), idx.view(n, 1, w), scale, d_v=r, use_legacy=True)


def prefill_kernels(runtime, req, chunk: int, *, indexer_heads: int | None, reps: int = 2, seed: int = 0) -> dict:
    """The pieces of a ``chunk``-token chunked prefill of ``req``'s prompt through the kernels alone, ms per layer
    (module docstring); ``indexer_heads=None``: the model's indexer is its own (no ``indexer`` / ``topk``)."""
    spec, dev, cp, rank = runtime.model_spec, runtime.device, runtime.cp, runtime.rank
    lay_kv, lay_ix, ps = spec.layouts["kv"], spec.layouts["index"], runtime.page_size
    full = runtime.pool.gather_full(0)  # collective at cp > 1: every rank's pages, logical order
    kv, ix = full["kv"], full["index"]
    own = ops.ownership_spec(PageOwnership(1, kv.shape[0]))
    g = torch.Generator(device=dev).manual_seed(seed)
    pages = torch.tensor(req.pages, dtype=torch.int64, device=dev)
    heads, c = spec.num_heads, spec.kv_lora_rank + spec.rope_dim
    k, scale = spec.index_topk, 1.0 / math.sqrt(c)
    attend = _Attention(runtime.attention)
    qdt = runtime.attention.cast_queries(torch.zeros(1)).dtype
    parts = dict.fromkeys(("write", "indexer", "topk", "indices", "attention"), 0.0)
    if indexer_heads is None:
        del parts["indexer"], parts["topk"]
    total = len(req.prompt)
    for s in range(0, total, chunk):
        pos = torch.arange(s + rank, min(total, s + chunk), cp, device=dev)
        n = pos.numel()
        if n == 0:
            continue
        locs = _slots(pages, pos, ps)
        rows = torch.randn(n, c, generator=g, device=dev)
        keys = torch.randn(n, _row_dim(lay_ix), generator=g, device=dev)

        def write(rows=rows, keys=keys, locs=locs):
            _write(kv, lay_kv, rows, locs, own)
            _write(ix, lay_ix, keys, locs, own)

        parts["write"] += _device_ms(write, dev, reps)[0]
        key_slots = _slots(pages, torch.arange(min(total, s + chunk), device=dev), ps)  # the keys it may see
        if indexer_heads is not None:
            slots = _indexer_parts(parts, ix, lay_ix, key_slots, pos, indexer_heads, k, g, reps)
        else:  # a causal random selection of k keys per query
            r = torch.rand(n, k, generator=g, device=dev)
            slots = key_slots[torch.minimum((r * (pos[:, None] + 1)).long(), pos[:, None])]
        ms, idx = _device_ms(lambda slots=slots: runtime.attention.indices(slots, kv), dev, reps)
        parts["indices"] += ms
        q = (torch.randn(n, heads, c, generator=g, device=dev) / 8).to(qdt)
        parts["attention"] += _device_ms(lambda q=q, idx=idx: attend(q, kv, idx, scale), dev, reps)[0]
    out = {name: round(ms, 4) for name, ms in parts.items()}
    return {"parts_ms": out, "ms_per_layer": round(sum(parts.values()), 4), "note": attend.note}


def _indexer_parts(parts, ix, lay_ix, key_slots, pos, heads, k, g, reps) -> torch.Tensor:
    """Time the indexer and the top-k (with the token slots of the keys kept) of one chunk's queries, in blocks as
    the adapter's; returns those slots ``[n, k]`` (``-1`` padded)."""
    from dtkv.decode import selection_keys

    dev, n, dim = pos.device, pos.numel(), _row_dim(lay_ix)
    backend = "triton" if (dev.type == "cuda" and ops.HAS_TRITON) else "torch"
    start, end, cols = torch.zeros_like(pos), pos + 1, torch.arange(key_slots.numel(), device=dev)
    fp8 = isinstance(lay_ix, IndexerFp8Layout)
    block = max(1, KEYS_BLOCK_BYTES // max(1, (4 if fp8 else 8) * key_slots.numel()))
    out = []
    for b0 in range(0, n, block):
        b1 = min(n, b0 + block)
        q = torch.randn(b1 - b0, heads, dim, generator=g, device=dev)
        w = torch.rand(b1 - b0, heads, generator=g, device=dev)

        def score(q=q, w=w, b0=b0, b1=b1):
            if fp8:  # DeepSeek-V3.2's fp8 indexer
                q8, w8 = ops.quantize_indexer_queries(q, w, scale=dim**-0.5, backend=backend)
                return ops.indexer_logits(q8, w8, ix, key_slots, start[b0:b1], end[b0:b1], layout=lay_ix,
                                          backend=backend)  # fmt: skip
            keys_KJ = ix.reshape(-1, dim)[key_slots].float()  # bf16 / fp32 index rows: the exact formula
            logits = torch.matmul(w[:, None, :], torch.matmul(q, keys_KJ.t()).relu_())[:, 0]
            return selection_keys(logits, cols.expand_as(logits), cols[None, :] <= pos[b0:b1, None])

        ms, scores = _device_ms(score, dev, reps)
        parts["indexer"] += ms

        def select(scores=scores, b0=b0, b1=b1):
            if fp8:
                return ops.logits_topk(scores, k, key_start=start[b0:b1], key_end=end[b0:b1], key_slots=key_slots,
                                       backend=backend)  # fmt: skip
            top, valid = ops.indexer_topk(scores, k)
            return torch.where(valid, key_slots[top.clamp(min=0)], torch.full_like(top, -1))

        ms, slots = _device_ms(select, dev, reps)
        parts["topk"] += ms
        out.append(slots)
        del scores
    return torch.cat(out)


def decode_kernels(runtime, reqs, *, index_heads: int, graph: bool, reps: int = 5) -> dict:
    """One decode step of ``reqs`` through :class:`dtkv.decode.DecodeStep` over the runtime's pool (module
    docstring): ``ms_per_layer`` and ``how`` (``"graph"`` or ``"eager"``)."""
    from dtkv.decode import DecodeStep, DecodeStepConfig

    spec, dev = runtime.model_spec, runtime.device
    mode = (
        "replicated" if runtime.mode == "replicated" else "sharded" if runtime.decode_mode == "sharded" else "full_view"
    )
    tables = [list(r.pages) for r in reqs]
    width = max(len(t) for t in tables)
    cfg = DecodeStepConfig(mode=mode, num_heads=spec.num_heads, topk=spec.index_topk,
                           softmax_scale=1.0 / math.sqrt(spec.kv_lora_rank + spec.rope_dim), max_batch=len(reqs),
                           max_pages=width, num_layers=spec.num_layers, attention=runtime.attention.name)  # fmt: skip
    step = DecodeStep(runtime.pool, cfg)
    step.set_plan(tables, [r.num_computed for r in reqs])
    step.alloc_inputs(dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32, index_heads=index_heads)
    bench_decode.fill_inputs(step, 99)
    use_graph = graph and dev.type == "cuda"
    if use_graph:
        step.capture()
    ms = timed(step.replay if use_graph else step.run, dev, reps)[0]
    del step
    return {"ms_per_layer": round(ms / spec.num_layers, 5), "how": "graph" if use_graph else "eager", "mode": mode}
