"""``ModelFamily``: how one Hugging Face ``model_type`` becomes a Megatron-Core model.

A family turns card fields into ``TransformerConfig`` architecture fields and ``GPTModel``
arguments; the builder adds the parallel and precision settings and the DualKV layer spec. One
small module per family (``qwen3.py``): that module is also where a family's Hugging Face
state-dict mapping (checkpoint conversion) and any family-specific layer spec (e.g. Gemma's extra
norms) belong.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict

from .cards import ModelCard

_REQUIRED = object()


@dataclass(frozen=True)
class ModelFamily:
    model_type: str
    transformer_config_kwargs: Callable[[ModelCard], Dict[str, Any]]
    gpt_model_kwargs: Callable[[ModelCard], Dict[str, Any]]


def card_field(card: ModelCard, key: str, default: Any = _REQUIRED) -> Any:
    """``card.config[key]``; a missing required field is a ValueError naming the card."""
    value = card.config.get(key, default)
    if value is _REQUIRED:
        raise ValueError(f"model card {card.name!r} ({card.model_type}) lacks the required field {key!r}")
    return value
