"""The shipped serving loop, measured: ``dtkv.runtime.Runtime`` chunked prefill and decode on its two adapters.

One H200 (the default cases; about 6 minutes, see ``--budget-s``)::

    python benchmarks/bench_runtime.py --out-dir $OUT          # or: torchrun --nproc-per-node 1 ...

N GPUs or N CPU processes (NCCL on GPUs, gloo on CPUs; every case at cp = N)::

    torchrun --nproc-per-node N benchmarks/bench_runtime.py [--kv-modes replicated,sharded_direct]

CPU smoke at tiny dims with the torch attention (what ``tests/test_bench_runtime.py`` runs on 2 gloo ranks)::

    python benchmarks/bench_runtime.py --smoke --out-dir /tmp/x

**Models.** ``transformers``: a transformers DeepSeek-V3.2 model at DeepSeek-V3.2's attention dims (128 heads,
``q_lora_rank`` 1536, ``kv_lora_rank`` 512, rope 64, nope 128, v 128, indexer 64 heads x 128, ``index_topk`` 2048),
hidden ``--hidden`` (2048), ``--layers`` (4), ``--experts`` routed experts (8) with ``--active-experts`` (2) per
token, random bf16 weights built on the GPU (:mod:`_runtime_models`), in
``Runtime(TransformersAdapter(model, kv_dtype=--kv-dtype, page_size=64), attention=--attention)``. ``reference``:
:class:`dtkv.model.ReferenceAdapter` at FlashMLA's dims (128 heads, 512 + 64, fp8 rows, top-k 2048).

**Cases** (each in its own try/except: a failure is a row with ``ok: false`` and ``error``): prefill of one prompt
(``--prefill``: 8K in chunks of 4096, 32K and 128K in chunks of 8192) with ``Runtime.prefill(chunk)`` after a
warm-up prefill of the same prompt; decode (``--decode-contexts`` 32K, 128K x ``--batches`` 1, 16 x ``--decode-modes``
full, sharded) with ``Runtime.decode(steps)`` over requests whose KV is already stored
(:func:`_runtime_models.synthetic_requests`: as a PD decode runtime receives them), ``steps`` from the case's time
budget after two warm-up steps; decode of a ``--long-layers`` (61) model at 32K / batch 1; the reference model's
prefill at 32K / chunk 8192 and decode at 32K / batch 1; and the indexer op alone (``bench_indexer_logits``'s
``run_cases`` at ``--indexer-cases``). ``--graph`` passes the runtime's CUDA-graph switch
(``Runtime(cuda_graphs=True)``; ``"emulate"`` on a CPU, where nothing is captured: the graph path run eagerly);
without it ``cuda_graphs=False`` (eager decode). Rows say ``graph`` (steps captured and replayed), ``graph_mode``
(``capture`` / ``emulate`` / ``off``) and ``graph_eager_steps`` (decode steps that ran eager instead, with
``graph_reason``).

**Row keys** (``runtime_<hw>_<date>.jsonl``, one row per case, printed as each finishes): ``phase`` (``prefill`` /
``decode`` / ``indexer``), ``adapter``, ``layers``, ``hidden``, ``attention`` (the resolved backend), ``kv_dtype``,
``decode_mode``, ``context``, ``chunk``, ``batch``, ``graph``, ``ok``, ``error`` (also names a part that failed in a
case that ran: ``profile: ...``, ``kernels: ...``), ``tok_s`` (prefill: prompt tokens / wall seconds of
``prefill()``), ``step_ms`` (decode: wall ms per ``decode()`` step), ``gpu_busy_share`` (the device's busy time over
every stream, overlaps merged, in a run of the same work profiled with device activity only
(:func:`_runtime_profile.device_busy`), over the wall time of that work in the timed region (``timed_ms``: the
prompt's ``prefill()``, or as many decode steps at ``step_ms``). A profiled run is slower than the timed one -- the
host activity's records lengthen the host's part, and CUPTI's tracing of every kernel of a replayed graph lengthens
the replay (two 4-layer decode steps: 6.6 ms profiled with device activity only, 4.4 ms timed, on an H100) -- so the
share over a profiled run's own wall counts the profiler's cost as idle; those two are kept as
``gpu_busy_share_profiled_wall`` (device activity only) and ``gpu_busy_share_host_profiled`` (both activities, the
run that attributes dtkv's part)),
``peak_mem_gb`` (GiB allocated at the peak of the timed region, weights included), ``dtkv_ms_per_layer`` (device
time of the kernels dtkv's own calls launched in the profiled run -- KV writes, views, indexer, top-k, index
translation, attention -- per layer, per prompt for prefill and per step for decode), ``kernel_ms_per_layer`` (the
same shapes through the kernels alone, same run: :mod:`_runtime_kernels`), and for prefill ``model_tflop`` and
``roofline_share`` (:mod:`_runtime_models`: GEMMs and attention at 700 TFLOP/s, the fp8 indexer at 1400); also
``cp``, ``kv_mode``, ``busy_ms``, ``profiled_wall_ms``, ``attribution``, ``categories_ms``, ``kernel_parts_ms``.
Indexer rows are ``bench_indexer_logits``'s (``tokens``, ``context``, ``ms``, ``tflops``, per ``mode``).

The run prints the environment first, a JSON line per row as it finishes (the JSONL file and the ``.md`` page --
hardware, versions, date, commit, tables, targets -- grow with them, so a run cut short keeps what ran), then the
targets (:mod:`_runtime_report`) and the plot (``.png``); ``--targets FILE`` prints a results file's target lines
without running.
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.util
import inspect
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
if importlib.util.find_spec("dtkv") is None:  # a checkout that is not installed: use it as is
    sys.path.insert(0, str(HERE.parent))

import _dist_bench as db  # noqa: E402
import _runtime_models as models  # noqa: E402
import _runtime_report as report  # noqa: E402
import bench_indexer_logits as bil  # noqa: E402
from _runtime_kernels import decode_kernels, prefill_kernels  # noqa: E402
from _runtime_profile import device_busy, profiled  # noqa: E402

from dtkv.runtime import Runtime, num_pages_for  # noqa: E402

PHASES = ("indexer", "prefill", "decode")
ADAPTERS = ("transformers", "reference")
GRAPH_SWITCHES = ("cuda_graphs", "cuda_graph", "graphs")
"""Keyword names of a CUDA-graph switch of ``Runtime`` this benchmark passes ``--graph`` to (the first it finds)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Case:
    """One measurement."""

    phase: str
    """``"prefill"`` or ``"decode"``."""
    adapter: str
    """``"transformers"`` or ``"reference"``."""
    layers: int
    context: int
    """Prompt tokens (prefill) or tokens of each request's KV (decode)."""
    chunk: int | None = None
    batch: int = 1
    decode_mode: str | None = None
    kv_mode: str | None = None
    """``Runtime(mode=)``; ``None``: the runtime's default for the group."""


