"""PD end to end over loopback, once per engine (Mooncake TCP, NIXL/UCX): the reference model's CP prefill (2 and 4
gloo ranks, sharded KV) hands its requests to a decode process, whose received KV is bitwise the replicated
baseline's and whose generated tokens equal the single-process reference."""

from __future__ import annotations

import pytest
import torch

from dtkv.model import ModelConfig, ReferenceAdapter
from dtkv.runtime import Runtime

pytestmark = [pytest.mark.multirank]

PROMPT_LENS = (101, 47, 6)  # three chunks, one and a partial page, a short request
CHUNK = 40
STEPS = 3
NUM_PAGES = 96


def _prompts(cfg):
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _engine(cfg, mode, group, page_major=False):
    eng = Runtime(ReferenceAdapter(cfg), group=group, mode=mode, num_pages=NUM_PAGES, page_major=page_major)
    for p in _prompts(cfg):
        eng.add_request(p)
    eng.prefill(CHUNK)
    return eng


def _prefill_rank(rank, world, args, mode):
    import torch.distributed as dist

    from dtkv.demo._pd import send_from_rank
    from dtkv.runtime.pd import kv_digest

    cfg = ModelConfig(kv_dtype=args["kv_dtype"], page_size=args["page_size"])
    base = _engine(cfg, "replicated", dist.group.WORLD)
    baseline = kv_digest([base.kv_bytes(r.rid) for r in base.requests], [len(r.prompt) for r in base.requests])
    eng = _engine(cfg, mode, dist.group.WORLD, page_major=args["page_major"] in ("both", "prefill"))
    return {**send_from_rank(eng, args), "baseline_kv_digest": baseline, "page_major": eng.pool.page_major}


@pytest.mark.parametrize(
    "world,mode,kv_dtype,page_major",
    [(2, "sharded_direct", "fp8", None), (4, "sharded", "bf16", None), (2, "sharded_direct", "fp8", "both"),
     (2, "sharded_direct", "fp8", "decode")],
    ids=["world2-direct-fp8", "world4-bf16", "world2-page-major", "world2-layer-major-into-page-major"],
)  # fmt: skip
def test_pd_decode_matches_baseline_and_reference(ranks2, ranks4, world, mode, kv_dtype, page_major, transfer_engine):
    """``page_major``: the demo's ``--page-major`` (``both``: every pool; ``decode``: the decode group's only)."""
    from dtkv.demo._pd import start_decode_group

    ranks = ranks2 if world == 2 else ranks4
    args = {"model": "reference", "seed": 0, "dtype": None, "page_size": 4, "kv_dtype": kv_dtype,
            "decode_steps": STEPS, "timeout": 60.0, "decode": "full", "decode_cp": 1, "attention": "torch",
            "transfer_engine": transfer_engine, "page_major": page_major}  # fmt: skip
    cfg = ModelConfig(kv_dtype=kv_dtype, page_size=4)
    decode = start_decode_group(args, _prompts(cfg))
    results = ranks.run(_prefill_rank, {**args, **decode.rank_args}, mode)
    (got,) = decode.result(timeout_s=60.0)
    assert "error" not in got, got.get("error")
    ref = _engine(cfg, "single", None)
    assert got["outputs"] == ref.decode(STEPS), "decode's tokens must equal the single-process reference"
    assert all(r["baseline_kv_digest"] == r["pd_kv_digest"] == got["kv_digest"] for r in results), (
        "decode's KV must equal the replicated baseline's"
    )
    assert all(r["pd_engine"] == transfer_engine for r in results)
    assert all(r["page_major"] is (page_major in ("both", "prefill")) for r in results)
    assert got["page_major"] is (page_major in ("both", "decode"))
    assert sum(r["pd_bytes"] for r in results) > 0 and got["entries"] == sum(r["pd_entries"] for r in results)
