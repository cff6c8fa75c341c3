"""``build_model``: a model card plus parallel settings -> a ``DualKVGPTModel`` (or its pipeline chunks)."""
from __future__ import annotations

import dataclasses
import difflib
import os
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.transformer.transformer_config import TransformerConfig

from ..mcore.cpu_compat import enable_cpu_compat
from ..mcore.gpt_model import DualKVGPTModel
from ..mcore.layer_specs import transformer_engine_available
from ..mcore.multi_tensor import use_foreach_multi_tensor_ops
from ..mcore.parallel import ParallelSizes, check_model_split, initialize_parallel_state
from .cards import ModelCard, load_card
from .family import ModelFamily
from .gemma import GEMMA3, GEMMA4
from .qwen3 import QWEN3, QWEN3_MOE

FAMILIES: Dict[str, ModelFamily] = {family.model_type: family for family in (QWEN3, QWEN3_MOE, GEMMA3, GEMMA4)}

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_TRANSFORMER_CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(TransformerConfig))


def family_of(card: ModelCard) -> ModelFamily:
    """The family of ``card``; ValueError naming the supported ones when there is none."""
    family = FAMILIES.get(card.model_type)
    if family is None:
        raise ValueError(f"model card {card.name!r}: unsupported model_type {card.model_type!r}; supported: {sorted(FAMILIES)}")
    return family


def architecture_differences(card: Union[str, os.PathLike, ModelCard], other: Union[str, os.PathLike, ModelCard]
                             ) -> Dict[str, Tuple[Any, Any]]:
    """The settings in which the models of two cards differ: name -> (this card's, the other's),
    over the model type and what the family makes of a card (``TransformerConfig`` architecture
    fields, ``GPTModel`` arguments: vocabulary, positions, ...); {} for the same architecture.
    Parallelism and the parameter dtype are not architecture."""
    mine, theirs = _architecture(load_card(card)), _architecture(load_card(other))
    return {name: (mine.get(name), theirs.get(name)) for name in sorted(mine.keys() | theirs.keys())
            if mine.get(name) != theirs.get(name)}


def _architecture(card: ModelCard) -> Dict[str, Any]:
    family = family_of(card)
    return {"model_type": card.model_type, **family.transformer_config_kwargs(card), **family.gpt_model_kwargs(card)}


def build_model(
    card: Union[str, os.PathLike, ModelCard],
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    cp: int = 1,
    *,
    etp: Optional[int] = None,
    vpp: Optional[int] = None,
    sp: Optional[bool] = None,
    dtype: Optional[torch.dtype] = None,
    seed: int = 1234,
    use_transformer_engine: Optional[bool] = None,
    **overrides: Any,
) -> Union[DualKVGPTModel, List[DualKVGPTModel]]:
    """Build the Megatron-Core model of ``card`` for the DualKV packed layout.

    card: a card name in ``models/`` (e.g. ``"qwen3-tiny"``), a card file, or a Hugging Face
        ``config.json`` path.
    tp, pp, ep, cp: tensor, pipeline, expert and (Ulysses) context parallel sizes; etp: the
        experts' tensor-parallel size (default tp); vpp: model chunks per pipeline rank for the
        interleaved schedule; sp: sequence parallelism (default: on when tp > 1). Checked and
        turned into Megatron's parallel state by ``megatron_dualkv.mcore.parallel``; a world
        larger than one process is the launcher's (torchrun), whose process group is joined.
        Under pp > 1 this rank's stage is built; with vpp > 1 the result is the list of its vpp
        model chunks (Megatron's model-chunk list, as the interleaved schedule takes it).
    dtype: parameter dtype (default: the card's ``torch_dtype``, float32 if it has none).
    seed: Megatron's model-parallel RNG seed. The same seed gives the same weights at any tp, but
        not across pp/ep layouts (each stage or expert rank draws for its own layers): to compare
        layouts, start them from one checkpoint (``save_model`` / ``load_model``).
    use_transformer_engine: None picks the TE spec when transformer_engine imports, CUDA is
        available and the family has one (Gemma has not), else the torch-native local spec.
    overrides: ``TransformerConfig`` fields replacing the card's (e.g. ``num_layers=2``,
        ``moe_aux_loss_coeff=0.0``).

    In a plain single process it first maps megatron-core's CUDA-only calls when there is no GPU
    (``enable_cpu_compat``) and initialises ``torch.distributed`` and Megatron's parallel state
    with a world of one. Megatron's optimizer gets multi-tensor ops where it would loop over the
    parameters (``use_foreach_multi_tensor_ops``). Weights are randomly initialised; the model is in
    training mode.
    """
    card = load_card(card)
    family = family_of(card)
    sizes = ParallelSizes(tp=tp, pp=pp, ep=ep, cp=cp, etp=etp, vpp=vpp, sp=sp)
    if use_transformer_engine is None:
        use_transformer_engine = (
            family.supports_transformer_engine and transformer_engine_available() and torch.cuda.is_available()
        )
    enable_cpu_compat()
    use_foreach_multi_tensor_ops()
    config = build_transformer_config(card, family, sizes, _param_dtype(card, dtype), use_transformer_engine, overrides)
    model_kwargs = family.gpt_model_kwargs(card)
    check_model_split(config, model_kwargs["vocab_size"], sizes)
    initialize_parallel_state(sizes, seed)
    chunks = [_pipeline_chunk(family, config, use_transformer_engine, model_kwargs, vp_stage) for vp_stage in range(sizes.vpp or 1)]
    return chunks if sizes.vpp else chunks[0]