def _sig(x: float, digits: int = 4) -> float:
    """``x`` rounded to ``digits`` significant digits."""
    return float(f"{x:.{digits}g}")


def _pairs(text: str) -> list[tuple[int, int]]:
    return [(int(a), int(b)) for a, b in (s.split("x") for s in text.split(",") if s)]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _names(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def cases(ns) -> list[Case]:
    """The run's cases, grouped by model (each model is built once)."""
    kv_modes = _names(ns.kv_modes) or [None]
    out = []
    for adapter in _names(ns.adapters):
        ref = adapter == "reference"
        prefill = _pairs(ns.reference_prefill if ref else ns.prefill)
        contexts = _ints(ns.reference_decode_contexts if ref else ns.decode_contexts)
        batches = [1] if ref else _ints(ns.batches)
        for kv in kv_modes:
            if "prefill" in ns.phases:
                out += [Case(phase="prefill", adapter=adapter, layers=ns.layers, context=t, chunk=c, kv_mode=kv)
                        for t, c in prefill]  # fmt: skip
            if "decode" in ns.phases:
                out += [Case(phase="decode", adapter=adapter, layers=ns.layers, context=t, batch=b, decode_mode=m,
                             kv_mode=kv) for t in contexts for b in batches for m in _names(ns.decode_modes)]  # fmt: skip
        if not ref and "decode" in ns.phases and ns.long_layers:
            out += [Case(phase="decode", adapter=adapter, layers=ns.long_layers, context=contexts[0], batch=1,
                         decode_mode=m) for m in _names(ns.decode_modes)]  # fmt: skip
    return out


# ------------------------------------------------------------------------------------------- environment
def environment(dev: torch.device, world: int, commit: str | None = None) -> dict:
    """What the run ran on (printed first, written into the summary); ``commit`` overrides git's answer."""
    env = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "cp": world,
           "date": db.today(), "python": sys.version.split()[0], **db.versions()}  # fmt: skip
    env["cuda"] = torch.version.cuda
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        env["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20, check=False)  # fmt: skip
            env["driver"] = smi.stdout.strip().splitlines()[0] if smi.stdout.strip() else None
        except (OSError, subprocess.SubprocessError):
            env["driver"] = None
    for mod in ("transformers", "flash_mla"):
        try:
            m = __import__(mod)
            env[mod] = getattr(m, "__version__", "?")
            if mod == "flash_mla":
                env[mod] += f" (legacy kernels: {m.has_legacy()})"
        except Exception as e:  # noqa: BLE001 - reported
            env[mod] = None
            env[f"{mod}_error"] = f"{type(e).__name__}: {e}"[:160]
    from dtkv.attention import available_backends

    env["attention_backends"] = {k: v or "available" for k, v in available_backends(dev).items()}
    env["graph_switch"] = graph_switch()
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True,
                             timeout=10, check=False).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=HERE, capture_output=True, text=True,
                               timeout=10, check=False).stdout.strip()  # fmt: skip
        env["commit"] = (sha or "unknown") + (" (uncommitted changes)" if sha and dirty else "")
    except (OSError, subprocess.SubprocessError):
        env["commit"] = "unknown"
    if commit:
        env["commit"] = commit
    return env


