"""Compile every Triton kernel of ``dtkv.ops`` for a GPU, offline: no GPU, no driver, what a launch would compile.

    python benchmarks/compile_ops.py --int64                  # DEFAULTS, TUNED and PATHS, sm_90 (CI's check)
    python benchmarks/compile_ops.py --configs candidates     # every candidate of benchmarks/tune_ops.py too
    python benchmarks/compile_ops.py --ops pack_owned_pages --arch 100 --json $OUT/compile.json

Under the Triton interpreter (how the CPU tests run the kernels) nothing is compiled, so a kernel can pass every
CPU test and still not compile for the GPU: Triton's code generator is stricter than Python (a branch on a value it
does not know at compile time must give both sides the same type; a local assigned a constant is a runtime
value). Here each op is called through its registered op with ``backend="triton"`` on small CPU tensors, once per
configuration (forced with :func:`dtkv.ops._tuned.override`) and per geometry: the benchmark's (fp8 and bf16 rows,
fp8 pages, a layer's two layouts, int32 top-k) and awkward ones (rows of 3 int32 or 5 byte words, int32
locations, the block scheme, fp32 and fp16 inputs, four layouts of mixed words, int64 indices and maps), and with
``--int64`` once more with every kernel's int64 offset arithmetic forced. Triton's launch
(``JITFunction.run``) is replaced by what it does before it runs a kernel: bind and specialize the arguments
(dtypes, 16-byte alignment, integers equal to 1 or divisible by 16) and ``triton.compile`` them, here for
``GPUTarget("cuda", ARCH, 32)``, through PTX to a cubin (ptxas ships with Triton). Nothing runs: the tensors'
contents do not matter. Each distinct kernel (signature, constants, options) is compiled once. With every op
selected, a kernel of ``ops/`` that no case launched is a failure too (a new kernel needs a geometry or a
:data:`PATHS` entry). ``--sass`` adds, per kernel, its registers, local memory (spills), instruction count and
global loads and stores by width (``LDG.E.128``: 16 bytes a lane), from the cubin (``cuobjdump`` ships with Triton).

The script must run in its own process, without ``TRITON_INTERPRET=1`` (it drops the variable before importing
Triton; kernels defined in interpreter mode cannot be compiled). Exit status: 0 every kernel compiled, 1 some did
not (each printed with the compiler's full message, innermost cause first), 2 nothing can be compiled here (no
Triton, or its CUDA backend cannot compile a trivial kernel: the reason is printed last).
"""

from __future__ import annotations

import os

os.environ.pop("TRITON_INTERPRET", None)  # before Triton is imported: the kernels must be JIT functions

import argparse  # noqa: E402
import contextlib  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_ops as B  # noqa: E402  (makes the dtkv/ops link of a checkout without the editable install)

from dtkv.ops import HAS_TRITON  # noqa: E402
from dtkv.ops._tuned import DEFAULTS, TUNED, override  # noqa: E402

CANNOT = 2
"""Exit status when nothing can be compiled here."""
OPS = list(DEFAULTS)
EXTRA_OPS = [
    "quantize_write_mla_indexer_fp8", "indexer_scores", "sparse_indices", "sparse_mla", "logits_topk",
    "quantize_indexer_queries", "keys_topk",
]  # fmt: skip
"""Ops with launch choices of their own (not in ``ops/_tuned.py``): compiled at their own launches."""
OWN_GEOMETRY_OPS = ["indexer_logits"]
"""Ops of ``ops/_tuned.py`` without ``bench_ops`` scenarios: their geometries are :func:`_extra`'s, compiled under
every configuration like the others (candidates: their own benchmark's ``CANDIDATES``)."""
INT64_MODULES = ("write_owned", "quantize_write_mla_fp8", "quantize_write_indexer_fp8", "pack_layer_pages", "remap")
"""Modules whose launches choose int32 or int64 offsets with ``needs_int64`` (``--int64`` forces int64)."""


