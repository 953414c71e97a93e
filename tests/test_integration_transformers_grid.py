"""The full parity grid of the transformers integration: both models x both splits x bf16/fp8 KV x page sizes
1/16/64 x 2, 3 and 4 gloo ranks (72 runs: 5 min on 2 cores, 15 when the machine is busy), so it runs only with
``DTKV_TEST_LONG=1``; ``tests/test_integration_transformers.py`` runs a covering subset on every CI run.
The criteria are those of that module. ``DTKV_TEST_GRID_LOG=path`` appends one JSON line per run (measured
differences and timings).
"""

from __future__ import annotations

import itertools
import json
import os

import pytest

pytest.importorskip("transformers", reason="the hf extra (transformers==5.17.0)")

from tests.test_integration_transformers import check_parity, cp_run, rank_groups, summarize  # noqa: E402, F401

LONG = os.environ.get("DTKV_TEST_LONG", "0") == "1"
GRID = list(
    itertools.product(("deepseek-v32", "glm5"), ("zigzag", "round_robin"), ("bf16", "fp8"), (1, 16, 64), (2, 3, 4))
)


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.skipif(not LONG, reason="set DTKV_TEST_LONG=1 to run the full grid")
@pytest.mark.parametrize(("name", "split", "kv_dtype", "page_size", "world"), GRID, ids=lambda v: str(v))
def test_full_grid(rank_groups, name, split, kv_dtype, page_size, world):  # noqa: F811
    results = rank_groups(world).run(cp_run, name, split, kv_dtype, page_size)
    summary = summarize(results, name, kv_dtype)
    log = os.environ.get("DTKV_TEST_GRID_LOG")
    if log:  # one JSON line per case, e.g. to tabulate measured bounds and timings
        with open(log, "a") as f:
            f.write(json.dumps({"case": [name, split, kv_dtype, page_size, world], **summary}) + "\n")
    check_parity(summary, split, page_size)
