"""A decode step's attention for every layer, capturable as one CUDA graph: sharded, full view or replicated.

Legend: ``B`` query rows of the bucket, ``M`` page slots per request, ``L`` pages one query scores, ``V`` pages one
rank sends to a full view, ``K`` top-k, ``H`` heads, ``R``/``E`` latent/rope dims, ``C`` ranks.

=============  ===================================================================================================
mode           per layer, on each rank
=============  ===================================================================================================
``sharded``    score the rank's own indexer pages, local top-k, candidates all-gathered, global top-k (exact, ties
               by position), attention over the selected rows the rank owns (the others ``-1``), partials merged
               by their LSE (:mod:`dtkv.decode`: the bytes are independent of the context length)
``full_view``  the rank's pages of the batch all-gathered into a view, then the replicated computation on it
``replicated`` every rank holds the whole KV (a pool of ``cp_size`` 1) and decodes alone: the baseline
=============  ===================================================================================================

The three modes run the same kernels (:mod:`dtkv.decode._step_layer`): :func:`dtkv.ops.indexer_scores`,
``torch.topk``, :func:`dtkv.ops.sparse_indices` and the attention seam's decode (:mod:`dtkv.attention`: FlashMLA on
an H200, the torch reference on CPUs). With one rank there is nothing to exchange and nothing to gather (a group
of one holds its full view in its pool), so the three are the same computation.

**Plan and run.** A :class:`DecodeStep` is built once per batch-size bucket (plan phase: static buffers, the
attention schedule, the exchange). :meth:`DecodeStep.set_plan` (host) writes a step's pages and positions into one
int32 buffer and copies it to the device in one copy; :meth:`DecodeStep.layer` / :meth:`DecodeStep.run` (run phase)
read only device tensors: no host synchronization, no data-dependent shape. :meth:`DecodeStep.capture` records every
layer into one CUDA graph; a replay takes whatever plan and inputs were copied in since (new positions, new pages,
new requests within the bucket) without recapture, and allocates nothing.

**Collectives** (``cp > 1``): ``comm="nccl"`` (the group's all-gather; gloo on CPUs) or ``comm="symm_mem"``
(symmetric memory and copy engines, CUDA only): :mod:`dtkv.decode._exchange`. Per layer, sharded decode sends
``B * K * 8`` bytes of candidates and ``B * H * (R * out_itemsize + 4)`` of partials per rank (16 KiB + 129 KiB
per query at DeepSeek-V3.2 geometry with FlashMLA's bf16 output). ``"nccl"`` is the default until the two are
measured side by side on 2 GPUs (``benchmarks/bench_decode.py --comm nccl,symm_mem``).

**Launches per layer** (one H200, graph, cp=1): 1 row write (the fp8 MLA row and indexer key together), 1 indexer,
``torch.topk`` (a radix select: about 8 passes over the 64-bit keys, a few launches each), 2 + 1 for the token
slots, FlashMLA (1-2) and the seam's ``lse`` rewrite (1); ``cp > 1`` adds 2 exchanges, a top-k of ``C * K`` keys
and the merge (a few elementwise).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dtkv._checks import check_int
from dtkv._collectives import group_size
from dtkv._util import cdiv
from dtkv.attention import AttentionSpec, resolve_attention
from dtkv.decode._bucket_plan import BucketLayout, RowCache, build_bucket_plan
from dtkv.decode._exchange import COMMS, Exchange
from dtkv.decode._step_layer import LayerResult, StepInputs, attend, gather_view, select, write_rows
from dtkv.decode.cost import DecodeCommBytes, full_view_comm_bytes, sharded_decode_comm_bytes
from dtkv.decode.topk import MAX_POSITION, unpack_keys
from dtkv.layouts import total_page_bytes
from dtkv.ops import HAS_TRITON

__all__ = ["MODES", "DecodeStep", "DecodeStepConfig", "LayerResult", "StepInputs"]

MODES: tuple[str, ...] = ("sharded", "full_view", "replicated")


@dataclass(frozen=True, kw_only=True, slots=True)
class DecodeStepConfig:
    """What one bucket of decode steps looks like (plan phase)."""

    mode: str = "sharded"
    """``"sharded"``, ``"full_view"`` or ``"replicated"`` (module table)."""
    num_heads: int
    """Attention heads (``H``; per rank)."""
    topk: int
    """Keys each query attends to (``K``)."""
    softmax_scale: float
    """Attention logit scale."""
    max_batch: int
    """Query rows of the bucket (``B``); a plan may use fewer."""
    max_pages: int
    """Page slots per request (``M``): the longest request the bucket takes, in pages."""
    scored_pages: int | None = None
    """Pages one query scores (``L``). Default: ``M``, or for sharded decode over ``C > 1`` ranks
    ``ceil(M / C) + 1`` (decode-time pages are spread evenly: :func:`dtkv.decode.alloc_decode_pages`)."""
    send_pages: int | None = None
    """Full view: pages one rank sends (``V``). Default: ``ceil(B * M / C) + B``."""
    num_layers: int | None = None
    """Layers per step (default: the pool's). Layer ``l`` reads pool layer ``l % pool.num_layers``, so a pool of
    fewer layers can stand in for all of them (benchmarks whose KV would not fit)."""
    attention: str = "auto"
    """Attention backend of the seam (:func:`dtkv.attention.resolve_attention`)."""
    indexer: str = "auto"
    """Backend of :func:`dtkv.ops.indexer_scores` (``"auto"``: Triton on CUDA)."""
    q_fp8: bool | None = None
    """Quantize indexer queries to e4m3 (DeepSeek-V3.2's indexer; :mod:`dtkv.ops.indexer_scores`). Default: when
    the indexer runs the Triton kernel."""
    comm: str = "nccl"
    """``"nccl"`` or ``"symm_mem"`` (:mod:`dtkv.decode._exchange`)."""
    kv_name: str = "kv"
    """The pool's MLA layout name."""
    index_name: str = "index"
    """The pool's indexer layout name."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got mode={self.mode!r}")
        if self.comm not in COMMS:
            raise ValueError(f"comm must be one of {COMMS}, got comm={self.comm!r}")
        for name in ("num_heads", "topk", "max_batch", "max_pages"):
            check_int(name, getattr(self, name), min_value=1)
        for name in ("scored_pages", "send_pages", "num_layers"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), min_value=1)


class DecodeStep:
    """Static buffers, plan and run of one bucket of decode steps on one rank (see the module docstring).

    Args:
        pool: a :class:`dtkv.ShardedKVPool` with an MLA layout (``config.kv_name``: fp8 656-byte rows or bf16
            latent) and an indexer layout (``config.index_name``). ``"replicated"`` needs a pool every rank holds
            whole (``cp_size`` 1, no group).
        config: the bucket.

    Raises:
        ValueError / TypeError: a config the pool does not fit (naming the field); the attention seam's errors
            when the named backend cannot run or does not fit.
    """

    def __init__(self, pool, config: DecodeStepConfig) -> None:
        if not isinstance(config, DecodeStepConfig):
            raise TypeError(f"config must be a DecodeStepConfig, got {type(config).__name__}")
        for name in (config.kv_name, config.index_name):
            if name not in pool.layouts:
                raise ValueError(f"pool has no layout {name!r}; it has {sorted(pool.layouts)}")
        self.pool, self.config, self.mode = pool, config, config.mode
        self.kv_layout, self.index_layout = pool.layouts[config.kv_name], pool.layouts[config.index_name]
        ps = self.page_size = self.index_layout.page_size
        if self.kv_layout.page_size != ps:
            raise ValueError(f"the layouts' page sizes differ: {self.kv_layout.page_size} and {ps}")
        self.group, self.rank, self.device = pool.group, pool.rank, pool.device
        self.cp = group_size(self.group)
        if self.mode == "replicated" and (self.cp != 1 or pool.ownership.cp_size != 1):
            raise ValueError(
                "mode='replicated' needs a pool every rank holds whole (ownership.cp_size 1, group None), got "
                f"cp_size={pool.ownership.cp_size} over a group of {self.cp}"
            )
        self.ownership_spec = pool.ownership.spec
        self.num_layers = config.num_layers or pool.num_layers
        self.topk, self.softmax_scale = config.topk, float(config.softmax_scale)
        b, m = config.max_batch, config.max_pages
        if b * m * ps > MAX_POSITION:  # a selection key's position; a padding key's lands past every row
            raise ValueError(f"max_batch * max_pages * page_size must stay below 2**32 - 1, got {b} * {m} * {ps}")
        self.merges = self.mode == "sharded" and self.cp > 1
        self.gathers = self.mode == "full_view" and self.cp > 1
        default_l = min(m, cdiv(m, self.cp) + 1) if self.merges else m
        v = (config.send_pages or min(b * m, cdiv(b * m, self.cp) + b)) if self.gathers else 0
        self.plan_layout = BucketLayout(batch=b, max_pages=m, scored_pages=config.scored_pages or default_l,
                                          send_pages=v)  # fmt: skip
        cuda = self.device.type == "cuda"
        self._plan_dev = torch.full((self.plan_layout.numel,), -1, dtype=torch.int32, device=self.device)
        self._plan_host = torch.empty((self.plan_layout.numel,), dtype=torch.int32, pin_memory=cuda)
        self._copied = torch.cuda.Event() if cuda else None
        self.fields = self.plan_layout.views(self._plan_dev)
        self._rows: RowCache | None = None
        self.rowbase = (torch.arange(b, dtype=torch.int64, device=self.device) * (m * ps)).view(b, 1)
        self.num_queries = 0
        # kernels: attention through the seam, the indexer op, the writes and packs
        spec = AttentionSpec(num_heads=config.num_heads, layout=self.kv_layout, topk=config.topk)
        self.attn = resolve_attention(config.attention, spec=spec, device=self.device)
        # only a merged partial needs FlashMLA's +inf lse of an empty query turned into -inf (one launch a layer)
        self.schedule = self.attn.plan_decode(b, self.attn.index_width(config.topk), merge_lse=self.merges)
        self.ops_backend = "auto"
        self.indexer_backend = config.indexer
        if config.indexer == "auto":
            self.indexer_backend = "triton" if (cuda and HAS_TRITON) else "torch"
        self.q_fp8 = self.indexer_backend == "triton" if config.q_fp8 is None else bool(config.q_fp8)
        # exchanges and full-view buffers
        r = self.kv_layout.kv_lora_rank
        sizes = [b * config.topk * 8, b * config.num_heads * (r + 1) * 8]
        if self.gathers:
            shapes = [(lay.page_shape, lay.dtype) for lay in (self.kv_layout, self.index_layout)]
            self.view_send = [torch.zeros((v, *s), dtype=d, device=self.device) for s, d in shapes]
            self.view_pages = [torch.zeros((self.cp * v, *s), dtype=d, device=self.device) for s, d in shapes]
            sizes += [t.numel() * t.element_size() for t in self.view_send]
        self.exchange = Exchange(self.group, self.device, backend=config.comm, max_bytes=max(sizes))
        self.inputs: list[StepInputs] | None = None
        self._graph: torch.cuda.CUDAGraph | None = None
        self._graph_out: list[LayerResult] | None = None

    # ------------------------------------------------------------------------------------------ plan
    def set_plan(
        self,
        page_tables: Sequence[Sequence[int]] | torch.Tensor,
        seq_lens: Sequence[int],
        *,
        keys: Sequence[object] | None = None,
    ) -> None:
        """The next step's requests (plan phase, host): pages and lengths (counting the token decoded) of each.

        Builds the padded plan (:func:`dtkv.decode._bucket_plan.build_bucket_plan`: checks like
        :func:`dtkv.decode.plan_decode`) and copies it to the device buffers every layer reads (one copy, no
        synchronization). Rows past ``len(seq_lens)`` decode nothing. With ``keys`` (an identity per row, e.g. request
        ids; page tables as lists; not in a full view across ranks) only the rows whose request or pages changed
        since the last call are rebuilt (:class:`dtkv.decode._bucket_plan.RowCache`).

        Raises:
            ValueError / TypeError: bad requests, or a step larger than the bucket (naming the capacity).
        """
        mode = "sharded" if self.mode == "full_view" and not self.gathers else self.mode
        if keys is not None and mode != "full_view" and not isinstance(page_tables, torch.Tensor):
            if self._rows is None:
                self._rows = RowCache(self.plan_layout, mode)
            plan = self._rows.update(page_tables, seq_lens, keys, self.pool.ownership, self.rank,
                                     page_size=self.page_size, topk=self.topk)  # fmt: skip
        else:
            self._rows = None
            plan = build_bucket_plan(self.plan_layout, mode, page_tables, seq_lens, self.pool.ownership, self.rank,
                                     page_size=self.page_size, topk=self.topk)  # fmt: skip
        if self._copied is not None:
            self._copied.synchronize()  # the previous copy has left the pinned buffer
        self._plan_host.copy_(plan)
        self._plan_dev.copy_(self._plan_host, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        self.num_queries = len(seq_lens)

    # ------------------------------------------------------------------------------------------ run
    def pages(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``(kv, index)`` pages of ``layer`` (pool layer ``layer % pool.num_layers``)."""
        pl = layer % self.pool.num_layers
        return self.pool.local(self.config.kv_name, pl), self.pool.local(self.config.index_name, pl)

    def layer(self, layer: int, x: StepInputs) -> LayerResult:
        """One layer (run phase: device work only, collective over the group when ``cp > 1``)."""
        kv, index = self.pages(layer)
        write_rows(self, kv, index, x)
        if self.gathers:
            kv, index = gather_view(self, kv, index)
        chosen = select(self, index, x)
        out, lse = attend(self, kv, x, chosen)
        return LayerResult(out=out, lse=lse, keys=chosen)

    def run(self, inputs: Sequence[StepInputs] | None = None) -> list[LayerResult]:
        """Every layer of one step, eager (run phase); ``inputs`` default to :attr:`inputs`."""
        xs = self.inputs if inputs is None else inputs
        if xs is None or len(xs) != self.num_layers:
            raise ValueError(f"inputs must hold one StepInputs per layer ({self.num_layers}); see alloc_inputs()")
        self.exchange.begin_step()
        return [self.layer(i, x) for i, x in enumerate(xs)]

    def alloc_inputs(self, *, dtype: torch.dtype = torch.bfloat16, index_heads: int) -> list[StepInputs]:
        """Static per-layer inputs (zeros) that :meth:`run` and a captured graph read; fill them before each step.

        Args:
            dtype: of the queries (bf16 for FlashMLA); head weights are float32 (float64 with float64 queries).
            index_heads: indexer heads (``I``).
        """
        b, h = self.plan_layout.batch, self.config.num_heads
        lay, ilay = self.kv_layout, self.index_layout
        c, j = lay.kv_lora_rank + lay.rope_dim, ilay.head_dim
        wdt = torch.float64 if dtype == torch.float64 else torch.float32

        def z(*shape, dt=dtype):
            return torch.zeros(shape, dtype=dt, device=self.device)

        self.inputs = [
            StepInputs(iq=z(b, index_heads, j), iw=z(b, index_heads, dt=wdt), q=z(b, h, c),
                       kv_row=z(b, c, dt=torch.bfloat16), index_k=z(b, j, dt=torch.bfloat16))
            for _ in range(self.num_layers)
        ]  # fmt: skip
        self._graph = None
        return self.inputs

    # ------------------------------------------------------------------------------------------ graphs
    def capture(self) -> None:
        """Record :meth:`run` over :attr:`inputs` into one CUDA graph (collective: every rank captures).

        One eager step runs first on a side stream (kernels compiled, the attention schedule warmed up,
        communicators created). Call after :meth:`set_plan`; afterwards :meth:`replay`.

        Raises:
            RuntimeError: the pool is not on a CUDA device, or no inputs were allocated.
        """
        if self.device.type != "cuda":
            raise RuntimeError(f"capture() records CUDA graphs; this step runs on {self.device}")
        if self.inputs is None:
            raise RuntimeError("capture() needs static inputs: call alloc_inputs() first")
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self.run()
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            outs = self.run()
        torch.cuda.synchronize(self.device)
        self._graph, self._graph_out = graph, outs

    @property
    def captured(self) -> bool:
        return self._graph is not None

    def replay(self) -> list[LayerResult]:
        """Replay the captured step over the current plan and inputs; the results live in graph memory (valid until
        the next replay)."""
        if self._graph is None or self._graph_out is None:
            raise RuntimeError("replay() needs capture() first")
        self._graph.replay()
        return self._graph_out

    # ------------------------------------------------------------------------------------------ reporting
    @staticmethod
    def positions(result: LayerResult) -> torch.Tensor:
        """int64 ``[B, K]`` selected positions in selection order (score descending, ties by position), ``-1``
        padding (a sort of the keys: for checks, outside the hot path)."""
        return unpack_keys(torch.sort(result.keys, dim=1, descending=True).values)[1]

    def comm_bytes(self) -> DecodeCommBytes:
        """What this rank sends to the collectives of one step (all layers), from the bucket's shapes: the partials
        travel in the attention kernel's dtypes (FlashMLA: bf16 ``out``, float32 ``lse``; torch: the compute
        dtype)."""
        b, h = self.plan_layout.batch, self.config.num_heads
        if self.merges:
            wide = self.inputs is not None and self.inputs[0].q.dtype == torch.float64
            out_isz, lse_isz = (2, 4) if self.attn.name == "flashmla" else ((8, 8) if wide else (4, 4))
            per_layer = sharded_decode_comm_bytes(num_queries=b, topk=self.topk, num_heads=h,
                                                  kv_lora_rank=self.kv_layout.kv_lora_rank, cp_size=self.cp,
                                                  partial_itemsize=out_isz, lse_itemsize=lse_isz)  # fmt: skip
        elif self.gathers:
            page_bytes = total_page_bytes((self.kv_layout, self.index_layout))
            per_layer = full_view_comm_bytes(max_pages_per_rank=self.plan_layout.send_pages, page_bytes=page_bytes,
                                             cp_size=self.cp, num_collectives=2)  # fmt: skip
        else:
            per_layer = DecodeCommBytes(sent=0, received=0, num_collectives=0)
        return per_layer.scaled(self.num_layers)