# ----------------------------------------------------------------------------------------- the offline launch
class OfflineCompiler:
    """While active (:meth:`patch`), every ``kernel[grid](...)`` compiles the kernel for ``arch`` instead of
    running it; :attr:`records` holds one entry per distinct kernel."""

    def __init__(self, arch: int = 90, *, sass: bool = False) -> None:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend

        self.target = GPUTarget("cuda", arch, 32)
        self.backend = make_backend(self.target)
        self.sass = sass
        """Also count the memory instructions of each kernel's SASS (:func:`cubin_stats`)."""
        self.records: list[dict] = []
        self._seen: dict[str, dict] = {}
        self.where = ""
        """Label of the call being compiled (op, configuration, geometry), recorded with each kernel."""

    def compile(self, fn, args: tuple, kwargs: dict) -> dict:
        """Bind, specialize and compile one launch of JIT function ``fn`` the way ``JITFunction.run`` does."""
        import triton
        from triton import knobs
        from triton.compiler import ASTSource
        from triton.runtime.jit import create_function_from_signature

        kwargs = dict(kwargs)
        kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
        if hasattr(knobs.compilation, "instrumentation_mode"):
            kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        binder = create_function_from_signature(fn.signature, fn.params, self.backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(self.backend, kwargs, bound, specialization, options)
        key = repr((fn.__name__, sorted(signature.items()), sorted(constexprs.items(), key=repr), sorted(attrs.items(),
                    key=repr), options.num_warps, options.num_stages))  # fmt: skip
        if key in self._seen:
            self._seen[key]["launches"] += 1
            return self._seen[key]
        consts = {fn.arg_names[k[0]]: v for k, v in constexprs.items() if len(k) == 1 and v is not None}
        rec = {"kernel": fn.__name__, "where": self.where, "num_warps": options.num_warps,
               "num_stages": options.num_stages, "constexprs": {k: repr(v) for k, v in consts.items()},
               "launches": 1, "ok": False, "error": None, "seconds": 0.0}  # fmt: skip
        t0 = time.perf_counter()
        try:
            compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=self.target,
                                      options=options.__dict__)  # fmt: skip
            rec["ok"] = True
            rec["fp8_converts"] = sorted(set(re.findall(r"cvt\.[a-z0-9.]*e4m3[a-z0-9.]*", compiled.asm.get("ptx", ""))))
            rec["wgmma"] = compiled.asm.get("ptx", "").count("wgmma.mma_async")
            rec["smem"] = compiled.metadata.shared
            rec.update(cubin_stats(compiled.asm.get("cubin"), sass=self.sass))
        except Exception as e:  # noqa: BLE001 - reported with its whole chain
            rec["error"] = B.error_text(e)
        rec["seconds"] = round(time.perf_counter() - t0, 2)
        self._seen[key] = rec
        self.records.append(rec)
        return rec

    @contextlib.contextmanager
    def patch(self) -> Iterator[OfflineCompiler]:
        from triton.runtime.jit import JITFunction

        real = JITFunction.run

        def run(fn, *args, grid, warmup, **kwargs):
            self.compile(fn, args, kwargs)
            return None

        JITFunction.run = run
        try:
            yield self
        finally:
            JITFunction.run = real


def _nvidia_tool(name: str) -> str | None:
    import triton.backends.nvidia as nv

    path = Path(nv.__file__).parent / "bin" / name
    return str(path) if path.exists() else None


def cubin_stats(cubin: bytes | None, *, sass: bool = False) -> dict:
    """Registers and local-memory bytes (spills) per thread of a cubin (``cuobjdump --dump-resource-usage``, which
    ships with Triton); with ``sass`` also its instruction count and its global loads and stores by width (e.g.
    ``LDG.E.128``: 16 bytes per lane). Empty when the tool or the cubin is missing."""
    tool = _nvidia_tool("cuobjdump")
    if not cubin or tool is None:
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True, check=False)
        m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", usage.stdout)
        out = {} if m is None else dict(zip(("registers", "stack", "shared", "local"), map(int, m.groups())))
        if sass:
            text = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=False).stdout
            ins = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", text)
            out["instructions"] = len(ins)
            mem: dict[str, int] = {}
            for op in ins:
                if op.startswith(("LDG", "STG")):
                    mem[op] = mem.get(op, 0) + 1
            out["global_memory"] = dict(sorted(mem.items()))
    return out


