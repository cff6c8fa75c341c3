"""Model cards and the builder: ``build_model(card, tp=1, pp=1, ep=1, cp=1, **overrides)``.

One small module per model family (``qwen3.py``) turns a card (Hugging Face ``config.json``
fields) into Megatron-Core settings; the cards themselves live in the repository's ``models/``.
Checkpoints (``checkpoint.py``): Hugging Face folders <-> Megatron ``dist_checkpointing`` folders,
``load_model`` / ``save_model`` at any parallel sizes; ``export_hf_weights`` streams a live model's
weights under their Hugging Face names (``hf_export.py``).
"""
from .builder import FAMILIES, architecture_differences, build_model, build_transformer_config
from .cards import ModelCard, available_cards, load_card
from .checkpoint import checkpoint_card, hf_to_megatron, load_model, megatron_to_hf, save_model, weights_only
from .family import ModelFamily, StateDictMapping, TensorMapping, load_megatron_state_dict
from .hf_export import export_hf_weights

__all__ = [
    "FAMILIES",
    "ModelCard",
    "ModelFamily",
    "StateDictMapping",
    "TensorMapping",
    "architecture_differences",
    "available_cards",
    "build_model",
    "build_transformer_config",
    "checkpoint_card",
    "export_hf_weights",
    "hf_to_megatron",
    "load_card",
    "load_megatron_state_dict",
    "load_model",
    "weights_only",
    "megatron_to_hf",
    "save_model",
]
