"""Loading a DeepSeek-V3.2 / GLM-5 checkpoint directory for
:class:`~dtkv.integrations.transformers.TransformersAdapter` (``python -m dtkv.demo --model PATH``).

:func:`load_model` reads ``config.json`` first and refuses a directory whose ``model_type`` is not a supported
DSA family (before any weight is read), then loads the weights with transformers' ``from_pretrained``
(safetensors) in the dtype the checkpoint ships, or the one asked for, on the device asked for, in eval mode, and
refuses a checkpoint that lacks a weight of the model or holds one of another shape.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dtkv.integrations.transformers._family import FAMILIES

__all__ = ["load_model"]


def _json_kind(value: object) -> str:
    if value is None:
        return "null"
    return {list: "array", str: "string", bool: "boolean", int: "number", float: "number"}.get(type(value), "value")


def _model_type(path: Path) -> str:
    cfg = path / "config.json"
    if not path.is_dir() or not cfg.is_file():
        raise ValueError(f"path must be a checkpoint directory holding config.json, got path={str(path)!r}")
    try:
        config = json.loads(cfg.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{cfg} is not a readable JSON config: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{cfg} must hold a JSON object (the model's config), got a JSON {_json_kind(config)}")
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(
            f"{cfg} has model_type={model_type!r}; dtkv runs the DSA models {sorted(FAMILIES)} "
            "(DeepSeek-V3.2 and GLM-5 as transformers implements them)"
        )
    return model_type


def load_model(
    path: str | Path,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> torch.nn.Module:
    """A DSA causal LM from a checkpoint directory (``config.json`` + safetensors), in eval mode.

    Args:
        path: a local directory as ``save_pretrained`` writes it (or a downloaded Hugging Face snapshot).
        device: where the weights go (``"cpu"``, ``"cuda:0"``, ...).
        dtype: the model's dtype; ``None`` keeps the dtype the checkpoint ships (its ``config.json``'s
            ``torch_dtype``/``dtype``, else the stored tensors').

    Returns:
        the loaded ``DeepseekV32ForCausalLM`` or ``GlmMoeDsaForCausalLM``, ready for :class:`TransformersAdapter`.

    Raises:
        ValueError: ``path`` is not a checkpoint directory, its ``config.json`` is not a JSON object, or its
            ``model_type`` is not a supported DSA model (nothing is loaded then); the safetensors lack a weight of
            the model or hold one of another shape (the message names them; ``from_pretrained`` would have filled
            them with random values).
        ImportError: transformers is missing (``pip install dtkv[hf]``).
    """
    path = Path(path)
    family = FAMILIES[_model_type(path)]
    try:
        import transformers
    except ImportError as e:
        raise ImportError(f"load_model needs transformers (pip install 'dtkv[hf]'): {e}") from e
    cls = getattr(transformers, family.causal_lm)
    model, info = cls.from_pretrained(
        str(path), dtype="auto" if dtype is None else dtype, use_safetensors=True, output_loading_info=True,
        ignore_mismatched_sizes=True,  # reported below, with the missing ones, instead of deep inside transformers
    )  # fmt: skip
    _check_complete(path, info)
    return model.to(device=torch.device(device)).eval()


def _check_complete(path: Path, info: dict) -> None:
    """Refuse a checkpoint that does not hold every weight of the model in its shape: ``from_pretrained`` fills
    what is missing (or of another shape) with fresh random values, differently on every CP rank."""
    missing = sorted(info.get("missing_keys") or ())
    mismatched = sorted(info.get("mismatched_keys") or ())
    if not missing and not mismatched:
        return
    parts = []
    if missing:
        shown = ", ".join(missing[:_SHOWN]) + (f", ... ({len(missing) - _SHOWN} more)" if len(missing) > _SHOWN else "")
        parts.append(f"{len(missing)} missing tensors ({shown})")
    if mismatched:
        shown = ", ".join(
            f"{k}: {list(a)} in the checkpoint, {list(b)} in the model" for k, a, b in mismatched[:_SHOWN]
        )
        more = f", ... ({len(mismatched) - _SHOWN} more)" if len(mismatched) > _SHOWN else ""
        parts.append(f"{len(mismatched)} tensors of another shape ({shown}{more})")
    raise ValueError(
        f"path must hold every weight of the model its config.json describes, got {' and '.join(parts)} in "
        f"{str(path)!r}; from_pretrained would fill them with random values (differently on every rank)"
    )


_SHOWN = 8
"""Tensors named in :func:`_check_complete`'s message (the rest are counted)."""