def cannot_compile_reason(arch: int) -> str | None:
    """``None`` when Triton can compile for ``arch`` here, else why not (a trivial kernel is compiled to find out)."""
    if not HAS_TRITON:
        return "Triton is not installed"
    import triton
    import triton.language as tl

    @triton.jit
    def _probe_kernel(x_ptr, n, BLOCK: tl.constexpr):
        o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + o, tl.load(x_ptr + o, mask=o < n) + 1, mask=o < n)

    try:
        comp = OfflineCompiler(arch)
    except Exception as e:  # noqa: BLE001 - any failure means: not here
        return f"Triton {triton.__version__} has no CUDA backend for sm_{arch}: {type(e).__name__}: {e}"
    if not hasattr(_probe_kernel, "params"):
        return "the kernels are not JIT functions (TRITON_INTERPRET=1 was set when Triton was imported)"
    rec = comp.compile(_probe_kernel, (torch.zeros(8), 8), {"BLOCK": 16})
    if not rec["ok"]:
        return f"Triton {triton.__version__} cannot compile a trivial kernel for sm_{arch}: {rec['error'][-600:]}"
    return None


# ----------------------------------------------------------------------------------------- geometries
def _bench(op: str) -> list[tuple[str, Callable[[], object]]]:
    """The benchmark's scenarios of ``op`` at 128 tokens (two pages), their first call."""
    return [(f"bench: {s.op}", s.calls[0]) for s in (make(128, torch.device("cpu")) for make in B.SCENARIOS[op])]


def _awkward(op: str) -> list[tuple[str, Callable[[], object]]]:
    """Small inputs that take the other specializations: narrow words, int32 locations, the block scheme, other
    input dtypes, more layouts, int64 indices and maps."""
    ops = torch.ops.dtkv
    z = torch.zeros
    i32, i64, u8 = torch.int32, torch.int64, torch.uint8
    locs = torch.arange(40, dtype=i64)
    out: list[tuple[str, Callable[[], object]]] = []
    if op in ("write_owned", "direct_write"):
        direct = op == "direct_write"
        cp = 1 if direct else 4
        for name, dtype, dim in (("3 int32 words", torch.float32, 3), ("5 bytes", u8, 5)):
            for scheme in (0, 1):
                out.append((f"{name} rows, scheme {scheme}, int32 locs",
                            lambda dtype=dtype, dim=dim, scheme=scheme: ops.write_owned(
                                z(6, 8, dim, dtype=dtype), z(40, dim, dtype=dtype), locs.to(i32), cp, 6 * cp, scheme,
                                0, direct, False, "triton")))  # fmt: skip
    elif op == "quantize_write_mla_fp8":
        for dtype in (torch.float32, torch.float16):
            for direct, cp in ((False, 3), (True, 1)):
                out.append((f"{dtype} kv, cp {cp}, int32 locs, direct={direct}",
                            lambda dtype=dtype, direct=direct, cp=cp: ops.quantize_write_mla_fp8(
                                z(5, 8, 656, dtype=u8), z(40, 576, dtype=dtype), locs.to(i32), cp, 5 * cp, 1, 0, 512,
                                64, 128, direct, False, "triton")))  # fmt: skip
    elif op == "quantize_write_indexer_fp8":
        for dtype in (torch.float32, torch.float16):
            for direct, cp in ((False, 2), (True, 1)):
                out.append((f"{dtype} k, cp {cp}, int32 locs, direct={direct}",
                            lambda dtype=dtype, direct=direct, cp=cp: ops.quantize_write_indexer_fp8(
                                z(5, 8 * 132, dtype=u8), z(40, 128, dtype=dtype), locs.to(i32), cp, 5 * cp, 0, 0, 8,
                                direct, False, "triton")))  # fmt: skip
    elif op in ("pack_owned_pages", "pack_layer_pages"):
        pools = [z(7, 5, 656, dtype=u8), z(7, 528, dtype=u8), z(7, 7, dtype=u8), z(3, 7, 2, 6, dtype=torch.bfloat16)[1]]
        send = torch.tensor([6, -1, 0, 13, 2], dtype=i32)
        if op == "pack_owned_pages":
            out += [(f"pool {list(p.shape)} {p.dtype}", lambda p=p: ops.pack_owned_pages(p, send, "triton"))
                    for p in pools]  # fmt: skip
        else:
            out += [(f"{k} layouts", lambda k=k: ops.pack_layer_pages(pools[:k], send, "triton")) for k in (1, 3, 4)]
    elif op == "remap":
        for idx_dtype, map_dtype, ps in ((i64, i64, 1), (i64, i32, 64), (i32, i64, 16)):
            out.append((f"{idx_dtype} indices, {map_dtype} map, page size {ps}",
                        lambda a=idx_dtype, m=map_dtype, ps=ps: ops.remap(
                            torch.arange(-1, 200, dtype=a).view(3, 67), torch.arange(300, dtype=m), ps, "triton")))  # fmt: skip
    return out


