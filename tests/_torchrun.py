"""Launching ``torchrun`` from a test: the rendezvous on loopback, so that it works on a machine without a network.

``torchrun --standalone`` names the job's master by ``socket.getfqdn()`` (``MASTER_ADDR``, which every worker's
``TCPStore`` client and process group dial), and gloo binds the interface its hostname resolves to. On a machine
whose hostname resolves to an address nothing answers on (a GPU box with no network: the torchrun demo test sat in
gloo's rendezvous until its 300 s timeout there), both wait forever. :func:`torchrun` passes
``--local-addr 127.0.0.1`` (the master's address) and :func:`loopback_env` sets ``GLOO_SOCKET_IFNAME=lo`` (the
interface of gloo's pairs) unless the caller's environment names another; the job then never leaves the host.
"""

from __future__ import annotations

import os
import sys

__all__ = ["loopback_env", "torchrun"]


def torchrun(nproc: int, *args: str, module: str | None = None) -> list[str]:
    """The argv of ``torchrun --standalone --nproc-per-node nproc [-m module] args...`` on loopback."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--local-addr", "127.0.0.1",
           "--nproc-per-node", str(nproc)]  # fmt: skip
    return cmd + (["-m", module] if module else []) + list(args)


def loopback_env(env: dict | None = None) -> dict:
    """``env`` (default ``os.environ``) with gloo bound to the loopback interface unless it names one already."""
    out = dict(os.environ if env is None else env)
    out.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return out
