"""Shared plumbing of the torchrun benchmarks (``bench_materialize.py``, ``bench_runtime.py``).

Process-group setup (NCCL on GPUs, gloo on CPUs), event timing, where results go (``$OUT`` when the runner sets it,
else ``benchmarks/results/``), and file names that state the hardware and the date.
"""

from __future__ import annotations

import datetime
import json
import os
import random
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from dtkv._log import progress, setup_cli_logging

RESULTS = Path(__file__).resolve().parent / "results"

# Two GPUs of one host: no NVLink SHARP multicast (the anchors were measured so, and symmetric memory works without).
for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)


def init(device_kind: str = "auto") -> tuple[int, int, torch.device]:
    """Join the torchrun group: NCCL with one GPU per rank when CUDA is there (and not refused), else gloo.

    A process group that already exists (tests) is used as it is; :func:`finish` then leaves it alone.
    """
    global _OWNED
    setup_cli_logging()  # progress lines on stderr (DTKV_LOGLEVEL), results stay on stdout
    cuda = torch.cuda.is_available() and device_kind != "cpu"
    if not dist.is_initialized():
        _OWNED = True
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if cuda else "gloo")
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    progress("ranks up: %d x %s (%s)", dist.get_world_size(), dev.type, dist.get_backend())
    return dist.get_rank(), dist.get_world_size(), dev


_OWNED = False


def finish() -> None:
    """Destroy the process group if :func:`init` created it."""
    if _OWNED and dist.is_initialized():
        dist.destroy_process_group()


def hardware_tag(device: torch.device, world: int) -> str:
    """``h200x2`` style: the GPU model and the number of ranks (``cpu`` on CPUs)."""
    if device.type != "cuda":
        return f"cpux{world}"
    name = torch.cuda.get_device_name(device).lower()
    for model in ("h200", "h100", "h800", "h20", "b200", "gb200", "a100"):
        if model in name:
            return f"{model}x{world}"
    return f"{name.split()[-1]}x{world}"


def out_dir(explicit: str | None = None) -> Path:
    """``--out-dir``, else ``$OUT`` (the device runner copies it back), else ``benchmarks/results``."""
    path = Path(explicit or os.environ.get("OUT") or RESULTS)
    path.mkdir(parents=True, exist_ok=True)
    return path


def today() -> str:
    return datetime.date.today().isoformat()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def barrier(device: torch.device, group=None) -> None:
    """Every rank here, with its device idle."""
    sync(device)
    if device.type == "cuda":
        dist.barrier(group, device_ids=[device.index])
    else:
        dist.barrier(group)
    sync(device)


def time_once(fn: Callable[[], object], device: torch.device, group=None) -> float:
    """Milliseconds of one call, every rank starting together (device events on CUDA, wall clock on CPU)."""
    barrier(device, group)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def median_ms(fn: Callable[[], object], device: torch.device, reps: int, group=None) -> float:
    return statistics.median(time_once(fn, device, group) for _ in range(reps))


def p90(values: Sequence[float]) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(0.9 * (len(s) - 1)))]


def paired_overhead(values: Sequence[float], refs: Sequence[float], *, reps: int = 2000, seed: int = 0) -> dict:
    """Overhead of ``values`` over ``refs`` from paired samples (``values[i]`` and ``refs[i]`` measured back to back).

    Per pair the ratio ``values[i] / refs[i] - 1``; returns its median (``overhead``), the 95% percentile-bootstrap
    interval of that median (``ci95``: ``reps`` resamples of the pairs, seeded), the mean, the spread
    (``stdev``) and ``n``. Pairing cancels what drifts slowly across a run (clocks, power, temperature): the
    interval measures what is left.

    Raises:
        ValueError: the lists differ in length or are empty, or a reference is not positive.
    """
    if len(values) != len(refs) or not values:
        raise ValueError(f"values and refs must be non-empty and of equal length, got {len(values)} and {len(refs)}")
    if min(refs) <= 0:
        raise ValueError(f"refs must be positive, got min(refs)={min(refs)}")
    ratios = [v / r - 1 for v, r in zip(values, refs)]
    rng = random.Random(seed)
    boots = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(reps))
    lo, hi = boots[int(0.025 * reps)], boots[min(reps - 1, int(0.975 * reps))]
    return {
        "overhead": statistics.median(ratios),
        "ci95": (lo, hi),
        "mean": statistics.fmean(ratios),
        "stdev": statistics.stdev(ratios) if len(ratios) > 1 else 0.0,
        "n": len(ratios),
    }


def verdict(ci95: tuple[float, float], target: float) -> str:
    """``"met"`` when the whole interval is at or below ``target``, ``"not met"`` when it is above, else
    ``"inconclusive"``."""
    if ci95[1] <= target:
        return "met"
    if ci95[0] > target:
        return "not met"
    return "inconclusive"


def write_jsonl(path: Path, rows: Sequence[dict]) -> None:
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row, sort_keys=False) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def versions() -> dict[str, str]:
    out = {"torch": torch.__version__}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        pass
    return out