def _extra(op: str) -> list[tuple[str, Callable[[], object]]]:
    """Small DeepSeek-V3.2-shaped calls of the :data:`EXTRA_OPS` (their own launch tables apply)."""
    from dtkv import IndexerFp8Layout, MLAFp8Layout, PageOwnership
    from dtkv.ops import indexer_scores, quantize_write_mla_indexer_fp8, sparse_indices, sparse_mla
    from dtkv.ops.indexer_scores import LAUNCH_TABLE, IndexerLaunch, use_launch

    z, u8, i32 = torch.zeros, torch.uint8, torch.int32
    kvl, ixl = MLAFp8Layout(page_size=64), IndexerFp8Layout(page_size=64)
    out: list[tuple[str, Callable[[], object]]] = []
    if op == "quantize_write_mla_indexer_fp8":
        for cp, dtype in ((1, torch.bfloat16), (2, torch.float32)):
            out.append((f"cp {cp}, {dtype}", lambda cp=cp, dtype=dtype: quantize_write_mla_indexer_fp8(
                z(3, 64, 656, dtype=u8), z(3, 64 * 132, dtype=u8), z(40, 576, dtype=dtype), z(40, 128, dtype=dtype),
                torch.arange(40), PageOwnership(cp, 3 * cp), 0, kv_layout=kvl, index_layout=ixl, validate=False,
                backend="triton")))  # fmt: skip
    elif op == "indexer_scores":
        launches = [IndexerLaunch(), *LAUNCH_TABLE.values(), IndexerLaunch(kernel="cols")]
        for launch in dict.fromkeys(launches):
            for q_fp8 in (True, False):

                def call(launch=launch, q_fp8=q_fp8):
                    with use_launch(launch):
                        return indexer_scores(
                            z(2, 64, 128, dtype=torch.bfloat16), z(2, 64), z(4, 64 * 132, dtype=u8),
                            torch.tensor([[0, 1], [2, -1]]), torch.tensor([[0, 1], [0, -1]]), torch.tensor([100, 50]),
                            layout=ixl, q_fp8=q_fp8, backend="triton",
                        )  # fmt: skip

                out.append((f"{launch}, q_fp8={q_fp8}", call))
    elif op == "indexer_logits":
        from dtkv.ops import indexer_logits

        f8, i64 = torch.float8_e4m3fn, torch.int64
        geoms = [  # (queries, heads, dims, page size, pages, key columns, index dtype, page stride pad)
            (3, 64, 128, 64, 4, 200, i64, 0),  # DeepSeek-V3.2 geometry
            (2, 64, 128, 64, 4, 130, i32, 16),  # int32 indices, a page-strided view
            (5, 3, 48, 5, 7, 29, i64, 0),  # padded heads and dims, an odd page size
        ]
        for n, heads, hd, ps, pages, cols, idx, pad in geoms:
            for packed in (False, True):
                lay = IndexerFp8Layout(page_size=ps, head_dim=hd)

                def call(n=n, heads=heads, hd=hd, pages=pages, cols=cols, idx=idx, pad=pad, lay=lay, packed=packed):
                    pool = z(pages, lay.page_shape[0] + pad, dtype=u8)[:, : lay.page_shape[0]]
                    return indexer_logits(
                        z(n, heads, hd).to(f8), z(n, heads), pool, torch.arange(cols, dtype=idx),
                        z(n, dtype=idx), torch.full((n,), cols, dtype=idx), layout=lay, packed=packed,
                        backend="triton",
                    )  # fmt: skip

                out.append((f"{n}x{heads}x{hd}, page {ps}, {cols} keys, {idx}, stride +{pad}, packed={packed}", call))
        lay = IndexerFp8Layout(page_size=64, head_dim=128)
        out.append(("3x64x128, page 64, 200 keys, group maxima of 16", lambda: indexer_logits(
            z(3, 64, 128).to(f8), z(3, 64), z(4, lay.page_shape[0], dtype=u8), torch.arange(200), z(3, dtype=i64),
            torch.full((3,), 200), layout=lay, group=16, backend="triton")))  # fmt: skip
    elif op == "sparse_indices":
        locs = torch.arange(-1, 99).view(4, 25)
        out.append(("page map", lambda: sparse_indices(locs, num_slots=640, page_map=torch.arange(10), page_size=64,
                                                       width=64, backend="triton")))  # fmt: skip
        out.append(("page table", lambda: sparse_indices(locs, num_slots=640, page_table=torch.zeros(4, 3, dtype=i32),
                                                         page_size=64, width=64, backend="triton")))  # fmt: skip
    elif op == "quantize_indexer_queries":
        from dtkv.ops import quantize_indexer_queries

        for dtype, heads, dim in ((torch.bfloat16, 64, 128), (torch.float32, 3, 48)):
            out.append((f"{dtype} queries, {heads} x {dim}", lambda dtype=dtype, heads=heads, dim=dim:
                        quantize_indexer_queries(z(5, heads, dim, dtype=dtype), z(5, heads), backend="triton")))  # fmt: skip
    elif op == "logits_topk":
        from dtkv.ops.logits_topk import logits_topk

        for k, idx, ranged, slotted, rows in (
            (2048, torch.int64, True, True, 3),
            (16, i32, False, False, 3),
            (16, i32, False, False, 128),  # the grouped bound (GROUP_CONFIG's min_rows)
            (100, i32, True, False, 3),
        ):

            def topk(k=k, idx=idx, ranged=ranged, slotted=slotted, rows=rows):
                rng = dict(key_start=z(rows, dtype=idx), key_end=torch.full((rows,), 300, dtype=idx)) if ranged else {}
                slots = torch.arange(300, dtype=idx) if slotted else None
                return logits_topk(z(rows, 300), k, key_slots=slots, backend="triton", **rng)

            out.append((f"{rows} rows, k {k}, {idx} indices, range={ranged}, slots={slotted}", topk))
    elif op == "keys_topk":
        from dtkv.ops.keys_topk import keys_topk

        for k, slots in (
            (2048, None),
            (16, torch.arange(300, dtype=i32)),
            (100, torch.zeros(3, 300, dtype=torch.int64)),
        ):
            out.append((f"k {k}, slots {None if slots is None else (slots.dtype, slots.ndim)}",
                        lambda k=k, slots=slots: keys_topk(z(3, 300, dtype=torch.int64), k, key_slots=slots,
                                                           backend="triton")))  # fmt: skip
        out.append(("k 2048, the kept keys", lambda: keys_topk(z(3, 300, dtype=torch.int64), 2048, return_keys=True,
                                                               backend="triton")))  # fmt: skip
    elif op == "sparse_mla":
        idx = torch.zeros(3, 64, dtype=i32)
        out.append(("fp8 rows", lambda: sparse_mla(z(3, 64, 576, dtype=torch.bfloat16), z(128, 656, dtype=u8), idx,
                                                   0.04, kv_lora_rank=512, rope_dim=64, quant_block=128,
                                                   backend="triton")))  # fmt: skip
        out.append(("bf16 rows", lambda: sparse_mla(z(3, 64, 576, dtype=torch.bfloat16), z(128, 576, dtype=torch.bfloat16),
                                                    idx, 0.04, kv_lora_rank=512, rope_dim=64, backend="triton")))  # fmt: skip
        out.append(("float32 queries", lambda: sparse_mla(z(3, 64, 576), z(128, 576, dtype=torch.bfloat16), idx,
                                                          0.04, kv_lora_rank=512, rope_dim=64, backend="triton")))  # fmt: skip
    return out