def graph_switch() -> str | None:
    """The keyword of ``Runtime``'s CUDA-graph switch, or None while it has none."""
    params = inspect.signature(Runtime).parameters
    return next((name for name in GRAPH_SWITCHES if name in params), None)


# ------------------------------------------------------------------------------------------- the group
class Group:
    """The ranks of the run (``None``: one process): agreement on the budget and on failures."""

    def __init__(self, group, device: torch.device) -> None:
        self.group, self.device = group, device
        self.rank = dist.get_rank(group) if group is not None else 0
        self.world = dist.get_world_size(group) if group is not None else 1

    def max(self, x: float) -> float:
        if self.group is None:
            return x
        t = torch.tensor([x], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return float(t.item())

    def all(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank (collective)."""
        return self.max(0.0 if flag else 1.0) == 0.0

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.group is not None:
            db.barrier(self.device, self.group)


# ------------------------------------------------------------------------------------------- the cases
class Bench:
    """The models, the run's settings, and one method per phase (collective: every rank the same calls)."""

    def __init__(self, ns, group: Group, dev: torch.device) -> None:
        self.ns, self.g, self.dev = ns, group, dev
        self.dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[ns.dtype]
        self.page_size = 16 if ns.smoke else 64
        self.builds: dict[str, float] = {}
        self._model: tuple | None = None
        self.switch = graph_switch()
        self.compile_modules = {"auto": None, "on": True, "off": False}[ns.compile_modules]

    # -------------------------------------------------------------------- models
    def model(self, adapter: str, layers: int):
        key = (adapter, layers)
        if self._model is not None and self._model[0] == key:
            return self._model[1]
        self._model = None
        gc.collect()
        if self.dev.type == "cuda":
            torch.cuda.empty_cache()
        ns = self.ns
        if adapter == "transformers":
            dims = models.transformers_dims(layers=layers, hidden=ns.hidden, experts=ns.experts,
                                            active=ns.active_experts, smoke=ns.smoke)  # fmt: skip
            m, secs = models.build_transformers(dims, device=self.dev, dtype=self.dtype, init=ns.init, seed=ns.seed)
        else:
            from dtkv.model import ReferenceAdapter

            t0 = time.perf_counter()
            m = ReferenceAdapter(models.reference_config(layers=layers, smoke=ns.smoke, page_size=self.page_size),
                                 self.dev)  # fmt: skip
            secs = time.perf_counter() - t0
        self.builds[f"{adapter} {layers} layers"] = round(secs, 2)
        if self.g.rank == 0:
            print(f"[bench_runtime] built the {adapter} model, {layers} layers: {secs:.1f} s", file=sys.stderr,
                  flush=True)  # fmt: skip
        self._model = (key, m)
        return m

    def runtime(self, case: Case, num_pages: int) -> Runtime:
        m = self.model(case.adapter, case.layers)
        if case.adapter == "transformers":
            from dtkv.integrations.transformers import TransformersAdapter

            adapter = TransformersAdapter(m, kv_dtype=self.ns.kv_dtype, page_size=self.page_size,
                                          compile_modules=self.compile_modules)  # fmt: skip
        else:
            adapter = m
        kw = {}
        if self.switch:  # on a CPU the graph path runs eagerly ("emulate"): nothing to capture
            kw = {self.switch: ("emulate" if self.dev.type != "cuda" else True) if self.ns.graph else False}
        return Runtime(adapter, num_pages=num_pages, group=self.g.group, mode=case.kv_mode,
                       decode_mode=case.decode_mode or "full", attention=self.ns.attention, **kw)  # fmt: skip

    def base(self, case: Case) -> dict:
        """The row of ``case`` before it runs: every key, nothing measured."""
        ns = self.ns
        if case.adapter == "transformers":
            from dtkv.integrations.transformers import tiny_config

            dims = models.transformers_dims(layers=case.layers, hidden=ns.hidden, experts=ns.experts,
                                            active=ns.active_experts, smoke=ns.smoke)  # fmt: skip
            hidden, kv_dtype = tiny_config("deepseek-v32", **dims).hidden_size, ns.kv_dtype
        else:
            hidden = models.reference_config(layers=1, smoke=ns.smoke, page_size=self.page_size).d_model
            kv_dtype = "fp8"
        return {"phase": case.phase, "adapter": case.adapter, "layers": case.layers, "hidden": hidden,
                "attention": ns.attention, "kv_dtype": kv_dtype, "decode_mode": case.decode_mode,
                "context": case.context, "chunk": case.chunk, "batch": case.batch, "graph": False, "ok": False,
                "error": None, "tok_s": None, "step_ms": None, "gpu_busy_share": None, "peak_mem_gb": None,
                "dtkv_ms_per_layer": None, "kernel_ms_per_layer": None, "model_tflop": None, "roofline_share": None,
                "cp": self.g.world, "kv_mode": case.kv_mode}  # fmt: skip

    def _index_heads(self, case: Case) -> int:
        m = self.model(case.adapter, case.layers)
        return m.config.index_n_heads if case.adapter == "transformers" else m.cfg.index_heads

    def _flops(self, case: Case, steps: int) -> dict:
        m = self.model(case.adapter, case.layers)
        if case.adapter == "transformers":
            return models.transformers_flops(m.config, case.context, steps)
        return models.reference_flops(m.cfg, case.context, steps)

    def _timed(self, fn) -> float:
        self.g.sync()
        t0 = time.perf_counter()
        fn()
        self.g.sync()
        return time.perf_counter() - t0

    def _peak_reset(self) -> None:
        if self.dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.dev)

    def _peak(self) -> float | None:
        return torch.cuda.max_memory_allocated(self.dev) / 2**30 if self.dev.type == "cuda" else None

    def _profile(self, out: dict, rt, fn, *, layers: int, per: int, name: str, again=None, timed_ms=None) -> None:
        """Profile ``fn`` (CPU and CUDA: dtkv's part, the categories), then ``again`` (the same work once more)
        under device activity only: its busy time over ``timed_ms``, the wall of the same work in the timed
        (unprofiled) region, is the busy share (module docstring)."""
        try:
            p = profiled(fn, self.dev, rt, trace_dir=self.ns.trace_dir, name=name)
        except Exception as e:  # noqa: BLE001 - the case keeps its timings
            out["errors"].append(f"profile: {type(e).__name__}: {e}"[:300])
            return
        busy = p["busy_ms"]
        out.update(gpu_busy_share=None if busy is None else _sig(busy / p["wall_ms"]), busy_ms=busy,
                   profiled_wall_ms=_sig(p["wall_ms"]), attribution=p["attribution"],
                   dtkv_ms_per_layer=_sig(p["dtkv_ms"] / layers / per), categories_ms=p["categories_ms"])  # fmt: skip
        if busy is None or again is None or timed_ms is None:
            return
        out["gpu_busy_share_host_profiled"] = out["gpu_busy_share"]
        try:
            d = device_busy(again, self.dev)
        except Exception as e:  # noqa: BLE001 - the case keeps the share of the full profile
            out["errors"].append(f"device profile: {type(e).__name__}: {e}"[:300])
            return
        if d["busy_ms"] is not None:
            out.update(gpu_busy_share=_sig(d["busy_ms"] / timed_ms), busy_ms=_sig(d["busy_ms"]),
                       gpu_busy_share_profiled_wall=_sig(d["busy_ms"] / d["wall_ms"]),
                       profiled_wall_ms=_sig(d["wall_ms"]), timed_ms=_sig(timed_ms))  # fmt: skip

    # -------------------------------------------------------------------- prefill
    def prefill(self, case: Case, budget_s: float) -> dict:
        t, c, cp = case.context, case.chunk, self.g.world
        out: dict = {"errors": []}
        g = torch.Generator().manual_seed(self.ns.seed)
        rt = self.runtime(case, num_pages_for([t, t], page_size=self.page_size, cp_size=cp))
        try:
            out["attention"], out["kv_mode"] = rt.attention.name, rt.mode
            out["compile_modules"] = getattr(rt.adapter, "compile_modules", None)
            prompt = torch.randint(0, rt.model_spec.vocab_size, (t,), generator=g).tolist()
            # the whole prompt once first: kernels compile per shape (contexts past the first chunks too), the
            # allocator and the caches warm; a warm-up of two chunks left the 128K run 13% slower than a repeat
            warm = rt.add_request(prompt)
            rt.prefill(c)
            rt.finish_request(warm.rid)
            deadline = time.perf_counter() + budget_s  # the budget starts after the warm-up (kernel compiles)
            self._peak_reset()
            req = rt.add_request(prompt)
            wall = self._timed(lambda: rt.prefill(c))
            steps = -(-t // c)
            flops = self._flops(case, steps)
            out.update(tok_s=_sig(t / wall), wall_s=_sig(wall), peak_mem_gb=self._peak(),
                       model_tflop=_sig(sum(flops.values()) / 1e12),
                       roofline_share=_sig(models.roofline_s(flops, cp) / wall))  # fmt: skip
            if not self.ns.no_profile and self.g.all(time.perf_counter() + 3 * wall < deadline):
                again = rt.add_request(prompt)
                held = [again]

                def third() -> None:  # the prompt once more, in the room the profiled one leaves
                    rt.finish_request(held.pop().rid)
                    held.append(rt.add_request(prompt))
                    rt.prefill(c)

                self._profile(out, rt, lambda: rt.prefill(c), layers=case.layers, per=1,
                              name=f"prefill_{case.adapter}_{t}_{c}",
                              again=third if self.dev.type == "cuda" else None, timed_ms=wall * 1e3)  # fmt: skip
                rt.finish_request(held.pop().rid)
            if not self.ns.no_kernels and self.g.all(time.perf_counter() < deadline):
                heads = self._index_heads(case) if case.adapter == "transformers" else None
                try:
                    k = prefill_kernels(rt, req, c, indexer_heads=heads, reps=2, seed=self.ns.seed)
                    out.update(kernel_ms_per_layer=k["ms_per_layer"], kernel_parts_ms=k["parts_ms"])
                    if k["note"]:
                        out["errors"].append(f"kernels: {k['note']}")
                except Exception as e:  # noqa: BLE001 - the case keeps its timings
                    out["errors"].append(f"kernels: {type(e).__name__}: {e}"[:300])
        finally:
            rt.close()
        return out

    # -------------------------------------------------------------------- decode
    def decode(self, case: Case, budget_s: float) -> dict:
        t, b, cp, ns = case.context, case.batch, self.g.world, self.ns
        out: dict = {"errors": []}
        warm, most, prof = (1, ns.decode_steps, 1) if ns.smoke else (2, ns.decode_steps, 2)
        pages = num_pages_for([t] * b, page_size=self.page_size, decode_steps=warm + most + 2 * prof + 2, cp_size=cp)
        rt = self.runtime(case, pages)
        try:
            out["attention"], out["kv_mode"] = rt.attention.name, rt.mode
            out["compile_modules"] = getattr(rt.adapter, "compile_modules", None)
            mode = getattr(rt, "graph_mode", "off")
            out.update(graph=mode == "capture", graph_mode=mode)
            reqs = models.synthetic_requests(rt, batch=b, context=t, seed=ns.seed)
            if ns.read_each_step:  # a progress callback: every step's tokens reach the host before the next step
                dec = functools.partial(rt.decode, progress=lambda k, n: None)
            else:
                dec = rt.decode
            out["read_each_step"] = bool(ns.read_each_step)
            dec(warm)
            deadline = time.perf_counter() + budget_s  # the budget starts after the warm-up (kernel compiles)
            one = self.g.max(self._timed(lambda: dec(1)))
            left = deadline - time.perf_counter()
            fit = 0.35 * left / max(one, 1e-6)  # steps that fit a third of what is left of the case's budget
            steps = int(self.g.max(max(1, most if fit >= most else int(fit))))
            self._peak_reset()
            wall = self._timed(lambda: dec(steps))
            out.update(step_ms=_sig(wall / steps * 1e3), steps=steps, peak_mem_gb=self._peak())
            graphs = getattr(rt, "graphs", None)
            if graphs is not None:
                out.update(graph_eager_steps=graphs.stats["eager_steps"], graph_reason=graphs.reason or None,
                           graph_captures=graphs.stats["captures"])  # fmt: skip
            if not ns.no_profile and self.g.all(time.perf_counter() + 4 * prof * one < deadline):
                self._profile(out, rt, lambda: dec(prof), layers=case.layers, per=prof,
                              name=f"decode_{case.adapter}_{case.layers}_{t}_{b}_{case.decode_mode}",
                              again=(lambda: dec(prof)) if self.dev.type == "cuda" else None,
                              timed_ms=wall / steps * prof * 1e3)  # fmt: skip
            if not ns.no_kernels and self.g.all(time.perf_counter() < deadline):
                try:
                    k = decode_kernels(rt, reqs, index_heads=self._index_heads(case), graph=True)
                    out.update(kernel_ms_per_layer=k["ms_per_layer"], kernel_how=k["how"])
                except Exception as e:  # noqa: BLE001 - the case keeps its timings
                    out["errors"].append(f"kernels: {type(e).__name__}: {e}"[:300])
        finally:
            rt.close()
        return out

    # -------------------------------------------------------------------- one row
    def row(self, case: Case) -> dict:
        """Run ``case`` within its time budget; the row (every key of the module docstring)."""
        row = self.base(case)
        failed = ""
        try:
            got = (self.prefill if case.phase == "prefill" else self.decode)(case, self.ns.case_budget_s)
            errors = got.pop("errors")
            row.update(got, ok=True, error="; ".join(errors) or None)
        except Exception as e:  # noqa: BLE001 - one failure keeps the others
            failed = f"{type(e).__name__}: {e}"[:400]
            row["error"] = failed
            if self.dev.type == "cuda":
                torch.cuda.empty_cache()
        if not self.g.all(not failed) and not failed:  # another rank failed: no rank reports it OK
            row.update(ok=False, error="failed on another rank (see its log)")
        if row["peak_mem_gb"] is not None:
            row["peak_mem_gb"] = _sig(row["peak_mem_gb"])
        return row


# ------------------------------------------------------------------------------------------- main
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="CPU, tiny dims, torch attention (CI's gloo smoke)")
    p.add_argument("--phases", default="indexer,prefill,decode", help="any of indexer, prefill, decode (default all)")
    p.add_argument("--adapters", default="transformers,reference", help="any of transformers, reference")
    p.add_argument("--prefill", help="PROMPTxCHUNK,... (default 8192x4096,32768x8192,131072x8192)")
    p.add_argument("--decode-contexts", help="tokens per request (default 32768,131072)")
    p.add_argument("--batches", help="decode requests (default 1,16)")
    p.add_argument("--decode-modes", default="full,sharded", help="Runtime(decode_mode=) list (default both)")
    p.add_argument("--reference-prefill", help="the reference model's PROMPTxCHUNK (default 32768x8192)")
    p.add_argument("--reference-decode-contexts", help="the reference model's decode contexts (default 32768)")
    p.add_argument("--layers", type=int, help="model layers (default 4; --smoke 2)")
    p.add_argument("--long-layers", type=int, help="layers of the long decode case, 0: none (default 61; smoke 3)")
    p.add_argument("--hidden", type=int, default=2048, help="hidden size of the transformers model")
    p.add_argument("--experts", type=int, default=8, help="routed experts")
    p.add_argument("--active-experts", type=int, default=2, help="routed experts per token")
    p.add_argument("--attention", help="Runtime(attention=): auto, torch, triton, flashmla (default auto; smoke torch)")
    p.add_argument("--kv-dtype", default="fp8", choices=("fp8", "bf16"), help="the transformers model's stored KV")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), help="model dtype (default bfloat16; smoke float32)")
    p.add_argument("--kv-modes", default="", help="Runtime(mode=) list, e.g. replicated,sharded_direct (default: "
                   "the runtime's own default)")  # fmt: skip
    p.add_argument("--indexer-cases", default="4096x32768,8192x32768,8192x131072", help="TOKENSxCONTEXT,...")
    p.add_argument("--graph", action="store_true", help="pass Runtime's CUDA-graph switch (when it has one)")
    p.add_argument("--decode-steps", type=int, help="most timed decode steps per case (default 20; smoke 2)")
    p.add_argument("--budget-s", type=float, help="the run's time budget: the cases after it are skipped (default "
                   "360)")  # fmt: skip
    p.add_argument("--case-budget-s", type=float, help="per case after its warm-up: the decode steps are sized to it, "
                   "profiling and kernels are skipped past it (default 75)")  # fmt: skip
    p.add_argument("--no-profile", action="store_true", help="no profiled run (no busy share, no dtkv ms)")
    p.add_argument("--no-kernels", action="store_true", help="no kernels-alone timing (no kernel ms)")
    p.add_argument("--read-each-step", action="store_true",
                   help="decode with a progress callback: each step's tokens are read before the next step is "
                        "planned (the graph path's step-ahead off; a baseline for it)")  # fmt: skip
    p.add_argument(
        "--compile-modules",
        default="auto",
        choices=("auto", "on", "off"),
        help="TransformersAdapter(compile_modules=): auto (its default: on on CUDA), on, off",
    )
    p.add_argument("--init", default="skip", choices=("skip", "default"), help="transformers' weight init")
    p.add_argument("--seed", type=int, default=0, help="of the weights, prompts and random KV")
    p.add_argument("--trace-dir", help="keep each profiled run's chrome trace here")
    p.add_argument("--out-dir", help="where results go (default $OUT, else benchmarks/results)")
    p.add_argument("--commit", help="the commit to record (a copy of the checkout without its git metadata)")
    p.add_argument("--targets", metavar="JSONL", help="print a results file's target lines and exit")
    return p


