"""``python -m dtkv.demo --decode sharded``: the sharded run decodes on its shards and reports parity against the
replicated baseline's full-view decode (tokens, KV bytes, decode logits within 1e-9 relative: see
``tests/test_decode_model.py`` for why that tolerance)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dtkv.decode import sharded_decode_comm_bytes
from dtkv.model import ModelConfig
from tests._failure import failure_text


@pytest.mark.multirank
def test_demo_decode_sharded_json_reports_parity_with_full_view_decode():
    cmd = [sys.executable, "-m", "dtkv.demo", "--json", "--decode", "sharded", "--kv-dtype", "fp8"]
    cmd += ["--tokens", "300", "--chunk", "128", "--decode-steps", "5"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, failure_text(out)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["parity"] is True and res["decode"] == "sharded"
    assert res["decode_logits_max_rel"] <= 1e-9
    cfg = ModelConfig()
    per_layer = sharded_decode_comm_bytes(
        num_queries=2, topk=cfg.index_topk, num_heads=cfg.num_heads, kv_lora_rank=cfg.kv_lora_rank, cp_size=2,
        partial_itemsize=8,
    )  # fmt: skip
    assert res["decode_comm_bytes_per_step"] == per_layer.sent * cfg.num_layers
    assert len(res["generated"][0]) == 6


def test_demo_rejects_an_unknown_decode_mode():
    out = subprocess.run(
        [sys.executable, "-m", "dtkv.demo", "--decode", "view"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and "invalid choice: 'view'" in out.stderr