def _pipeline_chunk(family: ModelFamily, config, use_transformer_engine: bool, model_kwargs, vp_stage: int):
    """The model chunk of this pipeline rank's virtual stage ``vp_stage`` (the whole model without PP)."""
    vp_stage = vp_stage if config.virtual_pipeline_model_parallel_size else None
    model = family.model_class(
        config,
        family.block_spec(config, use_transformer_engine, vp_stage),
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        vp_stage=vp_stage,
        **model_kwargs,
    )
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
    if kwargs["variable_seq_lengths"] and not kwargs.get("num_moe_experts"):
        # Megatron 0.16.1 refuses variable sequence lengths with its default MoE token dispatcher
        # ("allgather") even in a model without experts.
        kwargs["moe_token_dispatcher_type"] = "alltoall"
    kwargs.update(
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        # Master weights built on the host and split: the same seed gives the same full weights
        # for every tp. On GPU, parameters are initialised in place (fast).
        use_cpu_initialization=not torch.cuda.is_available(),
    )
    if kwargs.get("num_moe_experts"):
        # TE: TEGroupedMLP. Local: legacy GroupedMLP needs the grouped_gemm CUDA package,
        # otherwise SequentialMLP (a loop over experts, any device).
        kwargs["moe_grouped_gemm"] = use_transformer_engine or _legacy_grouped_gemm_available()
    elif torch.cuda.is_available() and kwargs.get("gated_linear_unit") and kwargs.get("activation_func") is F.silu:
        # Megatron's fused SwiGLU (compiled: one kernel per direction instead of a chunk, a SiLU and
        # a product as PyTorch ops). Not for the experts: a compiled call per expert would add host
        # time to a step that host time already binds (PERF_NOTES.md, run L).
        kwargs["bias_activation_fusion"] = True
    kwargs.update(overrides)
    return family.config_class(**kwargs)


def _legacy_grouped_gemm_available() -> bool:
    # Megatron-Core 0.17+ removed the legacy GroupedMLP with its grouped_gemm wrapper.
    try:
        from megatron.core.transformer.moe import grouped_gemm_util
    except ImportError:
        return False
    return grouped_gemm_util.grouped_gemm_is_available()


def _param_dtype(card: ModelCard, dtype: Optional[torch.dtype]) -> torch.dtype:
    if dtype is not None:
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype must be one of {list(_DTYPES.values())}, got {dtype}")
        return dtype
    name = card.config.get("torch_dtype") or card.config.get("dtype") or "float32"
    if name not in _DTYPES:
        raise ValueError(f"model card {card.name!r}: unsupported torch_dtype {name!r}; choose one of {sorted(_DTYPES)}")
    return _DTYPES[name]