def _defaults(ns, parser: argparse.ArgumentParser) -> None:
    s = ns.smoke
    for name, gpu, smoke in (
        ("prefill", "8192x4096,32768x8192,131072x8192", "96x32,200x64"),
        ("decode_contexts", "32768,131072", "64,150"),
        ("batches", "1,16", "1,3"),
        ("reference_prefill", "32768x8192", "96x32"),
        ("reference_decode_contexts", "32768", "64"),
        ("layers", 4, 2),
        ("long_layers", 61, 3),
        ("attention", "auto", "torch"),
        ("dtype", "bfloat16", "float32"),
        ("decode_steps", 20, 2),
        ("budget_s", 360.0, 600.0),
        ("case_budget_s", 75.0, 120.0),
    ):
        if getattr(ns, name) is None:
            setattr(ns, name, smoke if s else gpu)
    ns.phases = _names(ns.phases)
    from dtkv.runtime import DECODE_MODES, KV_MODES

    for flag, given, allowed in (("--phases", ns.phases, PHASES), ("--adapters", _names(ns.adapters), ADAPTERS),
                                 ("--decode-modes", _names(ns.decode_modes), DECODE_MODES),
                                 ("--kv-modes", _names(ns.kv_modes), KV_MODES)):  # fmt: skip
        bad = [x for x in given if x not in allowed]
        if bad:
            parser.error(f"{flag} takes names from {list(allowed)}, got {bad}")
    for flag, text in (("--prefill", ns.prefill), ("--reference-prefill", ns.reference_prefill),
                       ("--indexer-cases", ns.indexer_cases)):  # fmt: skip
        try:
            pairs = _pairs(text)
        except ValueError:
            parser.error(f"{flag} takes AxB pairs of positive ints separated by commas, got {text!r}")
        if any(a < 1 or b < 1 for a, b in pairs):
            parser.error(f"{flag} takes positive ints, got {text!r}")
    if ns.layers < 1 or ns.long_layers < 0 or ns.decode_steps < 1:
        parser.error(f"--layers >= 1, --long-layers >= 0 and --decode-steps >= 1, got {ns.layers}, "
                     f"{ns.long_layers}, {ns.decode_steps}")  # fmt: skip


