"""Compiled forwards for a transformers DSA model's per-layer norms and MLP / MoE blocks, and the attention's
projections (``TransformersAdapter(compile_modules=...)``).

A decode step of the model's own modules is a hundred and more small kernels a layer: each RMSNorm is six elementwise
kernels and a reduction, the MoE's routing a dozen more. Inside a CUDA graph they still cost a few microseconds
each, which at decode's few rows is most of a layer's time outside its GEMMs and attention. ``torch.compile``
fuses each module's elementwise work into a few Triton kernels; the modules keep their weights and their math
(float32 norms as transformers writes them), and the adapter's bound attention stays eager around them.

What :func:`compile_targets` takes, per decoder layer: ``input_layernorm``, ``post_attention_layernorm`` and
``mlp`` (a dense MLP, or a MoE block whose experts are sync-free: not transformers' ``"eager"`` experts, nor
``"grouped_mm"`` with weights its CUDA kernels do not take,
:func:`dtkv.integrations.transformers.adapter._experts_graph_reason`). The attention's own work before the cache
(its projections, ``q_a_layernorm`` and ``kv_a_layernorm``, both ropes, the indexer's rows:
:func:`dtkv.integrations.transformers.attention.projections`) compiles as one function,
:func:`compiled_function`, its modules passed as arguments. Each is compiled with ``fullgraph=True`` (one graph
per module class and shape family: the instances of a class share it, their parameters are the graph's inputs;
sizes that change between calls become dynamic after the first change).

Where the original forward runs instead: whenever the adapter's ``when`` says so (the adapter compiles decode
steps only: at a prefill chunk's thousands of rows the eager kernels are already large, and the compiled forwards
measured slower there: 81.0K against 85.8K tokens/s for a 32K prompt in 8K chunks on one H200, 2026-12-06), inside
an outer ``torch.compile`` (the caller's compile traces the original) and under any active ``TorchFunctionMode``
(:func:`dtkv.runtime.batch_invariant`'s products must see every call). A module whose compile fails in Dynamo
(``torch._dynamo.exc.Unsupported``: a graph break under ``fullgraph``; ``FailOnRecompileLimitHit``: a process
that runs many configurations of one module class, as a test session does, passes Dynamo's recompile limit) runs
its original forward from then on, and a warning names it once per class.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch._dynamo.exc import FailOnRecompileLimitHit, Unsupported
from torch.overrides import _get_current_function_mode_stack

logger = logging.getLogger(__name__)
_WARNED: set[str] = set()

__all__ = ["compile_targets", "compiled_function", "install_compiled", "uninstall_compiled"]

_NORMS = ("input_layernorm", "post_attention_layernorm")
_ATTN_NORMS = ("q_a_layernorm", "kv_a_layernorm")


def compile_targets(model: Any, *, moe_ok: bool, attention_norms: bool = False) -> list[torch.nn.Module]:
    """The modules of ``model`` (a transformers DSA causal LM) whose forwards compile (module docstring);
    ``moe_ok``: whether its MoE experts are sync-free (MoE blocks are left out otherwise); ``attention_norms``:
    the attention's ``q_a_layernorm`` and ``kv_a_layernorm`` too (when the projections around them run eager)."""
    out: list[torch.nn.Module] = []
    for layer in model.model.layers:
        owners = [(layer, _NORMS)] + ([(layer.self_attn, _ATTN_NORMS)] if attention_norms else [])
        for owner, names in owners:
            out += [getattr(owner, n) for n in names if isinstance(getattr(owner, n, None), torch.nn.Module)]
        mlp = getattr(layer, "mlp", None)
        if isinstance(mlp, torch.nn.Module) and (moe_ok or not hasattr(mlp, "experts")):
            out.append(mlp)
    return out


def _eager_now() -> bool:
    return torch.compiler.is_compiling() or bool(_get_current_function_mode_stack())


def install_compiled(modules: list[torch.nn.Module], *, when: Callable[[], bool]) -> None:
    """Bind a ``forward`` to each module that runs its compiled forward while ``when()`` holds, the original
    otherwise (an instance attribute; :func:`uninstall_compiled` removes it).

    Raises:
        ValueError: a module already has a bound forward (nothing is bound then).
    """
    bound = [m for m in modules if "forward" in vars(m)]
    if bound:
        raise ValueError(
            f"modules must not have a bound forward to compile, got one on {type(bound[0]).__name__} (another "
            "runtime compiles this model: close() it first)"
        )
    for m in modules:
        original = type(m).forward.__get__(m)
        compiled = torch.compile(original, fullgraph=True)

        m.forward = _forward(original, compiled, when, type(m).__name__)


def compiled_function(fn: Callable, *, when: Callable[[], bool]) -> Callable:
    """``fn`` (a function of tensors and modules) run compiled while ``when()`` holds, eager otherwise, with the
    fallbacks of :func:`install_compiled` (eager inside an outer compile or a ``TorchFunctionMode``; eager from
    then on, with a warning, once its compile fails in Dynamo)."""
    return _forward(fn, torch.compile(fn, fullgraph=True), when, getattr(fn, "__name__", "a function"))


def _forward(original, compiled, when: Callable[[], bool], name: str):
    failed: list[str] = []

    def forward(*args, **kwargs):
        if failed or not when() or _eager_now():
            return original(*args, **kwargs)
        try:
            return compiled(*args, **kwargs)
        except (Unsupported, FailOnRecompileLimitHit) as e:  # raised while tracing: nothing ran yet
            failed.append(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            if name not in _WARNED:
                _WARNED.add(name)
                logger.warning("dtkv: %s runs its eager forward from now on (its compile failed: %s)", name, failed[0])
            return original(*args, **kwargs)

    return forward


def uninstall_compiled(modules: list[torch.nn.Module]) -> None:
    """Remove the forwards :func:`install_compiled` bound (the class forward applies again)."""
    for m in modules:
        m.__dict__.pop("forward", None)
