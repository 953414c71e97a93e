"""The measurement harness of ``benchmarks/bench_ops.py`` and ``benchmarks/tune_ops.py``: no failure of one
candidate or row ends a run, and a captured graph's inputs live as long as the graph.

Contract:

- ``bench_ops.capture`` returns a replay that keeps every tensor its calls use alive: a CUDA graph does not own its
  inputs and ``torch.cuda.graph`` empties the allocator's cache at every capture, so a graph whose inputs were freed
  replays into unmapped memory (the illegal memory access that ended the first H200 sweep, on the same-size copies
  of the owner filter's first scenario, freed when the second scenario's copies were built).
- ``time_replays`` synchronizes each replay and names the one that fails.
- A scenario's check covers every input set it is timed on, and names the set that differs.
- ``bench_ops.run_rows`` reports a failing row and measures the others.
- ``tune_ops``: when a child process dies in a candidate (checking it or replaying it), that candidate is recorded
  as failed and the others are run again without it; the JSON, the markdown and the summary name it.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

from tests.ops_reference import backend_ok, benchmark

ROOT = Path(__file__).resolve().parent.parent
B = benchmark("bench_ops")


class _FakeStream:
    def wait_stream(self, other) -> None:
        pass


class _FakeGraph:
    """Stands in for ``torch.cuda.CUDAGraph``: like the real one, it holds no reference to what it captured."""

    replays = 0

    def replay(self) -> None:
        _FakeGraph.replays += 1


@pytest.fixture
def fake_cuda(monkeypatch):
    """``bench_ops.capture``'s CUDA path on CPU tensors (graphs that replay nothing and own nothing)."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: _FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda g, **k: contextlib.nullcontext())
    return torch.device("cuda")


def test_a_captured_replay_keeps_its_inputs_alive(fake_cuda):
    def calls_and_refs():
        src, dst = torch.arange(8), torch.empty(8, dtype=torch.int64)
        return [lambda: dst.copy_(src)], (weakref.ref(src), weakref.ref(dst))

    calls, refs = calls_and_refs()
    replay = B.capture(calls, fake_cuda)
    del calls
    gc.collect()
    assert all(r() is not None for r in refs), "the replay must keep the tensors its graph uses"
    before = _FakeGraph.replays
    replay()
    assert _FakeGraph.replays == before + 1
    del replay
    gc.collect()
    assert all(r() is None for r in refs)


