"""Every Triton kernel of ``dtkv.ops`` compiles for the GPU (sm_90: H100/H200), checked without one.

The CPU tests run the kernels under the Triton interpreter, which compiles nothing: a kernel can pass them all and
still fail to compile on the GPU (the pack kernel did, on Triton 3.6 and 3.7: ``SPAN = W // PARTS`` made a runtime
scalar of a constant, so a ``constexpr`` branch on it became a runtime branch whose sides differ in shape).
``benchmarks/compile_ops.py`` compiles, through the installed Triton's own compiler down to a cubin, every kernel
launch the ops make under the default, tuned and per-path configurations, on the benchmark's geometries and awkward
ones, with int32 and forced int64 offsets. It skips (exit 2, the reason printed) where this Triton cannot compile
for CUDA at all; any kernel that does not compile, or that no case reaches, fails the test with the compiler's
message.

Contract: ``test_every_kernel_compiles_for_sm90`` fails when any kernel of ``ops/`` does not compile for sm_90, or
when a quantizer's fp8 conversion is not the saturating one its missing clamp relies on, or when a kernel breaks
its op's build rules (``check_sm90_build`` of ``test_ops_indexer_logits.py`` and ``test_ops_logits_topk.py``:
wgmma, registers, no spills);
``test_the_offline_compiler_reports_a_kernel_that_does_not_compile`` shows that the harness fails on the exact
pattern of the pack kernel's error and passes its fix.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "compile_ops.py"
CANNOT = 2


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # compile for real, not from an earlier run's cache
    return env


def _run(cmd: list[str], tmp_path: Path, timeout: int) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, env=_env(tmp_path), capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode == CANNOT:
        pytest.skip(f"Triton cannot compile for sm_90 here: {proc.stdout.strip().splitlines()[-1]}")
    return proc


@pytest.mark.slow  # ~150 distinct kernels through ptxas: 60-100 s on 2 busy cores
@pytest.mark.build  # CI's own step (`python -m pytest -m build`), outside the suite's default selection
def test_every_kernel_compiles_for_sm90(tmp_path):
    out = tmp_path / "compile.json"
    proc = _run([sys.executable, str(SCRIPT), "--int64", "--json", str(out)], tmp_path, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-20000:] + proc.stderr[-5000:]
    records = json.loads(out.read_text())["records"]
    kernels = {r["kernel"] for r in records}
    want = {"_write_owned_kernel", "_write_owned_window_kernel", "_quantize_write_mla_fp8_kernel",
            "_quantize_write_indexer_fp8_kernel", "_pack_layer_pages_kernel", "_remap_kernel", "_map16_kernel",
            "_logits_topk_select_kernel", "_quantize_indexer_queries_kernel", "_keys_topk_hist_kernel",
            "_keys_topk_select_kernel", "_keys_topk_rank_kernel", "_group_max_kernel", "_candidates_kernel",
            "_overflow_rows_kernel", "_dequantize_mla_rows_kernel", "_rope_interleave_kernel"}  # fmt: skip
    assert want <= kernels, sorted(want - kernels)
    assert all(r["ok"] for r in records)
    constants = [r["constexprs"] for r in records if r["kernel"] == "_pack_layer_pages_kernel"]
    assert any(c["OFF64"] == "True" for c in constants) and any(c["PARTS"] == "4" for c in constants)
    # the quantizers leave saturation at +-448 to the conversion (ops/_common.py e4m3_bits): it must saturate
    for r in records:
        if r["kernel"].startswith(("_quantize_write", "_quantize_indexer_queries")):
            assert r["fp8_converts"] == ["cvt.rn.satfinite.e4m3x2.f32"], (r["kernel"], r["fp8_converts"])
    # the ops' own build rules (wgmma, registers, no spills), checked on this one build of every kernel
    from tests import test_ops_indexer_logits, test_ops_logits_topk

    test_ops_indexer_logits.check_sm90_build(records)
    test_ops_logits_topk.check_sm90_build(records)


BROKEN = """
import triton
import triton.language as tl


@triton.jit
def _chunk(ptr, C: tl.constexpr, CW: tl.constexpr, SPAN: tl.constexpr):
    cols = C + tl.arange(0, CW)
    if C + CW > SPAN:
        m = (cols < SPAN)[None, :]
    else:
        m = tl.full((1, 1), 1, tl.int1)
    return tl.load(ptr + cols[None, :], mask=m, other=0)