PATHS: dict[str, list[dict]] = {
    "write_owned": [
        {"variant": "tile", "layout": "rows"},
        {"variant": "tile", "layout": "flat", "block_r": 8, "chunk_w": 512},
        {"variant": "window", "layout": "rows", "window": 64, "block_r": 16},
        {"variant": "window", "layout": "flat", "window": 32, "block_r": 8, "chunk_w": 512},
    ],
    "direct_write": [{"layout": "rows", "chunk_w": 0}, {"layout": "flat", "block_r": 8, "chunk_w": 512}],
    "quantize_write_mla_fp8": [{"block_r": 1, "num_warps": 1}],
    "quantize_write_indexer_fp8": [{"block_r": 64, "num_warps": 8}],
    "pack_owned_pages": [{"rows": 2, "parts": 1}, {"parts": 4, "chunk_w": 2048}],
    "pack_layer_pages": [{"rows": 2, "parts": 1}, {"parts": 4, "chunk_w": 2048}],
    "remap": [{"map16": "always", "idx_cg": 1}, {"map16": "never", "block": 4096, "num_warps": 16}],
    "dequantize_mla_rows": [{"block_r": 1, "num_warps": 1}, {"block_r": 16, "num_warps": 8}],
    "rope_interleave_into": [{"block_r": 1, "num_warps": 1}, {"block_r": 64, "num_warps": 8}],
    "indexer_logits": [
        {"variant": "queries"},
        {"block_q": 1, "block_k": 128},
        {"block_q": 4, "num_warps": 8},
        {"variant": "split", "block_q": 2, "block_k": 128, "num_warps": 8},
    ],
}
"""Configurations (over DEFAULTS) that reach every kernel and variant of each op (``--configs paths``)."""