def _init(smoke: bool) -> tuple[Group, torch.device]:
    if dist.is_initialized() or "WORLD_SIZE" in os.environ:
        _, _, dev = db.init("cpu" if smoke else "auto")
        return Group(dist.group.WORLD, dev), dev
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() and not smoke else (
        torch.device("cpu"))  # fmt: skip
    return Group(None, dev), dev


def _indexer_rows(ns, dev: torch.device, log) -> list[dict]:
    from dtkv.ops._common import HAS_TRITON, INTERPRET

    if ns.smoke or dev.type != "cuda":
        kernel = "triton" if HAS_TRITON and INTERPRET else None
        cases = bil.SMOKE_CASES[:1]  # tiny shapes (the kernel under the interpreter takes seconds a call)
        return bil.run_cases(cases, torch.device("cpu"), reps=1, kernel_backend=kernel, smoke=True, log=log)
    return bil.run_cases(bil._cases(ns.indexer_cases), dev, reps=5, kernel_backend="triton", smoke=False, log=log)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    ns = parser.parse_args(argv)
    if ns.targets:
        print("\n".join(report.target_lines(db.read_jsonl(Path(ns.targets)))))
        return 0
    _defaults(ns, parser)
    group, dev = _init(ns.smoke)
    t_start, lead = time.perf_counter(), group.rank == 0
    env = environment(dev, group.world, ns.commit)
    tag = db.hardware_tag(dev, group.world)
    out_dir = db.out_dir(ns.out_dir)
    stem = out_dir / f"runtime_{tag}_{db.today()}"
    args = argv if argv is not None else sys.argv[1:]
    launcher = f"torchrun --nproc-per-node {group.world} " if group.group is not None else "python "
    command = f"{launcher}benchmarks/bench_runtime.py {' '.join(args)}".strip()
    rows: list[dict] = []
    partial = stem.with_suffix(".jsonl")

    def log(text: str) -> None:
        if lead:
            print(f"[bench_runtime {time.perf_counter() - t_start:6.1f} s] {text}", file=sys.stderr, flush=True)

    def summary(final: bool) -> str:
        notes = [f"model builds (s): {json.dumps(bench.builds)} (--init {ns.init})",
                 f"CUDA-graph switch of Runtime: {env['graph_switch'] or 'none yet (rows say graph: false)'}",
                 f"environment: {json.dumps(env)}"]  # fmt: skip
        if not final:
            notes.insert(0, f"**partial**: {len(rows)} rows so far (the run had not finished when this was written)")
        seconds = time.perf_counter() - t_start
        text = report.markdown(rows, env, title=stem.name, command=command, seconds=seconds, notes=notes)
        stem.with_suffix(".md").write_text(text)
        return text

    def emit(row: dict) -> None:
        rows.append(row)
        if lead:  # the files grow with the rows: a run cut short keeps what ran
            print(json.dumps(row), flush=True)
            with partial.open("a") as f:
                f.write(json.dumps(row) + "\n")
            summary(final=False)

    if lead:
        print("env " + json.dumps(env), flush=True)
        partial.write_text("")
    bench = Bench(ns, group, dev)
    if "indexer" in ns.phases:  # every rank, on its own device (no collective, no rank waiting on another)
        log("indexer op alone")
        try:
            for r in _indexer_rows(ns, dev, log=lambda line: None):
                emit(r)
        except Exception as e:  # noqa: BLE001 - the runtime cases still run
            emit({"phase": "indexer", "ok": False, "error": f"{type(e).__name__}: {e}"[:300]})
    for case in cases(ns):
        if group.max(time.perf_counter() - t_start) > ns.budget_s:
            why = f"skipped: the run's time budget (--budget-s {ns.budget_s:.0f}) was spent"
            emit({**bench.base(case), "error": why})
            continue
        log(
            f"{case.phase} {case.adapter} {case.layers} layers, context {case.context}, chunk {case.chunk}, "
            f"batch {case.batch}, {case.decode_mode or ''} {case.kv_mode or ''}"
        )
        emit(bench.row(case))
    if lead:
        db.write_jsonl(partial, rows)
        summary(final=True)
        drew = report.figure([r for r in rows if r.get("phase") != "indexer"], stem.with_suffix(".png"))
        print("\n".join(["", "summary"] + report.target_lines(rows)))
        print(f"wrote {partial}, {stem.with_suffix('.md')}" + (f", {stem.with_suffix('.png')}" if drew else ""))
    if group.group is not None:
        db.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
