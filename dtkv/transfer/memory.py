"""Which memory a transfer engine can register: host memory always, device (CUDA) memory depending on the build.

A side whose pool lives in memory its engine cannot register hands its pages over through pinned host memory
instead (:mod:`dtkv.transfer.handoff`). What each engine build does with device memory:

- **Mooncake, non-cuda wheel** (``mooncake-transfer-engine-non-cuda``, also ``-efa-non-cuda``): host memory only.
  Registering a device pointer returns 0 (the build records the range without checking it), and the first write
  from or into it fails at once with -1 (its TCP transport's ``writev``/``readv`` on a device address: glog prints
  ``writeBody failed ... Bad address``). :meth:`dtkv.transfer.MooncakeEngine.register` refuses such memory up front
  instead, naming the build.
- **Mooncake, CUDA builds** (``mooncake-transfer-engine`` for CUDA 12, ``-cuda13``, ``-efa``, ``-efa-cuda13``): device
  memory registers directly. Over TCP each 64 KiB slice is copied through a host buffer by the engine itself
  (``cudaMemcpy`` per slice, synchronous); over RDMA the NIC reads and writes GPU memory (GPUDirect RDMA, which
  needs the ``nvidia-peermem`` module).
- **NIXL** with UCX's CUDA transports (``cuda_copy``, ``cuda_ipc``, ``gdr_copy``) registers VRAM segments directly.
- :class:`dtkv.transfer.LocalEngine` (the in-process twin): host memory only (it copies with ``memmove``).

An installed Mooncake is recognised by the distribution that installed the ``mooncake`` package; a build without
that metadata (from source) counts as a CUDA build when its ``engine`` library names the CUDA runtime
(``libcudart``).
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
from collections.abc import Iterable

import torch

__all__ = [
    "MOONCAKE_DEVICE_MEMORY_BUILDS",
    "is_device_memory",
    "mooncake_build",
    "mooncake_registers_device_memory",
    "needs_host_staging",
]

MOONCAKE_DEVICE_MEMORY_BUILDS = (
    "mooncake-transfer-engine",
    "mooncake-transfer-engine-cuda13",
    "mooncake-transfer-engine-efa",
    "mooncake-transfer-engine-efa-cuda13",
)
"""Mooncake distributions (PyPI names) whose engine registers CUDA memory."""


def is_device_memory(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` lives outside host memory (a CUDA tensor, say)."""
    return tensor.device.type != "cpu"


@functools.cache
def mooncake_build() -> str:
    """The distribution that installed the ``mooncake`` package (``"mooncake-transfer-engine-non-cuda"``, ...), or
    ``""`` when none is installed or its metadata is missing (a build from source)."""
    try:
        names = importlib.metadata.packages_distributions().get("mooncake", [])
    except Exception:  # noqa: BLE001 - unreadable metadata: unknown build
        return ""
    engines = sorted(n for n in names if n.lower().replace("_", "-").startswith("mooncake-transfer-engine"))
    return engines[0].lower().replace("_", "-") if engines else ""


@functools.cache
def _engine_links_cuda_runtime() -> bool:
    """Whether the ``mooncake`` package's ``engine`` library names the CUDA runtime (a build from source)."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        return False
    for root in spec.submodule_search_locations:
        for name in sorted(os.listdir(root)):
            if name.startswith("engine") and name.endswith(".so"):
                with open(os.path.join(root, name), "rb") as f:
                    if b"libcudart.so" in f.read():
                        return True
    return False


def mooncake_registers_device_memory() -> bool:
    """Whether the installed Mooncake registers CUDA memory (see the module docstring)."""
    build = mooncake_build()
    if build:
        return build in MOONCAKE_DEVICE_MEMORY_BUILDS
    return _engine_links_cuda_runtime()


def needs_host_staging(tensors: Iterable[torch.Tensor], engine=None) -> bool:
    """Whether any of ``tensors`` lies in memory ``engine`` cannot register (``engine=None``: the
    :class:`dtkv.transfer.MooncakeEngine` a transfer side creates by default, judged from the installed build; an
    engine without ``can_register`` registers host memory only)."""
    can_register = getattr(engine, "can_register", None)
    for t in tensors:
        if engine is not None:
            if is_device_memory(t) if can_register is None else not can_register(t):
                return True
        elif is_device_memory(t) and not (t.device.type == "cuda" and mooncake_registers_device_memory()):
            return True
    return False
