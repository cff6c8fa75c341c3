"""``build_model``: a model card plus parallel settings -> a ``DualKVGPTModel``."""
from __future__ import annotations

import dataclasses
import difflib
import os
from typing import Any, Dict, Optional, Union

import torch
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.moe import grouped_gemm_util

from ..mcore.cpu_compat import enable_cpu_compat
from ..mcore.gpt_model import DualKVGPTModel
from ..mcore.layer_specs import dualkv_local_block_spec, dualkv_te_block_spec, transformer_engine_available
from ..mcore.parallel import ParallelSizes, initialize_parallel_state
from .cards import ModelCard, load_card
from .family import ModelFamily
from .qwen3 import QWEN3, QWEN3_MOE

FAMILIES: Dict[str, ModelFamily] = {family.model_type: family for family in (QWEN3, QWEN3_MOE)}

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_TRANSFORMER_CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(TransformerConfig))


def build_model(
    card: Union[str, os.PathLike, ModelCard],
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    cp: int = 1,
    *,
    dtype: Optional[torch.dtype] = None,
    seed: int = 1234,
    use_transformer_engine: Optional[bool] = None,
    **overrides: Any,
) -> DualKVGPTModel:
    """Build the Megatron-Core model of ``card`` for the DualKV packed layout.

    card: a card name in ``models/`` (e.g. ``"qwen3-tiny"``), a card file, or a Hugging Face
        ``config.json`` path.
    tp, pp, ep, cp: tensor, pipeline, expert and context parallel sizes. pp > 1 and cp > 1 raise
        NotImplementedError for now; tp/ep > 1 need a launched world of that size (torchrun).
    dtype: parameter dtype (default: the card's ``torch_dtype``, float32 if it has none).
    seed: Megatron's model-parallel RNG seed; the same seed gives the same weights.
    use_transformer_engine: None picks the TE spec when transformer_engine imports and CUDA is
        available, else the torch-native local spec.
    overrides: ``TransformerConfig`` fields replacing the card's (e.g. ``num_layers=2``,
        ``moe_aux_loss_coeff=0.0``).

    In a plain single process it first maps megatron-core's CUDA-only calls when there is no GPU
    (``enable_cpu_compat``) and initialises ``torch.distributed`` and Megatron's parallel state
    with a world of one. Weights are randomly initialised; the model is in training mode.
    """
    card = load_card(card)
    family = FAMILIES.get(card.model_type)
    if family is None:
        raise ValueError(f"model card {card.name!r}: unsupported model_type {card.model_type!r}; supported: {sorted(FAMILIES)}")
    sizes = ParallelSizes(tp=tp, pp=pp, ep=ep, cp=cp)
    if use_transformer_engine is None:
        use_transformer_engine = transformer_engine_available() and torch.cuda.is_available()
    enable_cpu_compat()
    config = build_transformer_config(card, family, sizes, _param_dtype(card, dtype), use_transformer_engine, overrides)
    model_kwargs = family.gpt_model_kwargs(card)
    if model_kwargs["vocab_size"] % tp:
        raise ValueError(f"vocab_size ({model_kwargs['vocab_size']}) is not divisible by tp ({tp})")
    initialize_parallel_state(sizes, seed)
    spec_fn = dualkv_te_block_spec if use_transformer_engine else dualkv_local_block_spec
    model = DualKVGPTModel(config, spec_fn(config), **model_kwargs)
    return model.to(torch.cuda.current_device()) if torch.cuda.is_available() else model


def build_transformer_config(
    card: ModelCard,
    family: ModelFamily,
    sizes: ParallelSizes,
    dtype: torch.dtype,
    use_transformer_engine: bool,
    overrides: Dict[str, Any],
) -> TransformerConfig:
    """Architecture (family) + parallel sizes + precision + overrides -> ``TransformerConfig``."""
    unknown = sorted(set(overrides) - _TRANSFORMER_CONFIG_FIELDS)
    if unknown:
        hints = {k: difflib.get_close_matches(k, _TRANSFORMER_CONFIG_FIELDS, n=1) for k in unknown}
        raise ValueError(
            "unknown build_model overrides (not TransformerConfig fields): "
            + ", ".join(f"{k}" + (f" (did you mean {v[0]}?)" if v else "") for k, v in hints.items())
        )
    kwargs = family.transformer_config_kwargs(card)
    kwargs.update(sizes.transformer_config_kwargs())
    kwargs.update(
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        # Master weights built on the host and split: the same seed gives the same full weights
        # for every tp. On GPU, parameters are initialised in place (fast).
        use_cpu_initialization=not torch.cuda.is_available(),
    )
    if kwargs.get("num_moe_experts"):
        # TE: TEGroupedMLP. Local: legacy GroupedMLP needs the grouped_gemm CUDA package,
        # otherwise SequentialMLP (a loop over experts, any device).
        kwargs["moe_grouped_gemm"] = use_transformer_engine or grouped_gemm_util.grouped_gemm_is_available()
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def _param_dtype(card: ModelCard, dtype: Optional[torch.dtype]) -> torch.dtype:
    if dtype is not None:
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype must be one of {list(_DTYPES.values())}, got {dtype}")
        return dtype
    name = card.config.get("torch_dtype") or card.config.get("dtype") or "float32"
    if name not in _DTYPES:
        raise ValueError(f"model card {card.name!r}: unsupported torch_dtype {name!r}; choose one of {sorted(_DTYPES)}")
    return _DTYPES[name]