@triton.jit
def broken_kernel(x_ptr, out_ptr, W: tl.constexpr, PARTS: tl.constexpr):
    SPAN = W // PARTS  # a plain assignment: a runtime scalar to Triton's code generator
    tl.store(out_ptr + tl.arange(0, 64)[None, :], _chunk(x_ptr, 0, 64, SPAN))


@triton.jit
def fixed_kernel(x_ptr, out_ptr, W: tl.constexpr, PARTS: tl.constexpr):
    SPAN: tl.constexpr = W // PARTS
    tl.store(out_ptr + tl.arange(0, 64)[None, :], _chunk(x_ptr, 0, 64, SPAN))
"""

DRIVER = """
import json, sys
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, sys.argv[2])
import compile_ops as C
why = C.cannot_compile_reason(90)
if why is not None:
    print(why)
    sys.exit(2)
import torch
import kernels
comp = C.OfflineCompiler(90)
x = torch.zeros(64, dtype=torch.int64)
with comp.patch():
    kernels.broken_kernel[(1,)](x, x, W=64, PARTS=1)
    kernels.fixed_kernel[(1,)](x, x, W=64, PARTS=1)
print(json.dumps(comp.records))
"""


def test_the_offline_compiler_reports_a_kernel_that_does_not_compile(tmp_path):
    """The pack kernel's error, reduced: the broken form is reported with the compiler's innermost message and the
    helper's failing line; the annotated form compiles."""
    (tmp_path / "kernels.py").write_text(BROKEN)
    (tmp_path / "driver.py").write_text(textwrap.dedent(DRIVER))
    proc = _run([sys.executable, str(tmp_path / "driver.py"), str(ROOT / "benchmarks"), str(tmp_path)], tmp_path, 600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    broken, fixed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (broken["kernel"], broken["ok"]) == ("broken_kernel", False)
    innermost = broken["error"].split("--- raised from ---")[0]  # the helper's error comes first
    assert "if C + CW > SPAN:" in innermost and "Mismatched type for m between then block" in innermost
    assert (fixed["kernel"], fixed["ok"]) == ("fixed_kernel", True)


def test_the_ops_build_rules_refuse_what_breaks_them():
    """``check_sm90_build`` of the op tests (called on the one build above) fails on a spilling kernel, a dot
    that is not a ``wgmma`` and too many registers, and passes records that keep every rule."""
    from tests import test_ops_indexer_logits, test_ops_logits_topk

    def logits(**kw):
        const = {"NH": "64", "J": "128", "BQ": "2", "KEYS_M": "True", "SPLIT": "False", "GROUP": "0"}
        const.update(kw.pop("constexprs", {}))
        rec = {"kernel": "_indexer_logits_kernel", "where": "indexer_logits defaults | case", "ok": True, "local": 0,
               "wgmma": 4, "registers": 160, "smem": 40000, "num_warps": 4, "constexprs": const}  # fmt: skip
        return {**rec, **kw}

    paths = [logits(constexprs={"GROUP": "16"}), logits(constexprs={"SPLIT": "True"})]  # the epilogue's maxima, split

    cfg = test_ops_logits_topk._mod.KERNEL_CONFIG

    def topk(**kw):
        return {"kernel": "_logits_topk_select_kernel", "where": "logits_topk defaults | case", "ok": True,
                "local": 0, "registers": 60, "num_warps": cfg["num_warps"], "constexprs": {"BLOCK": str(cfg["block"])},
                **kw}  # fmt: skip

    test_ops_indexer_logits.check_sm90_build([logits(), logits(where="x | int64 offsets", local=8), *paths])
    test_ops_logits_topk.check_sm90_build([topk(), topk(where="x | int64 offsets", registers=200)])
    for bad in (logits(local=16), logits(wgmma=0), logits(registers=200), logits(ok=False)):
        with pytest.raises(AssertionError):
            test_ops_indexer_logits.check_sm90_build([bad, *paths])
    for built in paths:  # a build without the maxima's epilogue, or without the split dots, proves nothing of them
        with pytest.raises(AssertionError):
            test_ops_indexer_logits.check_sm90_build([logits(), built])
    too_many = 65536 // (64 * cfg["num_warps"]) + 1  # registers a thread: fewer than two programs an SM
    for bad in (topk(local=16), topk(registers=too_many), topk(num_warps=2 * cfg["num_warps"])):
        with pytest.raises(AssertionError):
            test_ops_logits_topk.check_sm90_build([bad])
    with pytest.raises(AssertionError):
        test_ops_logits_topk.check_sm90_build([])  # a build without the kernel proves nothing