def kernels_of_ops() -> list[str]:
    """Names of every Triton kernel (a JIT function named ``*_kernel``) defined in the modules of ``dtkv.ops``."""
    import pkgutil

    from triton.runtime.jit import JITFunction

    import dtkv.ops

    names = set()
    for info in pkgutil.iter_modules(dtkv.ops.__path__):
        mod = importlib.import_module(f"dtkv.ops.{info.name}")
        names |= {
            v.__name__ for v in vars(mod).values() if isinstance(v, JITFunction) and v.__name__.endswith("_kernel")
        }
    return sorted(names)


def configs(op: str, which: list[str]) -> list[tuple[str, dict]]:
    """``(label, full configuration)`` of ``op`` for the requested sets, duplicates dropped."""
    out: list[tuple[str, dict]] = []
    if "defaults" in which:
        out.append(("DEFAULTS", dict(DEFAULTS[op])))
    if "tuned" in which:
        out += [(f"TUNED[{size}]", {**DEFAULTS[op], **cfg}) for size, cfg in sorted(TUNED.get(op, {}).items())]
    if "paths" in which:
        out += [(f"paths[{i}]", {**DEFAULTS[op], **c}) for i, c in enumerate(PATHS[op])]
    if "candidates" in which:
        if op in OWN_GEOMETRY_OPS:
            cands = importlib.import_module(f"bench_{op}").CANDIDATES
            out += [(f"candidate {i}", {**DEFAULTS[op], **c}) for i, c in enumerate(cands)]
        else:
            T = importlib.import_module("tune_ops")
            out += [(f"candidate {i}", T.full(op, c)) for i, c in enumerate(T.CANDIDATES[op])]
    seen: list[dict] = []
    unique = []
    for lab, cfg in out:
        if cfg not in seen:
            seen.append(cfg)
            unique.append((lab, cfg))
    return unique


def compile_all(comp: OfflineCompiler, ops: list[str], which: list[str], *, int64: bool, log=print) -> None:
    """Every geometry of every op under every configuration (and with int64 offsets when ``int64``)."""
    modes = [False, True] if int64 else [False]
    with _setattr(B, "_backend", lambda dev: "triton"):  # the scenarios' calls: the Triton backend on CPU tensors
        _compile_ops(comp, ops, which, modes, log)


