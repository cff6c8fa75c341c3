"""Model cards and the builder: ``build_model(card, tp=1, pp=1, ep=1, cp=1, **overrides)``.

One small module per model family (``qwen3.py``) turns a card (Hugging Face ``config.json``
fields) into Megatron-Core settings; the cards themselves live in the repository's ``models/``.
"""
from .builder import FAMILIES, build_model, build_transformer_config
from .cards import ModelCard, available_cards, load_card

__all__ = ["FAMILIES", "ModelCard", "available_cards", "build_model", "build_transformer_config", "load_card"]
