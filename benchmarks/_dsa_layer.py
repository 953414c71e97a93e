"""A stack of DSA layers at DeepSeek-V3.2 dimensions over dtkv pools, for ``bench_prefill.py``.

One CP prefill step of one request (``C`` tokens after a prefix of ``P`` tokens, ``cp`` ranks, zigzag split): each
rank runs its ``n ~ C / cp`` tokens through ``L`` layers of

1. the projections, bf16 GEMMs: ``x [n, 7168] @ [7168, 1536 + 576 + 128 + 64]`` (q down-projection, the MLA
   row, the indexer key, the indexer head weights), then ``q_a @ [1536, 128 * 192 + 64 * 128]`` (queries and
   indexer queries), the absorbed ``q_nope @ W_UK`` per head;
2. the KV write: the chunk's rows (MLA 576 + indexer 128, bf16) all-gathered, then the fused fp8 quantize-writes
   (``dtkv.ops.quantize_write_mla_fp8`` / ``quantize_write_indexer_fp8``) -- every row in ``replicated`` mode,
   the owned rows in the sharded modes;
3. the indexer over the whole index-K the request has (``P + C`` keys, causal), then ``torch.topk`` (2048);
4. sparse MLA attention over the selected rows through :mod:`dtkv.attention` (FlashMLA by default on an H200: its
   fp8 sparse kernel reads the pool or the view in place; or Triton, torch, or the labelled same-FLOP stand-in),
   ``@ W_UV``, ``@ W_O``;
5. an FFN with the FLOPs of DeepSeek-V3's active experts (8 routed + 1 shared, 2048 wide: one 18432-wide SwiGLU).

KV modes: ``replicated`` (every rank stores the whole pool and reads it directly: today's engines), and the sharded
modes (each page once, on its owner; the indexer and attention read a :class:`dtkv.materialize.Materializer` view;
the step's rows are written into the view as well (``write_current=True``), so nothing is gathered after the
writes). ``sharded_prefetch`` gathers layer ``l + 1``'s view while layer ``l`` computes, on its own stream;
``sharded`` gathers each view when it is needed. Every mode turns the indexer's top-k key positions into cache
slots through a page map (the pool's page table in ``replicated`` mode -- engines do this because a request's pages
are not in logical order -- the view's page map in the sharded modes): :func:`dtkv.ops.remap` for the stand-in,
the attention backend's :meth:`~dtkv.attention.AttentionBackend.indices` (remap, bound and pad in one launch)
otherwise, so the modes differ only in where the KV is read from.

One :class:`Runner` per mode keeps its pool and (sharded) one Materializer for the whole context:
:meth:`Runner.prepare` sizes the views for the largest step, and each step's :meth:`Runner.plan` replans it.
Planning is host work with no host-device synchronization (index tensors reach the device from pinned memory), so
the host plans step ``s + 1`` while the device runs step ``s``.

Not modelled (identical in every mode): RMSNorms inside attention, rotary embedding, the MoE router.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _dsa_kernels as K  # noqa: E402

from dtkv import IndexerFp8Layout, MLAFp8Layout, PageOwnership, ShardedKVPool, ops  # noqa: E402
from dtkv._collectives import all_gather_into  # noqa: E402
from dtkv.attention import AttentionSpec, resolve_attention  # noqa: E402
from dtkv.materialize import Materializer, plan_materialize  # noqa: E402
from dtkv.split import plan_cp_split  # noqa: E402

MODES = ("replicated", "sharded_prefetch", "sharded")
ATTENTION = ("flashmla", "triton", "torch", "standin")
"""Attention of the layers: a :mod:`dtkv.attention` backend, or the same-FLOP stand-in (two dense GEMMs)."""


@dataclass(frozen=True, kw_only=True)
class Dims:
    """Model dimensions (defaults: DeepSeek-V3.2)."""

    hidden: int = 7168
    heads: int = 128
    q_lora: int = 1536
    kv_lora: int = 512
    rope: int = 64
    qk_nope: int = 128
    v_head: int = 128
    index_heads: int = 64
    index_dim: int = 128
    top_k: int = 2048
    page_size: int = 64
    quant_block: int = 128
    ffn_inter: int = 9 * 2048

    @property
    def kv_layout(self) -> MLAFp8Layout:
        return MLAFp8Layout(page_size=self.page_size, kv_lora_rank=self.kv_lora, rope_dim=self.rope,
                            quant_block=self.quant_block)  # fmt: skip

    @property
    def index_layout(self) -> IndexerFp8Layout:
        return IndexerFp8Layout(page_size=self.page_size, head_dim=self.index_dim)

    @property
    def attention_spec(self) -> AttentionSpec:
        return AttentionSpec(num_heads=self.heads, layout=self.kv_layout, topk=self.top_k)

    @property
    def row_dim(self) -> int:
        """Width of the bf16 rows all-gathered per token: the MLA row, then the indexer key."""
        return self.kv_lora + self.rope + self.index_dim


TINY = Dims(hidden=64, heads=4, q_lora=32, kv_lora=64, rope=16, qk_nope=16, v_head=16, index_heads=2, index_dim=32,
            top_k=16, page_size=4, quant_block=32, ffn_inter=96)  # fmt: skip


class Weights:
    """One set of layer weights, shared by every layer (they are far larger than any cache: sharing changes nothing
    measured), drawn from a seeded generator on the device so that every rank and mode holds the same values."""

    def __init__(self, d: Dims, device: torch.device, dtype: torch.dtype, seed: int = 0) -> None:
        g = torch.Generator(device=device).manual_seed(seed)

        def w(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=g, device=device, dtype=torch.float32) / math.sqrt(shape[-2])).to(
                dtype
            )

        self.a = w(d.hidden, d.q_lora + d.kv_lora + d.rope + d.index_dim + d.index_heads)
        self.qb = w(d.q_lora, d.heads * (d.qk_nope + d.rope) + d.index_heads * d.index_dim)
        self.uk = w(d.heads, d.qk_nope, d.kv_lora)
        self.uv = w(d.heads, d.kv_lora, d.v_head)
        self.o = w(d.heads * d.v_head, d.hidden)
        self.gate_up = w(d.hidden, 2 * d.ffn_inter)
        self.down = w(d.ffn_inter, d.hidden)


def template_pages(d: Dims, device: torch.device, num: int = 64, seed: int = 1) -> dict[str, torch.Tensor]:
    """``num`` valid pages of each layout (quantized random rows): history is filled from these, by logical page."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(num * d.page_size, d.kv_lora + d.rope, generator=g)
    ik = torch.randn(num * d.page_size, d.index_dim, generator=g)
    kv_pages = ops.quantize_mla_fp8(kv, d.kv_layout).view(num, d.page_size, -1)
    q, s = ops.quantize_indexer_fp8(ik)
    ps, hd = d.page_size, d.index_dim
    idx_pages = torch.cat((q.view(num, ps * hd), s.view(torch.uint8).view(num, ps * 4)), dim=1)
    return {"kv": kv_pages.to(device), "index": idx_pages.to(device)}


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` with no host-device synchronization (pinned memory, non-blocking copy)."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


@dataclass
class ChunkPlan:
    """Host-built indices of one step on one rank."""

    prefix: int
    kv_len: int
    positions: torch.Tensor  # int64 [n] absolute positions of the local tokens
    max_local: int
    locs_gathered: torch.Tensor  # int64 [cp * max_local] token location of each gathered row (-1 padding)
    page_table: torch.Tensor  # int32 [ceil(kv_len / S)] page of each logical page, in the pool or the view
    page_map: torch.Tensor  # int32 [num_pages] logical page -> page of the KV read (pool or view): top-k -> slots
    view_locs_gathered: torch.Tensor | None  # int64 gathered rows' locations in the view (sharded)


class Runner:
    """One KV mode on one rank: its pool and its step (plan on the host, run on the device)."""

    def __init__(self, mode: str, d: Dims, w: Weights, *, num_layers: int, num_pages: int, group, device,
                 attention: str, indexer_config, backend: str = "auto", history_group=None) -> None:  # fmt: skip
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got mode={mode!r}")
        self.mode, self.d, self.w, self.dev = mode, d, w, device
        self.num_layers, self.group, self.backend = num_layers, group, backend
        self.history_group = history_group
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.sharded = mode != "replicated"
        self.own = PageOwnership(self.cp if self.sharded else 1, num_pages, "interleave")
        # writes into a view address it as a one-rank pool; a fixed page count keeps the write kernels' compile-time
        # constants fixed across steps (rows past the view's pages are skipped by the kernels' range mask)
        self.view_own = PageOwnership(1, num_pages + self.cp, "interleave")
        lays = {"kv": d.kv_layout, "index": d.index_layout}
        self.pool = ShardedKVPool(lays, self.own, num_layers=num_layers, group=group if self.sharded else None,
                                  device=device)  # fmt: skip
        if attention not in ATTENTION:
            raise ValueError(f"attention must be one of {ATTENTION}, got attention={attention!r}")
        self.attention, self.indexer_config = attention, indexer_config
        self.backend_attn = None if attention == "standin" else resolve_attention(attention, spec=d.attention_spec,
                                                                                   device=device)  # fmt: skip
        self.pool_map = torch.arange(num_pages, dtype=torch.int32, device=device)  # the request's pages, in order
        self.mat: Materializer | None = None
        self.stats = {"exposed_ms": [], "gathered_bytes": 0, "scratch_bytes": 0}
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def fill_history(self, templates: dict[str, torch.Tensor]) -> None:
        """Every page of every layer from the templates, by logical page (identical bytes in every mode)."""
        logical = self.own.local_pages(self.pool.rank, device=self.dev)
        for name, t in templates.items():
            pages = t.index_select(0, logical % t.shape[0])
            for layer in range(self.num_layers):
                self.pool.local(name, layer).copy_(pages)

    # -------------------------------------------------------------------------------------- plan
    def _materialize_plan(self, prefix: int, chunk: int):
        ps = self.d.page_size
        kv_pages = torch.arange(-(-(prefix + chunk) // ps))
        history, current = kv_pages[: prefix // ps], kv_pages[prefix // ps :]
        return plan_materialize(history, current, self.own, self.rank, device=self.dev, group=self.group,
                                write_current=True)  # fmt: skip

    def prepare(self, prefix: int, chunk: int) -> None:
        """Sharded modes: the Materializer, its views sized for the step at ``prefix`` (the largest one timed)."""
        if self.sharded:
            mp = self._materialize_plan(prefix, chunk)
            self.mat = Materializer(self.pool, mp, backend=self.backend, history_group=self.history_group,
                                    max_view_pages=mp.num_view_pages)  # fmt: skip
            self.stats["scratch_bytes"] = self.mat.scratch_bytes()

    def plan(self, prefix: int, chunk: int) -> ChunkPlan:
        """One step's indices (host work; no host-device synchronization)."""
        d, ps, dev = self.d, self.d.page_size, self.dev
        split = plan_cp_split([prefix], [chunk], cp_size=self.cp, page_size=ps, mode="zigzag")
        loc = split.local(self.rank)
        gi = split.gather_index.cpu()
        kv_len = prefix + chunk
        # the request's pages were allocated in order: logical page p holds tokens [p*S, (p+1)*S)
        locs_gathered = torch.where(gi >= 0, prefix + gi, torch.full_like(gi, -1))
        kv_pages = torch.arange(-(-kv_len // ps), dtype=torch.int32)
        plan = ChunkPlan(prefix=prefix, kv_len=kv_len, positions=to_device(loc.positions, dev),
                        max_local=split.max_local_tokens, locs_gathered=to_device(locs_gathered, dev),
                        page_table=to_device(kv_pages, dev), page_map=self.pool_map,
                        view_locs_gathered=None)  # fmt: skip
        if self.sharded:
            mp = self._materialize_plan(prefix, chunk)
            if self.mat is None:
                self.prepare(prefix, chunk)
            self.mat.replan(mp)
            plan.page_map = mp.page_map
            plan.view_locs_gathered = ops.remap(plan.locs_gathered, mp.page_map, page_size=ps)
            plan.page_table = ops.remap(plan.page_table, mp.page_map)
            per_page = d.kv_layout.page_bytes + d.index_layout.page_bytes
            self.stats["gathered_bytes"] = self.num_layers * mp.num_view_pages * per_page
            self.stats["scratch_bytes"] = max(self.stats["scratch_bytes"], self.mat.scratch_bytes())
        return plan

    # -------------------------------------------------------------------------------------- run
    def step(self, plan: ChunkPlan, x: torch.Tensor, *, record: bool) -> torch.Tensor:
        mat = self.mat
        if mat is not None and self.mode == "sharded_prefetch":
            mat.prefetch(0)
        for layer in range(self.num_layers):
            x = self._layer(layer, plan, x, record)
        return x

    def _layer(self, layer: int, plan: ChunkPlan, x: torch.Tensor, record: bool) -> torch.Tensor:
        d, w, ps = self.d, self.w, self.d.page_size
        n = x.shape[0]
        h = F.rms_norm(x, (d.hidden,))
        a = h @ w.a
        q_a, kv, ik, iw = a.split([d.q_lora, d.kv_lora + d.rope, d.index_dim, d.index_heads], dim=1)
        qb = q_a @ w.qb
        q, iq = qb.split([d.heads * (d.qk_nope + d.rope), d.index_heads * d.index_dim], dim=1)
        q = q.view(n, d.heads, d.qk_nope + d.rope)
        q_lat = torch.bmm(q[..., : d.qk_nope].transpose(0, 1), w.uk).transpose(0, 1)  # [n, H, L] absorbed
        q_full = torch.cat((q_lat, q[..., d.qk_nope :]), dim=2).contiguous()
        # KV write: the chunk's rows, all-gathered (every mode), then fused fp8 quantize-writes
        rows = x.new_zeros((plan.max_local, d.row_dim))
        rows[:n] = torch.cat((kv, ik), dim=1)
        gathered = rows.new_empty((self.cp * plan.max_local, d.row_dim))
        all_gather_into(gathered, rows, self.group)
        g_kv = gathered[:, : d.kv_lora + d.rope].contiguous()
        g_ik = gathered[:, d.kv_lora + d.rope :].contiguous()
        self._write(self.pool.local("kv", layer), self.pool.local("index", layer), g_kv, g_ik, plan.locs_gathered,
                    self.own, self.pool.rank)  # fmt: skip
        # the KV the layer reads: the pool itself, or the materialized view (+ the step's rows written into it)
        mat = self.mat
        if mat is None:
            kv_pages, idx_pages = self.pool.local("kv", layer), self.pool.local("index", layer)
        else:
            record = record and x.is_cuda
            if record:
                before = torch.cuda.Event(enable_timing=True)
                before.record()
            views = mat.view(layer)
            if record:
                after = torch.cuda.Event(enable_timing=True)
                after.record()
                self._events.append((before, after))
            if self.mode == "sharded_prefetch":
                mat.prefetch(layer + 1)
            kv_pages, idx_pages = views["kv"], views["index"]
            self._write(kv_pages, idx_pages, g_kv, g_ik, plan.view_locs_gathered, self.view_own, 0)
        # indexer over every key the request has, top-k, key positions -> cache locations (every mode)
        iq8 = iq.float().view(n, d.index_heads, d.index_dim).clamp(-448, 448).to(torch.float8_e4m3fn)
        iw = iw.float() / math.sqrt(d.index_heads * d.index_dim)
        logits = K.indexer_logits(iq8.view(torch.uint8), iw, idx_pages, plan.page_table, plan.positions,
                                  plan.kv_len, ps, config=self.indexer_config)  # fmt: skip
        k = min(d.top_k, plan.kv_len)
        vals, pos = logits.topk(k, dim=1, sorted=False)
        pos = torch.where(vals == float("-inf"), torch.full_like(pos, -1), pos)  # fewer visible keys than k
        scale = 1.0 / math.sqrt(d.qk_nope + d.rope)
        # sparse MLA over the selected rows, then the output projections
        if self.backend_attn is None:
            locs = ops.remap(pos, plan.page_map, page_size=ps).to(torch.int32)
            kv_rows = kv_pages.view(-1, d.kv_layout.row_bytes)
            o_lat = K.sparse_mla_standin(q_full, kv_rows, locs, scale, d.kv_lora, d.rope, d.quant_block)
        else:
            idx = self.backend_attn.indices(pos, kv_pages, page_map=plan.page_map)
            o_lat = self.backend_attn.prefill(q_full, kv_pages, idx, softmax_scale=scale)[0].to(q_full.dtype)
        o = torch.bmm(o_lat.transpose(0, 1), w.uv).transpose(0, 1).reshape(n, d.heads * d.v_head)
        x = x + o @ w.o
        gu = F.rms_norm(x, (d.hidden,)) @ w.gate_up
        gate, up = gu.chunk(2, dim=1)
        return x + (F.silu(gate) * up) @ w.down

    def _write(self, kv_pool, idx_pool, g_kv, g_ik, locs, own, rank) -> None:
        d = self.d
        ops.quantize_write_mla_fp8(kv_pool, g_kv, locs, own, rank, layout=d.kv_layout, validate=False)
        ops.quantize_write_indexer_fp8(idx_pool, g_ik, locs, own, rank, layout=d.index_layout, validate=False)

    def exposed_ms_per_layer(self) -> list[float]:
        """Per recorded step: time the main stream waited in ``view()`` (stalls on the gather), per layer."""
        out = []
        per_step = self.num_layers
        times = [b.elapsed_time(a) for b, a in self._events]
        for i in range(0, len(times), per_step):
            out.append(sum(times[i : i + per_step]) / per_step)
        self._events.clear()
        return out
