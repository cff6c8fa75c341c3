"""``build_model``: a model card plus parallel settings -> a ``DualKVGPTModel`` (or its pipeline chunks)."""
from __future__ import annotations

import dataclasses
import difflib
import os
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from megatron.core import package_info, parallel_state
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig

from ..mcore.cpu_compat import enable_cpu_compat
from ..mcore.gpt_model import DualKVGPTModel
from ..mcore.layer_specs import require_transformer_engine, transformer_engine_available
from ..mcore.multi_tensor import use_foreach_multi_tensor_ops
from ..mcore.parallel import (
    ParallelSizes,
    check_model_split,
    initialize_parallel_state,
    padded_vocab_size,
    pipeline_stage_fields,
)
from ..mcore.recompute import (
    SELECTIVE_RECOMPUTE_FIELDS,
    TE_ONLY_RECOMPUTE_MODULES,
    recompute_config_kwargs,
    refuse_offload_under_fp8,
)
from .cards import ModelCard, load_card
from .family import ModelFamily
from .gemma import GEMMA3, GEMMA4
from .qwen3 import QWEN3, QWEN3_MOE
from .qwen3_next import QWEN3_5, QWEN3_NEXT

FAMILIES: Dict[str, ModelFamily] = {
    family.model_type: family for family in (QWEN3, QWEN3_MOE, GEMMA3, GEMMA4, QWEN3_5, QWEN3_NEXT)
}

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Megatron-Core 0.16's block recompute calls the layers it does not recompute without the padding mask
_BLOCK_RECOMPUTE_PASSES_PADDING = (package_info.MAJOR, package_info.MINOR) >= (0, 17)
_RECOMPUTE_FIELDS = ("recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules",
                     *SELECTIVE_RECOMPUTE_FIELDS)


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
    fp8: Optional[str] = None,
    make_vocab_size_divisible_by: int = 128,
    recompute: Optional[str] = None,
    recompute_layers: Optional[int] = None,
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
        model chunks (Megatron's model-chunk list, as the interleaved schedule takes it). A layer
        count that does not divide by pp*vpp is split unevenly (``pipeline_stage_fields``: e.g.
        62 layers over pp=4 as 15, 16, 16, 15); the overrides
        ``num_layers_in_first_pipeline_stage`` / ``num_layers_in_last_pipeline_stage`` or
        ``pipeline_model_parallel_layout`` choose the split instead.
    dtype: parameter dtype (default: the card's ``torch_dtype``, float32 if it has none).
    seed: Megatron's model-parallel RNG seed. The same seed gives the same weights at any tp, but
        not across pp/ep layouts (each stage or expert rank draws for its own layers): to compare
        layouts, start them from one checkpoint (``save_model`` / ``load_model``).
    use_transformer_engine: the layer spec: True Transformer Engine's (``dualkv_te_block_spec``,
        ``gemma_block_spec``), False the torch-native local one; None picks TE's when
        transformer_engine imports and CUDA is available (``uses_transformer_engine``).
    fp8: None, "e4m3" or "hybrid" (e4m3 forward, e5m2 gradients): the TE spec's linears run in FP8
        with TE's current (per-tensor) scaling, Megatron's ``fp8_recipe="tensorwise"``; attention,
        norms, the embedding and output layer stay in the parameter dtype. Needs the TE spec, a
        GPU of compute capability 8.9+ and bf16 parameters.
    make_vocab_size_divisible_by: the embedding and output layer have the card's vocabulary
        padded to a multiple of this times tp, as Megatron-LM pads it (``padded_vocab_size``;
        1: a multiple of tp only). The model's ``vocab_size`` is the padded size,
        ``unpadded_vocab_size`` the card's; the padded rows are no token, and the log-probs leave
        them out of every softmax.
    recompute: activation recompute, "none" (None), "selective" (the norm outputs, rotated q and
        k and MLP activations of every layer, in either spec, TE not needed) or "full"
        (Megatron's full recompute); recompute_layers=N: the first N layers of every pipeline
        stage (model chunk) recomputed whole, by Megatron, with "selective" or "full"
        (``mcore.recompute.recompute_config_kwargs`` gives the config fields of each setting).
    overrides: ``TransformerConfig`` (``DualKVTransformerConfig``) fields replacing the card's
        (e.g. ``num_layers=2``, ``moe_aux_loss_coeff=0.0``), Megatron's own recompute fields
        (``recompute_granularity``, ``recompute_modules``, ...) included when ``recompute`` is not given.

    In a plain single process it first maps megatron-core's CUDA-only calls when there is no GPU
    (``enable_cpu_compat``) and initialises ``torch.distributed`` and Megatron's parallel state
    with a world of one. Megatron's optimizer gets multi-tensor ops where it would loop over the
    parameters (``use_foreach_multi_tensor_ops``). Weights are randomly initialised; the model is in
    training mode.
    """
    card = load_card(card)
    family = family_of(card)
    sizes = ParallelSizes(tp=tp, pp=pp, ep=ep, cp=cp, etp=etp, vpp=vpp, sp=sp)
    use_transformer_engine = uses_transformer_engine(use_transformer_engine, family)
    dtype = param_dtype(card, dtype)
    enable_cpu_compat()
    use_foreach_multi_tensor_ops()
    overrides = _with_recompute(overrides, recompute, recompute_layers, fp8 is not None)
    refuse_offload_under_fp8(overrides.get("offload_layers"), fp8 is not None)  # from recompute= or the field
    overrides.update(fp8_config_kwargs(fp8, use_transformer_engine, dtype))
    _refuse_te_only_recompute(overrides)
    refuse_recompute_modules_the_spec_lacks(overrides, use_transformer_engine)
    config = build_transformer_config(card, family, sizes, dtype, use_transformer_engine, overrides)
    if hasattr(config, "check_parallel_sizes"):  # a family's own limits (the hybrid models' GDN layers)
        config.check_parallel_sizes(sizes)
    check_model_split(config, sizes)
    model_kwargs = family.gpt_model_kwargs(card)
    vocab_size = model_kwargs["vocab_size"]
    padded = padded_vocab_size(vocab_size, tp, make_vocab_size_divisible_by)
    model_kwargs.update(vocab_size=padded, unpadded_vocab_size=vocab_size)
    initialize_parallel_state(sizes, seed)
    _check_recompute(config)
    if config.num_moe_experts:
        _fit_moe_loss_tracker(config.num_layers)
    chunks = [_pipeline_chunk(family, config, use_transformer_engine, model_kwargs, vp_stage) for vp_stage in range(sizes.vpp or 1)]
    return chunks if sizes.vpp else chunks[0]


def _fit_moe_loss_tracker(num_layers: int) -> None:
    """Megatron logs MoE losses per layer in a process-wide tracker whose tensors are sized by the
    first model that routes tokens; a model of more layers built later in the process (another card,
    the next test) would index past them. Entries of another size are dropped (they only log)."""
    try:  # megatron-core 0.17+: a tracker object (the legacy getter returns a copy of its entries)
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

        tracker, values = get_moe_metrics_tracker().metrics, lambda entry: entry.values
    except ImportError:
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        tracker, values = get_moe_layer_wise_logging_tracker(), lambda entry: entry["values"]
    for name in [name for name, entry in tracker.items() if values(entry).numel() != num_layers]:
        del tracker[name]


def uses_transformer_engine(requested: Optional[bool], family: Optional[ModelFamily] = None) -> bool:
    """Whether ``build_model(use_transformer_engine=requested)`` builds the TE spec: ``requested``,
    checked (True needs transformer_engine, CUDA and a family with a TE spec), or for None whether
    all three are there."""
    has_spec = family is None or family.transformer_engine_spec
    if requested is None:
        return has_spec and transformer_engine_available() and torch.cuda.is_available()
    if requested and not has_spec:
        raise ValueError(f"use_transformer_engine=True: model_type {family.model_type!r} has no Transformer Engine "
                         "spec yet; build it with the local spec (use_transformer_engine=False or None)")
    if requested:
        require_transformer_engine("use_transformer_engine=True")
        if not torch.cuda.is_available():
            raise ValueError("use_transformer_engine=True: Transformer Engine's layers run on CUDA only, and there is no GPU")
    return bool(requested)


FP8_FORMATS = ("e4m3", "hybrid")


def fp8_config_kwargs(fp8: Optional[str], use_transformer_engine: bool, dtype: torch.dtype) -> Dict[str, Any]:
    """The ``TransformerConfig`` fields of ``build_model(fp8=...)``; ValueError naming ``fp8`` for a
    setting that cannot run here."""
    if fp8 is None:
        return {}
    if fp8 not in FP8_FORMATS:
        raise ValueError(f"fp8 must be one of {FP8_FORMATS} (or None), got {fp8!r}")
    if not use_transformer_engine:
        raise ValueError(f"fp8={fp8!r} runs Transformer Engine's linears in FP8: it needs the TE spec "
                         "(use_transformer_engine=True, --transformer-engine on)")
    if torch.cuda.get_device_capability() < (8, 9):
        name = torch.cuda.get_device_name()
        raise ValueError(f"fp8={fp8!r}: {name} has no FP8 matmuls (compute capability 8.9+, e.g. Ada or Hopper, is needed)")
    if dtype != torch.bfloat16:
        raise ValueError(f"fp8={fp8!r} trains bf16 parameters with FP8 matmuls; the parameters are {dtype} (--dtype bfloat16)")
    # Current (per-tensor) scaling: no amax history to warm up, and Megatron's moe_act recompute
    # allows it (not delayed scaling). No FP8 weight cache across micro-batches: a forward outside
    # Megatron's schedule (which resets it at each step's first micro-batch) would read the weights
    # of before the last optimizer step; quantizing them again costs a pass over the weights.
    return {"fp8": fp8, "fp8_recipe": "tensorwise", "disable_parameter_transpose_cache": True}


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
    """Architecture (family) + parallel sizes + precision + overrides -> ``TransformerConfig``
    (the family's ``config_class``)."""
    config_fields = frozenset(f.name for f in dataclasses.fields(family.config_class))
    unknown = sorted(set(overrides) - config_fields)
    if unknown:
        hints = {k: difflib.get_close_matches(k, config_fields, n=1) for k in unknown}
        raise ValueError(
            f"unknown build_model overrides (not {family.config_class.__name__} fields): "
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
    # Megatron's default CUDA-graph scope, "full", is deprecated by Megatron itself (a warning at every
    # config); the empty list it asks for means the same
    kwargs[_CUDA_GRAPH_SCOPE] = []
    if "num_layers" in overrides and "layer_types" in kwargs and "layer_types" not in overrides:
        # a num_layers override builds the card's first layers (a probe, a one-layer benchmark)
        kwargs["layer_types"] = tuple(kwargs["layer_types"][:overrides["num_layers"]])
    kwargs.update(overrides)
    if kwargs.get("fp8") and kwargs.get("bias_activation_fusion"):
        # the fused SwiGLU keeps its input (fc1's output, the layer's largest tensor) in FP8: fc2
        # keeps an FP8 copy of its output already, so the layer keeps no bf16 MLP tensor
        kwargs.setdefault("activation_func_fp8_input_store", True)
    if kwargs.get("num_moe_experts") and kwargs.get("fp8"):
        # FP8 grouped matmuls take 16-row multiples per expert: Megatron pads the routing to them
        kwargs["moe_router_padding_for_quantization"] = True
    kwargs.update(pipeline_stage_fields(kwargs["num_layers"], sizes, kwargs))
    return family.config_class(**kwargs)


def _with_recompute(overrides: Dict[str, Any], recompute: Optional[str], layers: Optional[int],
                    fp8: bool) -> Dict[str, Any]:
    """``overrides`` plus the config fields of ``recompute`` / ``recompute_layers``, which must not
    also be set one by one."""
    if recompute is None and layers is None:
        return overrides
    conflicting = [k for k in _RECOMPUTE_FIELDS if k in overrides]
    if conflicting:
        raise ValueError(
            f"recompute={recompute!r} sets the recompute fields; do not also pass {', '.join(conflicting)}"
        )
    return {**overrides, **recompute_config_kwargs(recompute, layers, fp8)}


def _refuse_te_only_recompute(overrides: Dict[str, Any]) -> None:
    """ValueError for Megatron's selective modules that need Transformer Engine, without it (before
    Megatron's own config checks, which give other reasons)."""
    te_only = sorted(set(overrides.get("recompute_modules") or []) & set(TE_ONLY_RECOMPUTE_MODULES))
    if overrides.get("recompute_granularity") == "selective" and te_only and not transformer_engine_available():
        raise ValueError(
            f"recompute_modules {te_only}: Megatron-Core recomputes these through Transformer Engine "
            "(CheckpointWithoutOutput), which is not installed; recompute='selective' recomputes the norms and "
            "activations without it"
        )


def refuse_recompute_modules_the_spec_lacks(overrides: Dict[str, Any], use_transformer_engine: bool) -> None:
    """ValueError naming ``recompute_modules`` for Megatron's "layernorm" where the TE spec fuses the
    input and pre-MLP norms into its linears (Megatron would skip them and recompute nothing)."""
    modules = overrides.get("recompute_modules") or []
    if use_transformer_engine and "layernorm" in modules and not overrides.get("recompute_norms"):
        raise ValueError(
            "recompute_modules ['layernorm']: the Transformer Engine spec fuses the input and pre-MLP norms into "
            "its linears, so there is no norm output to recompute; recompute='selective' puts our norms in front "
            "of TE's linears and frees their outputs"
        )


def _check_recompute(config: TransformerConfig) -> None:
    """ValueError naming the field for a recompute setting these layers cannot run."""
    # Megatron counts recompute_num_layers within each pipeline stage / model chunk, as we do offload_layers
    vpp = config.virtual_pipeline_model_parallel_size
    most = max(
        get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
        for pp_rank in range(config.pipeline_model_parallel_size)
        for vp_stage in (range(vpp) if vpp else [None])
    )
    counts = {"offload_layers": getattr(config, "offload_layers", 0),
              "recompute_num_layers": config.recompute_num_layers if config.recompute_granularity == "full" else 0}
    for field_name, count in counts.items():
        if count > most:
            raise ValueError(f"recompute_layers ({field_name}) = {count} is more than the {most} layers of a pipeline "
                             f"{'model chunk' if vpp else 'stage'}")
    block = config.recompute_granularity == "full" and config.recompute_method == "block"
    if block and _counts_routed_tokens(config) and not _BLOCK_RECOMPUTE_PASSES_PADDING:
        raise ValueError(
            "recompute_layers with MoE load balancing (moe_aux_loss_coeff, moe_z_loss_coeff or "
            "moe_router_enable_expert_bias) on megatron-core < 0.17: its block recompute runs the layers it does "
            "not recompute without the padding mask, so their routing statistics would count the packing's "
            "padding tokens; set those off, recompute every layer, or use megatron-core 0.17+"
        )


def _counts_routed_tokens(config: TransformerConfig) -> bool:
    """Whether MoE routing statistics over the tokens (load-balancing losses, expert bias) train the model."""
    return bool(config.num_moe_experts) and bool(
        config.moe_aux_loss_coeff or config.moe_z_loss_coeff or config.moe_router_enable_expert_bias
    )


# Megatron-Core 0.17+ calls the field cuda_graph_modules (cuda_graph_scope is its deprecated alias)
_CUDA_GRAPH_SCOPE = next(f.name for f in dataclasses.fields(TransformerConfig) if f.name in ("cuda_graph_modules",
                                                                                          "cuda_graph_scope"))


def _legacy_grouped_gemm_available() -> bool:
    # Megatron-Core 0.17+ removed the legacy GroupedMLP with its grouped_gemm wrapper.
    try:
        from megatron.core.transformer.moe import grouped_gemm_util
    except ImportError:
        return False
    return grouped_gemm_util.grouped_gemm_is_available()


def param_dtype(card: ModelCard, dtype: Optional[torch.dtype]) -> torch.dtype:
    """``dtype``, checked, or else the card's ``torch_dtype`` (float32 when it names none)."""
    if dtype is not None:
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype must be one of {list(_DTYPES.values())}, got {dtype}")
        return dtype
    name = card.config.get("torch_dtype") or card.config.get("dtype") or "float32"
    if name not in _DTYPES:
        raise ValueError(f"model card {card.name!r}: unsupported torch_dtype {name!r}; choose one of {sorted(_DTYPES)}")
    return _DTYPES[name]
