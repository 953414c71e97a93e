"""CPU smoke of ``benchmarks/bench_decode.py`` on 2 gloo ranks (tiny geometry): both modes run on the same pool
and agree, the full-view baseline's views equal the owners' bytes (``verify``), sharded traffic is the candidates
plus the partials whatever the context, the full view's grows with it, and the result files are written.

Agreement: the two modes score the same fp8/bf16 bytes in float32 over differently shaped GEMMs (~1e-7 relative
noise); with 48 of at most 160 keys selected, a swap at the K-th place needs two scores within that noise (~1e-5
chance per query for these fixed seeds), so selections must agree and outputs differ by less than 1e-5 relative.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from dtkv.decode import sharded_decode_comm_bytes

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_decode.py"
OPTS = {"contexts": [40, 160], "batches": [1, 3], "reps": 1, "warmup": 0, "smoke": True, "print": False, "verify": True}


def _load():
    if "bench_decode" in sys.modules:
        return sys.modules["bench_decode"]
    spec = importlib.util.spec_from_file_location("bench_decode", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_decode"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _bench_rank(rank, world, opts):
    import torch.distributed as dist

    return _load().run(rank, world, opts, group=dist.group.WORLD)


@pytest.mark.multirank
def test_bench_decode_smoke_on_two_gloo_ranks(ranks2, tmp_path, monkeypatch):
    rows = ranks2.run(_bench_rank, OPTS)[0]
    bench = _load()
    geom = bench.SMOKE
    assert len(rows) == 2 * 2 * 2
    sent = {}
    for r in rows:
        assert r["cp"] == 2 and r["layers"] == geom.num_layers and r["step_ms"] > 0
        assert r["topk_agree"] == 1.0 and r["out_rel_diff"] < 1e-5
        sent[(r["mode"], r["context"], r["batch"])] = r["bytes_sent_per_step"]
        if r["mode"] == "sharded":
            want = sharded_decode_comm_bytes(
                num_queries=r["batch"], topk=geom.topk, num_heads=geom.num_heads, kv_lora_rank=geom.kv_lora_rank,
                cp_size=2,
            )  # fmt: skip
            assert r["bytes_sent_per_step"] == want.sent * geom.num_layers and r["scratch_bytes_per_rank"] == 0
        else:
            assert r["scratch_bytes_per_rank"] > 0
    for b in OPTS["batches"]:
        assert sent[("sharded", 40, b)] == sent[("sharded", 160, b)]  # independent of context length
        assert sent[("full_view", 160, b)] > sent[("full_view", 40, b)] > sent[("sharded", 40, b)]
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    paths = bench.write_results(rows, tmp_path / "results", "python benchmarks/bench_decode.py --smoke")
    assert [p.name for p in paths[:2]] == [
        f"decode_cpux2_{rows[0]['date']}.jsonl",
        f"decode_cpux2_{rows[0]['date']}.md",
    ]
    assert len(paths) == 4 and all(p.exists() for p in paths)  # results dir and $OUT
    md = paths[1].read_text()
    assert "| context | batch | sharded ms |" in md and md.count("\n| 160 |") == 2