def test_the_copy_groups_of_every_scenario_live_until_timed(fake_cuda, monkeypatch):
    """tune_ops' pattern: copies of scenario 0 captured, then scenario 1's built (rebinding the name), then all
    timed. Each replay still holds its buffers."""
    cpu = torch.device("cpu")
    refs = []

    def copy_groups(nbytes, device):
        x = torch.zeros(nbytes // 8)
        refs.append(weakref.ref(x))
        return [[lambda: x.add_(1)]]

    monkeypatch.setattr(B, "copy_groups", copy_groups)
    copies = []
    for _ in range(2):
        groups = B.copy_groups(64, cpu)
        copies.append([(B.capture(g, fake_cuda), len(g)) for g in groups])
    del groups
    gc.collect()
    assert all(r() is not None for r in refs)


def test_time_replays_names_the_failing_replay():
    def bad() -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    seen = []
    ok = B.Replay([lambda: None], None)
    with pytest.raises(B.ReplayError, match=r"replay 1 failed: RuntimeError: CUDA error: an illegal") as info:
        B.time_replays([(ok, 1), (B.Replay([bad], None), 1), (ok, 1)], torch.device("cpu"), 3, before=seen.append)
    assert info.value.index == 1 and seen == [0, 1]


@pytest.mark.skipif(not backend_ok("triton", "cpu"), reason="the checks run the Triton backend (interpreter)")
def test_a_check_covers_every_input_set_and_names_the_one_that_differs():
    pools = [torch.zeros(4, dtype=torch.uint8) for _ in range(3)]

    def run(i: int, be: str) -> None:
        pools[i].fill_(1 if (be == "torch" or i != 2) else 2)

    verify = B._verify_pool(pools, run, torch.device("cpu"))
    assert verify() == "input set 2 of 3: pool bytes differ from the torch backend's"
    outs = [torch.arange(3), torch.arange(3), torch.arange(3)]
    verify = B._verify_out(lambda i, be: outs[i] + (be == "triton" and i == 1), 3, torch.device("cpu"))
    assert verify() == "input set 1 of 3: output bytes differ from the torch backend's"


def test_error_summary_and_text_name_the_innermost_compile_error():
    """Triton's error for a kernel names the kernel's call site; the failing line is in the innermost
    ``CompilationError`` (of the called helper) and its cause. The summary names both, the text keeps every message,
    innermost first (the shape of the pack kernel's error on Triton 3.6)."""

    class CompilationError(Exception):
        pass

    def chain():
        try:
            try:
                raise AssertionError("Mismatched type for m between then block and else block")
            except AssertionError as e:
                raise CompilationError(
                    "at 4:4:\ndef _chunk(ptr):\n    if C + CW > SPAN:\n    ^\nAssertionError()"
                ) from e
        except CompilationError as e:
            raise CompilationError("at 34:8:\n    if lay == 0:\n        _pack_part(dst0)\n        ^") from e

    with pytest.raises(CompilationError) as info:
        chain()
    assert B.error_summary(info.value) == (
        "CompilationError: at 34:8: <- AssertionError: Mismatched type for m between then block and else block "
        "[at 4:4: if C + CW > SPAN: -> AssertionError()]"
    )
    text = B.error_text(info.value)
    assert text.index("Mismatched") < text.index("at 4:4") < text.index("at 34:8") and "_pack_part" in text


def test_run_rows_reports_a_failing_row_and_measures_the_others(monkeypatch):
    cpu = torch.device("cpu")

    def good(n, dev):
        return B.Scenario(op="ok op", tuned_op="remap", tokens=n, size=n, bytes_moved=1 << 12, target=0.9,
                          baseline="none", calls=[lambda: None], base_calls=[lambda: None], verify=lambda: None)  # fmt: skip

    def broken(n, dev):
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore")

    monkeypatch.setattr(B, "SCENARIOS", {"a": [good, broken], "b": [good]})
    results, configs, bad, failed, details = B.run_rows([16], ["a", "b"], cpu, 1)
    assert [r.op for r in results] == ["ok op", "ok op"] and bad == []
    assert failed == ["a scenario 1 at 16 tokens: RuntimeError: CUDA error: an illegal memory access was encountered"]
    assert details == [
        "a scenario 1 at 16 tokens:\n      RuntimeError: CUDA error: an illegal memory access was encountered\n      more"
    ]
    assert "Failed (not measured): 1" in B.closing_note(results, failed)


def test_run_rows_stops_after_the_context_is_lost(monkeypatch):
    cpu = torch.device("cpu")

    def broken(n, dev):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(B, "SCENARIOS", {"a": [broken], "b": [broken, broken]})
    monkeypatch.setattr(B, "context_ok", lambda dev: False)
    _, _, _, failed, _ = B.run_rows([16], ["a", "b"], cpu, 1)
    assert failed[1:] == [f"b scenario {k} at 16 tokens: not run (the CUDA context was lost at a scenario 0 at 16 "
                          "tokens)" for k in (0, 1)]  # fmt: skip


@pytest.mark.slow  # five child processes importing torch (~20-40 s on 2 busy cores)
@pytest.mark.skipif(not backend_ok("triton", "cpu"), reason="the sweep's checks run the Triton interpreter")
def test_sweep_survives_children_that_die_in_a_candidate(tmp_path):
    """One child runs both sizes of the op in turn. Candidate 0 kills it while being checked, candidate 2 while its
    graph is replayed (as an illegal memory access ends a CUDA process), at each size: all four are reported, each
    rerun covers only the sizes not finished, candidates 1 and 3 are measured at both sizes, ``--op-tokens`` gives
    the op its own sizes."""
    out = tmp_path / "tuned.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "tune_ops.py"), "--ops", "remap", "--tokens", "7",
           "--op-tokens", "remap=3,5", "--candidates", "0", "1", "2", "3", "--inject-fault", "0:check,2:time",
           "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert doc["sizes"] == {"remap": [3, 5]}
    by = {(e["tokens"], e["cand"]): e for e in doc["results"]}
    assert sorted(by) == [(n, k) for n in (3, 5) for k in range(4)]
    for n in (3, 5):
        assert by[(n, 0)]["error"].startswith("crashed the process (check)")
        assert by[(n, 2)]["error"].startswith("crashed the process (time)")
        assert by[(n, 1)]["error"] is None and by[(n, 3)]["error"] is None and "score" in by[(n, 3)]
    assert sorted(doc["tuned"]["remap"]) == ["192", "320"]  # sizes of 3 and 5 tokens: top-k 64 indices
    assert len(doc["notes"]) == 4 and all("rerun without it" in n for n in doc["notes"])
    summary = proc.stdout[proc.stdout.index("Summary") :]
    assert summary.count("failed {") == 4 and "crashed the process (time)" in summary
    assert "crashed the process (check)" in out.with_suffix(".md").read_text()


@pytest.mark.slow  # a child process importing torch
@pytest.mark.skipif(not backend_ok("triton", "cpu"), reason="the sweep's checks run the Triton interpreter")
def test_sweep_keeps_a_failing_candidates_whole_error(tmp_path):
    """A candidate that raises a chained error (as a kernel that does not compile does: Triton's message names the
    call site, the cause is inside the called function) is reported with the whole chain, innermost cause first: in
    the log, in the JSON (``error_detail``) and in the markdown; the one-line ``error`` names both ends."""
    out = tmp_path / "tuned.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "tune_ops.py"), "--ops", "remap", "--tokens", "3",
           "--candidates", "1", "--inject-fault", "1:raise", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (entry,) = json.loads(out.read_text())["results"]
    assert entry["error"] == (
        "RuntimeError: at 34:8: the call site (injected) <- AssertionError: Mismatched type for m between then block "
        "and else block (injected)"
    )
    assert entry["error_detail"].index("Mismatched type") < entry["error_detail"].index("the call site")
    assert proc.stdout.count("Mismatched type for m") >= 2  # the child's log line and the summary
    assert "Mismatched type for m" in out.with_suffix(".md").read_text()
