"""Loading a DeepSeek-V3.2 / GLM-5 checkpoint directory for
:class:`~dtkv.integrations.transformers.TransformersAdapter` (``python -m dtkv.demo --model PATH``).

:func:`load_model` reads ``config.json`` first and refuses a directory whose ``model_type`` is not a supported
DSA family (before any weight is read), then loads the weights with transformers' ``from_pretrained``
(safetensors) in the dtype the checkpoint ships, or the one asked for, on the device asked for, in eval mode.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dtkv.integrations.transformers._family import FAMILIES

__all__ = ["load_model"]


def _model_type(path: Path) -> str:
    cfg = path / "config.json"
    if not path.is_dir() or not cfg.is_file():
        raise ValueError(f"path must be a checkpoint directory holding config.json, got path={str(path)!r}")
    try:
        model_type = json.loads(cfg.read_text()).get("model_type")
    except (OSError, ValueError) as e:
        raise ValueError(f"{cfg} is not a readable JSON config: {e}") from None
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
        ValueError: ``path`` is not a checkpoint directory, or its ``model_type`` is not a supported DSA model
            (nothing is loaded then).
        ImportError: transformers is missing (``pip install dtkv[hf]``).
    """
    path = Path(path)
    family = FAMILIES[_model_type(path)]
    try:
        import transformers
    except ImportError as e:
        raise ImportError(f"load_model needs transformers (pip install 'dtkv[hf]'): {e}") from e
    cls = getattr(transformers, family.causal_lm)
    model = cls.from_pretrained(str(path), dtype="auto" if dtype is None else dtype, use_safetensors=True)
    return model.to(device=torch.device(device)).eval()
