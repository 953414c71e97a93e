"""Starting the demo's prefill group: ``--cp`` spawned gloo/NCCL ranks, or one job on torchrun's process group.

:func:`spawn` starts the ranks (FileStore rendezvous, no ports) and collects each one's result; :func:`join_torchrun`
runs this process as one rank of a torchrun job and gathers every rank's result as JSON (no pickle on received
data). Each rank runs :func:`dtkv.demo._run.run_rank`.

The ranks, and ``--pd``'s decode ranks (:mod:`dtkv.demo._pd`), start from
:func:`dtkv.demo._procs.process_context` (a fork server that imported torch and the model's modules once).
"""

from __future__ import annotations

import json
import os
import queue as queue_mod
import tempfile
import time

from dtkv._log import phase, progress, setup_cli_logging
from dtkv.demo._procs import drain, process_context, rank_threads, remove_store_file, silent_rank

__all__ = ["join_torchrun", "json_all_gather", "rank_error", "spawn"]


def _rank_main(rank: int, world: int, args: dict, init_file: str | None = None) -> dict:
    import torch
    import torch.distributed as dist

    from dtkv.demo._run import run_rank

    use_cuda = args["device"] == "cuda"
    local_rank = args.get("local_rank", rank)
    if init_file is not None:
        if use_cuda:
            torch.cuda.set_device(local_rank)
        dist.init_process_group(
            "nccl" if use_cuda else "gloo", store=dist.FileStore(init_file, world), rank=rank, world_size=world,
            device_id=torch.device("cuda", local_rank) if use_cuda else None,  # NCCL: no guessing the GPU
        )  # fmt: skip
    try:
        group = dist.group.WORLD if world > 1 else None
        device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
        progress("ranks up: %d x %s, %s", world, "nccl" if use_cuda else "gloo", device)
        return run_rank(rank, world, args, group, device)
    finally:
        if init_file is not None:
            dist.barrier()
            dist.destroy_process_group()


def rank_error(rank: int, e: BaseException) -> dict:
    """A rank's failure as its result: the error with its traceback, and ``usage`` when the error is a rule of
    the run's flags that every rank meets alike (the attention backend does not fit the model), which the parent
    reports as one usage error (exit code 2) rather than a failure per rank."""
    import traceback

    from dtkv.attention import AttentionFitError

    if isinstance(e, AttentionFitError):
        return {"rank": rank, "error": str(e), "usage": True}
    return {"rank": rank, "error": f"{type(e).__name__}: {e}\n{''.join(traceback.format_exception(e))}", "usage": False}


def _worker(rank: int, world: int, args: dict, init_file: str, out) -> None:
    rank_threads()
    setup_cli_logging(rank=rank, side="prefill" if args.get("pd") else None)
    try:
        out.put(_rank_main(rank, world, args, init_file))
    except BaseException as e:  # report, never hang the parent
        out.put(rank_error(rank, e))


def spawn(args: dict, watch=None) -> list[dict]:
    """Run ``args["cp"]`` ranks as spawned processes; every rank's result (or error), in rank order.

    The ranks are given up on after ``--timeout`` seconds; they learn that deadline (``args["deadline_unix"]``) so
    that their own bounded waits end, and report, before it. ``watch()`` (``--pd``: the decode group's
    :meth:`dtkv.demo._pd.DecodeGroup.failure`) is polled meanwhile: once it names a failure the ranks, which could
    only wait for a decode group that is gone, are stopped at once and the failure is their result.
    """
    world = args["cp"]
    args = {**args, "deadline_unix": time.time() + args["timeout"]}
    ctx = process_context(args)
    results = ctx.Queue()
    fd, init_file = tempfile.mkstemp(prefix="dtkv_demo_")
    os.close(fd)
    os.unlink(init_file)
    with phase(f"starting {world} rank(s)"):
        procs = [ctx.Process(target=_worker, args=(r, world, args, init_file, results), daemon=True)
                 for r in range(world)]  # fmt: skip
        for p in procs:
            p.start()
    got: list[dict] = []
    deadline = args["deadline_unix"]
    while len(got) < world and time.time() < deadline:
        try:
            got.append(results.get(timeout=1.0))
        except queue_mod.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                break
        failed = watch() if watch is not None else None
        if failed and len(got) < world:
            got.append({"rank": -1, "error": f"the decode group failed, so the prefill ranks were stopped: {failed}"})
            break
    killed = set()
    for r, p in enumerate(procs):
        p.join(timeout=0 if any(g["rank"] == -1 for g in got) else 10)
        if p.is_alive():
            killed.add(r)
            p.kill()
            p.join(timeout=10)
    remove_store_file(init_file)
    got += drain(results, world - len(got))  # what a rank put while the others were joined
    if len(got) < world and not any(g["rank"] == -1 for g in got):
        reported = {g["rank"] for g in got}
        late = time.time() >= deadline
        got += [{"rank": r, "error": silent_rank(r, None if r in killed else procs[r].exitcode, args["timeout"], late)}
                for r in range(world) if r not in reported]  # fmt: skip
    return sorted(got, key=lambda r: r["rank"])


def json_all_gather(obj: object, group) -> list:
    """Every rank's JSON-serializable ``obj``, in rank order (as bytes: no pickle on received data)."""
    import torch
    import torch.distributed as dist

    data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64), group=group)
    width = max(int(n) for n in sizes)
    bufs = [torch.zeros(width, dtype=torch.uint8) for _ in sizes]
    dist.all_gather(bufs, torch.cat([data, data.new_zeros(width - data.numel())]), group=group)
    return [json.loads(bytes(b[: int(n)].tolist()).decode()) for b, n in zip(bufs, sizes)]


def join_torchrun(args: dict, rank: int, world: int, local_rank: int, start_decode=None):
    """One rank of a torchrun job: join torchrun's group, run, gather every rank's result (JSON).

    ``start_decode(args)`` (rank 0, ``--pd``) starts the decode group; its rendezvous arguments reach every rank.

    Returns:
        ``(results, wall seconds, decode group or None)``.
    """
    import datetime

    import torch
    import torch.distributed as dist

    use_cuda = args["device"] == "cuda"
    if use_cuda:
        torch.cuda.set_device(local_rank)
    timeout = datetime.timedelta(seconds=args["timeout"])
    device_id = torch.device("cuda", local_rank) if use_cuda else None  # NCCL: no guessing the GPU by rank
    with phase(f"ranks up ({world} x {'nccl' if use_cuda else 'gloo'}, torchrun)"):
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timeout, device_id=device_id)
        meta = dist.new_group(backend="gloo", timeout=timeout)  # results travel on their own CPU group
    pd = None
    try:
        if args["pd"]:
            if rank == 0:
                pd = start_decode(args)
            args.update(json_all_gather(pd.rank_args if pd is not None else None, meta)[0])
        t0 = time.perf_counter()
        try:
            result = _rank_main(rank, world, {**args, "local_rank": local_rank})
        except Exception as e:  # report through the exchange, so rank 0 prints the error
            result = rank_error(rank, e)
        results = json_all_gather(result, meta)
        wall = time.perf_counter() - t0
        progress("results gathered from %d ranks", world)
    finally:
        dist.destroy_process_group()
    return results, wall, pd
