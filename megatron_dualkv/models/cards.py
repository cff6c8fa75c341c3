"""Model cards: one JSON file per supported model in the repository's ``models/`` folder.

A card is a Hugging Face ``config.json`` (the architecture fields of the real model, under the
same names) plus ``name`` and ``source``. So a card, a card file anywhere, and the
``config.json`` of a Hugging Face checkpoint are read the same way. Adding a size is adding a card.
The folder ships inside the package as ``megatron_dualkv.cards`` (see setup.py).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Union

from .._resources import available_cards, cards_dir  # noqa: F401  (available_cards: exported here)


@dataclass(frozen=True)
class ModelCard:
    name: str
    config: Dict[str, Any]  # Hugging Face config.json fields

    @property
    def model_type(self) -> str:
        return self.config.get("model_type", "")


def load_card(card: Union[str, os.PathLike, ModelCard]) -> ModelCard:
    """A card name (``"qwen3-tiny"``), a card file, or a Hugging Face ``config.json`` path."""
    if isinstance(card, ModelCard):
        return card
    if not isinstance(card, (str, os.PathLike)):
        raise ValueError(f"card must be a card name or a path, got {type(card).__name__}")
    path = Path(card)
    if not path.is_file():
        path = cards_dir() / f"{card}.json"
        if not path.is_file():
            raise ValueError(f"unknown model card {str(card)!r}: not a file and not one of {available_cards()}")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"model card {path} is not valid JSON: {err}") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise ValueError(f"model card {path} has no 'model_type' (expected a Hugging Face config.json layout)")
    # An HF config.json has no name: its checkpoint folder names it.
    name = config.get("name") or (path.parent.name if path.name == "config.json" else path.stem)
    return ModelCard(name=name, config=config)