def _compile_ops(comp: OfflineCompiler, ops: list[str], which: list[str], modes: list[bool], log) -> None:
    for op in ops:
        if op in EXTRA_OPS:
            n0, t0 = len(comp.records), time.perf_counter()
            for case, call in _extra(op):
                comp.where = f"{op} | {case}"
                try:
                    with _setattr(importlib.import_module(f"dtkv.ops.{op}"), "resolve_backend", lambda b, d: "triton"):
                        call()
                except Exception as e:  # noqa: BLE001 - a launch that fails before compiling
                    comp.records.append({"kernel": "?", "where": comp.where, "ok": False, "error": B.error_text(e),
                                         "launches": 1, "seconds": 0.0})  # fmt: skip
            new = comp.records[n0:]
            log(f"  {op} own launches: {len(new)} new kernels, {sum(not r['ok'] for r in new)} failed "
                f"({time.perf_counter() - t0:.1f}s)")  # fmt: skip
            continue
        own = op in OWN_GEOMETRY_OPS
        cases = _extra(op) if own else _bench(op) + _awkward(op)
        for force64 in modes if not own else [False]:
            with contextlib.ExitStack() as stack:
                if force64:
                    for name in INT64_MODULES:
                        mod = importlib.import_module(f"dtkv.ops.{name}")
                        stack.enter_context(_setattr(mod, "needs_int64", lambda *extents: True))
                for lab, cfg in configs(op, which):
                    n0, t0 = len(comp.records), time.perf_counter()
                    module = importlib.import_module(f"dtkv.ops.{op}")
                    on_cpu = (
                        _setattr(module, "resolve_backend", lambda b, d: "triton") if own else contextlib.nullcontext()
                    )
                    with override(op, **cfg), on_cpu:
                        for case, call in cases:
                            comp.where = f"{op} {lab} {cfg} | {case}" + (" | int64 offsets" if force64 else "")
                            try:
                                call()
                            except Exception as e:  # noqa: BLE001 - a launch that fails before compiling
                                comp.records.append({"kernel": "?", "where": comp.where, "ok": False,
                                                     "error": B.error_text(e), "launches": 1, "seconds": 0.0})  # fmt: skip
                    new = comp.records[n0:]
                    bad = sum(not r["ok"] for r in new)
                    log(f"  {op} {lab}{' int64' if force64 else ''}: {len(new)} new kernels, {bad} failed "
                        f"({time.perf_counter() - t0:.1f}s)")  # fmt: skip


@contextlib.contextmanager
def _setattr(obj, name: str, value) -> Iterator[None]:
    before = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, before)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability to compile for (default 90: H100/H200)")
    ap.add_argument("--ops", nargs="*", default=OPS + EXTRA_OPS, help=f"ops (default all: {OPS + EXTRA_OPS})")
    ap.add_argument("--configs", nargs="*", default=["defaults", "tuned", "paths"],
                    choices=["defaults", "tuned", "paths", "candidates"],
                    help="configuration sets (default: defaults tuned paths)")  # fmt: skip
    ap.add_argument("--int64", action="store_true", help="also compile every kernel with int64 offsets forced")
    ap.add_argument("--json", help="write every kernel's record here")
    ap.add_argument("--sass", action="store_true", help="count each kernel's SASS instructions and memory accesses")
    args = ap.parse_args(argv)
    unknown = sorted(set(args.ops) - set(OPS + EXTRA_OPS))
    if unknown:
        ap.error(f"--ops must name ops of {OPS + EXTRA_OPS}, got {unknown}")
    why = cannot_compile_reason(args.arch)
    if why is not None:
        print(f"cannot compile here: {why}")
        return CANNOT
    import triton

    t0 = time.perf_counter()
    comp = OfflineCompiler(args.arch, sass=args.sass)
    print(f"compile_ops: Triton {triton.__version__}, sm_{args.arch}, ops {args.ops}, configs {args.configs}")
    with comp.patch():
        compile_all(comp, args.ops, args.configs, int64=args.int64)
    if set(args.ops) == set(OPS + EXTRA_OPS):  # every kernel of ops/ must have been compiled at least once
        reached = {r["kernel"] for r in comp.records}
        for name in kernels_of_ops():
            if name not in reached:
                comp.records.append({"kernel": name, "where": "no configuration or geometry launched it", "ok": False,
                                     "error": "not reached: add a geometry or a PATHS entry that launches it",
                                     "launches": 0, "seconds": 0.0})  # fmt: skip
    failed = [r for r in comp.records if not r["ok"]]
    for r in failed:
        print(f"\nFAILED {r['kernel']} ({r['where']}):\n{r['error']}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        doc = {"triton": triton.__version__, "arch": args.arch, "records": comp.records}
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"\n{len(comp.records)} distinct kernels for sm_{args.arch} with Triton {triton.__version__} in "
          f"{time.perf_counter() - t0:.0f}s: {len(comp.records) - len(failed)} compiled, {len(failed)} failed")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
