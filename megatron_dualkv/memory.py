"""Peak memory of one rank in a policy-update step, predicted from the model, the parallel sizes,
the micro-batch, and the recompute and optimizer settings.

    peak = static (weights, gradients, optimizer state; a frozen reference model)
         + activations (what autograd keeps of the micro-batches in flight until their backward)
         + transient (the largest working set that exists on top of them: one layer's backward,
           the output layer's chunk, a fully recomputed layer's activations)

``MemoryModel.predict`` gives a ``MemoryEstimate`` for one pipeline stage; ``peak`` the largest over
the stages (what every rank must fit). ``fit`` answers the launch script's and the benchmark's
``--recompute auto`` and ``--max-tokens auto``: the least recompute, and the largest micro-batch, whose
predicted peak stays under the device's memory minus a margin.

Activations are counted tensor by tensor as our layer specs save them for the backward, per token of
the micro-batch (``layer_tensors``): every saved tensor is a number of elements per token that is a sum
of model dimensions, a dtype, and how tensor and sequence parallelism split it. Recompute drops some of
them: "selective" the norm outputs and MLP activations that the next linear saves and the rotated q
and k with what the q/k norms and RoPE keep (all recomputed from tensors that stay; under FP8 the
q and k only, ``recompute_config_kwargs``), a fully
recomputed layer everything but its input, and an offloaded layer ("offload") everything on the
device: its selective set waits in pinned host memory (``MemoryEstimate.host``). The counts were read off the code and measured on the
H200 (PERF_NOTES.md, session 19: one layer within 3.5%, ten whole steps' peaks within -0.2% to +7.2%);
a change to a spec that saves other tensors must change them too (``tests/test_memory_gpu.py``).
A Gated DeltaNet layer (the hybrids) keeps what its GPU path and fla's chunked kernel save
(``_gated_delta_net_tensors``): read off their code, and measured on the H200 within 3.5% on
both backends (PERF_NOTES.md, session 28).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Callable, Collection, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from .mcore.context_parallel import kv_head_replication
from .mcore.parallel import ParallelSizes, padded_vocab_size
from .mcore.recompute import recompute_config_kwargs, refuse_offload_under_fp8
from .ops.linear_logprobs import CHUNK_ELEMENTS
from .planner import moe_layer_flags

GIB = 2**30
DEFAULT_MARGIN = 0.08  # of the device's memory: the allocator's fragmentation and what it does not count
HOST_SHARE = 0.5  # of the machine's memory, for pinned activations (a held prompt's, offloaded layers'; the rest: the data, the OS, the CPU copy of a checkpoint)
GRADIENT_FACTOR = 1.0  # a layer's backward working set over its activations


# ------------------------------------------------------------------------------------ parameters
@dataclass(frozen=True)
class ParameterCounts:
    """Parameters held by one rank: ``dense`` ones (replicated over dp x cp) and ``expert`` ones
    (replicated over the expert-data-parallel ranks)."""

    dense: int = 0
    expert: int = 0

    def __add__(self, other: "ParameterCounts") -> "ParameterCounts":
        return ParameterCounts(self.dense + other.dense, self.expert + other.expert)

    @property
    def total(self) -> int:
        return self.dense + self.expert


def _layer_config(config, layer_number: int):
    """The config of one layer (Gemma's full-attention layers have their own head dim and heads)."""
    for_layer = getattr(config, "for_layer", None)
    return for_layer(layer_number) if for_layer else config


def _keys_are_values(config, layer_number: int) -> bool:
    return bool(getattr(config, "full_attention_keys_are_values", False)) and config.is_full_attention(layer_number)


def layer_parameters(config, layer_number: int, sizes: ParallelSizes) -> ParameterCounts:
    """One decoder layer's parameters on one rank (``layer_number`` 1-based, as Megatron numbers them)."""
    h, d = config.hidden_size, _layer_config(config, layer_number).kv_channels
    norms = 2 * h + (2 * h if _has_post_norms(config) else 0)
    split = 0
    if _is_gated_delta_net(config, layer_number):
        gdn = _GatedDeltaNetWidths.of(config)
        # every rank holds the gated norm's weight whole (its heads share it); the conv and the
        # per-value-head decay parameters are split with the heads
        norms += config.linear_value_head_dim
        split = gdn.conv * config.linear_conv_kernel_dim + 2 * gdn.value_heads
    elif config.qk_layernorm:
        norms += 2 * d
    linears = layer_linear_parameters(config, layer_number, sizes)
    router = 0
    if moe_layer_flags(config)[layer_number - 1]:
        router = config.num_moe_experts * h
        if config.moe_shared_expert_intermediate_size and getattr(config, "moe_shared_expert_gate", False):
            router += h  # the shared expert's sigmoid gate, one row
    return linears + ParameterCounts(dense=norms + router + split // sizes.tp)


def layer_linear_parameters(config, layer_number: int, sizes: ParallelSizes) -> ParameterCounts:
    """The weights (and biases) of one decoder layer's linears on one rank (what Transformer Engine's
    linears quantize under FP8); no norms, no MoE router."""
    layer = _layer_config(config, layer_number)
    h, d = config.hidden_size, layer.kv_channels
    if _is_gated_delta_net(config, layer_number):
        gdn = _GatedDeltaNetWidths.of(config)
        mixer = h * gdn.in_proj + gdn.values * h
    else:
        q, kv = layer.num_attention_heads * d, layer.num_query_groups * d
        gate = q if getattr(config, "attention_output_gate", False) else 0
        kv_projections = 1 if _keys_are_values(config, layer_number) else 2
        qkv = h * (q + gate + kv_projections * kv) + (q + kv_projections * kv if config.add_qkv_bias else 0)
        mixer = qkv + q * h + (h if config.add_bias_linear else 0)
    gated = 2 if config.gated_linear_unit else 1
    if moe_layer_flags(config)[layer_number - 1]:
        f = config.moe_ffn_hidden_size
        experts = config.num_moe_experts * (gated + 1) * h * f
        shared = (gated + 1) * h * (config.moe_shared_expert_intermediate_size or 0)
        return ParameterCounts(dense=(mixer + shared) // sizes.tp, expert=experts // (sizes.ep * sizes.etp))
    mlp = (gated + 1) * h * config.ffn_hidden_size
    return ParameterCounts(dense=(mixer + mlp) // sizes.tp)


def _is_gated_delta_net(config, layer_number: int) -> bool:
    """A hybrid model's (Qwen3.5, Qwen3-Next) linear-attention layer, ``mcore.gated_delta_net``."""
    is_linear = getattr(config, "is_linear_attention", None)
    return bool(is_linear and is_linear(layer_number))


@dataclass(frozen=True)
class _GatedDeltaNetWidths:
    """A GDN layer's widths per token over all its heads (``DualKVGatedDeltaNet``; tp splits each)."""

    key_heads: int
    value_heads: int
    conv: int  # the short conv's channels: q and k of every key head, v of every value head
    values: int  # value heads x value head dim: o, the gate z, out_proj's input

    @classmethod
    def of(cls, config) -> "_GatedDeltaNetWidths":
        key_heads, value_heads = config.linear_num_key_heads, config.linear_num_value_heads
        values = value_heads * config.linear_value_head_dim
        return cls(key_heads, value_heads, 2 * key_heads * config.linear_key_head_dim + values, values)

    @property
    def in_proj(self) -> int:
        """in_proj's rows: the conv channels, then z, b and a."""
        return self.conv + self.values + 2 * self.value_heads


def _has_post_norms(config) -> bool:
    """Gemma's post-attention and post-feedforward norms (``GemmaTransformerConfig``)."""
    return hasattr(config, "full_attention_kv_channels")


def stage_layers(config, pp_rank: int, vp_stage: Optional[int] = None) -> List[int]:
    """The 1-based layer numbers of pipeline rank ``pp_rank`` (and model chunk ``vp_stage``), as Megatron
    splits them (uneven first/last stages included)."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return list(range(offset + 1, offset + count + 1))


def chunk_layers(config, sizes: ParallelSizes, pp_rank: int) -> List[List[int]]:
    """The layer numbers of each model chunk of pipeline stage ``pp_rank`` (one chunk without vpp)."""
    return [stage_layers(config, pp_rank, vp_stage) for vp_stage in ([None] if not sizes.vpp else range(sizes.vpp))]


def rank_parameters(config, vocab_size: int, tied: bool, sizes: ParallelSizes, pp_rank: int = 0) -> ParameterCounts:
    """The parameters of one rank of pipeline stage ``pp_rank`` (all its model chunks)."""
    counts = ParameterCounts()
    for layers in chunk_layers(config, sizes, pp_rank):
        for number in layers:
            counts = counts + layer_parameters(config, number, sizes)
    embedding = vocab_size * config.hidden_size // sizes.tp
    first, last = pp_rank == 0, pp_rank == sizes.pp - 1
    # the last stage holds the output layer, or its own copy of a tied embedding under pipelining
    vocab_matrices = int(first) + int(last and (not tied or sizes.pp > 1))
    return counts + ParameterCounts(dense=vocab_matrices * embedding + (config.hidden_size if last else 0))


# ------------------------------------------------------------------------------------ activations
@dataclass(frozen=True)
class SavedTensor:
    """One tensor a layer keeps for its backward: ``elements`` per token, ``bytes_per_element``,
    ``split``: "seq" (split by tp under sequence parallelism), "tp" (heads or ffn columns, split by
    tp), "none", "routed" (the top-k copies of a token that its experts' ranks hold whole),
    "routed_ffn" (their expert ffn columns, split by the expert tensor-parallel size); ``freed_by``:
    the selective recompute field that drops it (``SELECTIVE_RECOMPUTE_FIELDS``: a norm output, the
    normed and rotated q and k, an MLP activation)."""

    name: str
    elements: int
    bytes_per_element: int = 2
    split: str = "tp"
    freed_by: Optional[str] = None
    kept_in_fp8: bool = False
    """Under FP8 a 1-byte copy is kept instead, whatever the recompute: by the Transformer Engine
    linear that reads it (which keeps it for nothing else), or by Megatron's fused SwiGLU (its input,
    ``activation_func_fp8_input_store``)."""

    def under_fp8(self) -> "SavedTensor":
        if not self.kept_in_fp8:
            return self
        return replace(self, name=self.name + " (its FP8 copy)", bytes_per_element=1, freed_by=None)


def layer_tensors(config, layer_number: int, layout: str = "packed", transformer_engine: bool = False,
                  fp8: bool = False) -> List[SavedTensor]:
    """What one layer of our specs keeps for its backward, per token (bf16 unless said).

    transformer_engine: the TE spec (``dualkv_te_block_spec``, ``gemma_block_spec``), which keeps the
    same tensors but for TE's experts' activation; fp8: its linears in FP8 (``SavedTensor.under_fp8``).
    A norm fused into TE's linear keeps its input and output as ours do; where selective recompute
    frees the output, the norm is ours."""
    tensors = _layer_tensors(config, layer_number, layout, transformer_engine)
    if fp8:
        tensors = [t.under_fp8() for t in tensors]
        if _is_gated_delta_net(config, layer_number):
            tensors.append(SavedTensor("out_proj's FP8 copy of its input", _GatedDeltaNetWidths.of(config).values, 1))
        else:
            layer = _layer_config(config, layer_number)
            tensors.append(SavedTensor("linear_proj's FP8 copy of the attention output",
                                       layer.num_attention_heads * layer.kv_channels, 1))
    return tensors


def _layer_tensors(config, layer_number: int, layout: str, transformer_engine: bool) -> List[SavedTensor]:
    h = config.hidden_size
    b = 2 if config.params_dtype in (torch.bfloat16, torch.float16) else 4
    tensors = [
        SavedTensor("input norm: its input (the residual stream)", h, b, "seq"),
        SavedTensor("input norm: its output, the mixer's input", h, b, "seq", "recompute_norms", kept_in_fp8=True),
    ]
    if _is_gated_delta_net(config, layer_number):
        tensors += _gated_delta_net_tensors(config, b)
    else:
        tensors += _attention_tensors(config, layer_number, layout, b)
    if _has_post_norms(config):
        tensors.append(SavedTensor("post-attention and post-feedforward norms: their inputs", 2 * h, b, "seq"))
    moe = moe_layer_flags(config)[layer_number - 1]
    tensors += [
        SavedTensor("pre-MLP norm: its input", h, b, "seq"),
        # a dense MLP's fc1 keeps its own FP8 copy; the router and the routed experts read it in bf16
        SavedTensor("pre-MLP norm: its output, the MLP's (router's) input", h, b, "seq", "recompute_norms",
                    kept_in_fp8=not moe),
    ]
    return tensors + (_moe_tensors(config, transformer_engine, b) if moe else _mlp_tensors(config, b))


def _attention_tensors(config, layer_number: int, layout: str, b: int) -> List[SavedTensor]:
    layer = _layer_config(config, layer_number)
    d, heads, groups = layer.kv_channels, layer.num_attention_heads, layer.num_query_groups
    values = 0 if _keys_are_values(config, layer_number) else groups
    gated = getattr(config, "attention_output_gate", False)
    gates = heads if gated else 0
    tensors = [
        # Megatron's query reshape copies q out of linear_qkv's output; k and v stay views of it,
        # so the k norm's saved input keeps the whole output alive. "selective" recomputes q and k
        # (reshape, norm, RoPE) from their views of that output, which v keeps alive anyway.
        SavedTensor("q norm: its input, a copy of q", heads * d, b, "tp", "recompute_qk_norm_rope"),
        SavedTensor("k norm: its input, a view of linear_qkv's output (q, its gates, k, v)",
                    (heads + gates + groups + values) * d, b),
        SavedTensor("RoPE cos/sin of q and k", 4 * d, b, "none", "recompute_qk_norm_rope"),
        SavedTensor("attention: q and k after RoPE", (heads + groups) * d, b, "tp", "recompute_qk_norm_rope"),
        SavedTensor("attention: its output (without an output gate linear_proj's input)", heads * d, b),
        SavedTensor("q and k norm statistics (fp32)", heads + groups, 4, "tp", "recompute_qk_norm_rope"),
        SavedTensor("input and pre-MLP norm statistics, the attention's log-sum-exp (fp32)", heads + 2, 4),
    ]
    if gated:
        # the output gate (ops.output_gate) keeps the gate's copy out of linear_qkv's output, and its
        # product, not the attention output, is linear_proj's input
        tensors += [SavedTensor("output gate: the gate heads, its input", heads * d, b),
                    SavedTensor("output gate: its product, linear_proj's input", heads * d, b)]
    if layout == "replicated":
        tensors.append(SavedTensor("attention output made contiguous for linear_proj", heads * d, b))
    if getattr(config, "value_norm", False):
        tensors.append(SavedTensor("value norm: the normed values", groups * d, b))
    return tensors


# fla's chunk_gated_delta_rule: its intra-chunk matrix A has one row of this many entries per token
GDN_CHUNK_SIZE = 64


def _gated_delta_net_tensors(config, b: int) -> List[SavedTensor]:
    """What a GDN layer's GPU path keeps (``DualKVGatedDeltaNet`` with fla-core 0.6.0's
    ``chunk_gated_delta_rule``, ``use_qk_l2norm_in_kernel=True``): the kernel's ``save_for_backward``
    is q and k L2-normed (its own copies) with their rstd, v, the decay's chunk cumsum, beta, A
    (the solved intra-chunk matrix, in the keys' dtype) and the initial states.

    Per segment rather than per token, and not counted: each segment's initial recurrent state
    (value heads x Dk x Dv in fp32) and its conv tail (K-1 rows of the conv channels). Qwen3.5-4B,
    one 16-response group (17 segments): 24 GDN layers x 17 x (2 MiB + 48 KiB) = 0.82 GiB, under 1%
    of those layers' 150 KiB per token at 24,576 tokens (85 GiB).

    The short conv's Triton kernels keep its input alone (the backward recomputes the activation's
    input), with recompute or without; its output is not kept either: fla's kernel copies q, k and
    v. Selective recompute frees, beside the layer's norm outputs and MLP activation, the gated
    norm's output. The rest is a matmul's output or fla's own, which only re-running in_proj or the
    kernel would give back (the full recompute of the layer)."""
    gdn = _GatedDeltaNetWidths.of(config)
    return [
        SavedTensor("short conv: its input", gdn.conv, b),
        SavedTensor("beta and the decay g (fp32)", 2 * gdn.value_heads, 4),
        SavedTensor("delta rule: its L2-normed q and k, and v", gdn.conv, b),
        SavedTensor("delta rule: q and k's rstd, the decay's chunk cumsum (fp32)", 2 * gdn.key_heads + gdn.value_heads, 4),
        SavedTensor("delta rule: A, each value head's row of its chunk's matrix", GDN_CHUNK_SIZE * gdn.value_heads, b),
        SavedTensor("delta rule: its output o, the gated norm's input", gdn.values, b),
        SavedTensor("gated norm: the gate z, copied out of in_proj's output per value head", gdn.values, b),
        SavedTensor("gated norm: its output, out_proj's input", gdn.values, b, freed_by="recompute_norms"),
        SavedTensor("input and pre-MLP norm statistics (fp32)", 2, 4, "seq"),
    ]


def _mlp_tensors(config, b: int) -> List[SavedTensor]:
    f, gated = config.ffn_hidden_size, 2 if config.gated_linear_unit else 1
    return [
        SavedTensor("fc1 output, the activation's input", gated * f, b, kept_in_fp8=_fused_swiglu(config)),
        SavedTensor("activation output, fc2's input", f, b, "tp", "recompute_activations", kept_in_fp8=True),
    ]


def _moe_tensors(config, transformer_engine: bool, b: int) -> List[SavedTensor]:
    h, gated = config.hidden_size, 2 if config.gated_linear_unit else 1
    k, f, experts = config.moe_router_topk, config.moe_ffn_hidden_size, config.num_moe_experts
    mlp = [
        SavedTensor("router: scores, top-k and the load-balancing statistics (fp32)", experts + 10 * k, 4, "seq"),
        SavedTensor("routed tokens, the experts' fc1 input", k * h, b, "routed", kept_in_fp8=True),
        SavedTensor("experts' fc1 output, the activation's input", k * gated * f, b, "routed_ffn"),
    ]
    if transformer_engine:  # Megatron's weighted SwiGLU keeps its input; fc2 keeps its output
        mlp.append(SavedTensor("experts' activation, fc2's input", k * f, b, "routed_ffn", "recompute_activations",
                               kept_in_fp8=True))
    else:
        mlp.append(SavedTensor("experts' SwiGLU: silu(gate), its product, the weighted activation", 3 * k * f, b,
                               "routed_ffn", "recompute_activations"))
    shared = config.moe_shared_expert_intermediate_size or 0
    if shared:  # an MLP beside the experts, which selective recompute leaves alone
        mlp += [SavedTensor("shared expert: fc1 output", gated * shared, b, kept_in_fp8=_fused_swiglu(config)),
                SavedTensor("shared expert: activation output, fc2's input", shared, b, kept_in_fp8=True)]
        if getattr(config, "moe_shared_expert_gate", False):  # output * sigmoid(x w) keeps both factors
            mlp.append(SavedTensor("shared expert gate: the expert's output and the gate", h + 1, b, "seq"))
    return mlp


def _fused_swiglu(config) -> bool:
    """Whether a dense MLP's activation is Megatron's fused SwiGLU, as ``build_model`` sets it up on a
    GPU (``bias_activation_fusion``), which keeps its input in FP8 under FP8."""
    return bool(config.gated_linear_unit and config.activation_func is F.silu)


def _per_token_bytes(tensors: Sequence[SavedTensor], sizes: ParallelSizes, freed: Collection[str]) -> float:
    splits = {"seq": sizes.tp if sizes.sp else 1, "tp": sizes.tp, "none": 1, "routed": 1, "routed_ffn": sizes.etp}
    return sum(t.elements * t.bytes_per_element / splits[t.split] for t in tensors if t.freed_by not in freed) / sizes.cp


def selectively_freed(mode: str, fp8: bool) -> Tuple[str, ...]:
    """The selective recompute fields that recompute ``mode`` turns on in a layer it runs that way."""
    if mode != "selective":
        return ()
    return tuple(k for k, v in recompute_config_kwargs(mode, fp8=fp8).items() if k.startswith("recompute_") and v is True)


def layer_activation_bytes(config, layer_number: int, sizes: ParallelSizes, mode: str, layout: str = "packed",
                           transformer_engine: bool = False, fp8: bool = False) -> float:
    """Bytes per micro-batch token that one layer keeps on the device until its backward, under
    recompute ``mode`` ("none", "selective", "full": the layer recomputed whole, keeping its input, or
    "host": offloaded, keeping nothing there); the spec as ``layer_tensors`` takes it."""
    if mode == "host":
        return 0.0
    if mode == "full":
        b = 2 if config.params_dtype in (torch.bfloat16, torch.float16) else 4
        return config.hidden_size * b / (sizes.tp if sizes.sp else 1) / sizes.cp
    tensors = layer_tensors(config, layer_number, layout, transformer_engine, fp8)
    return _per_token_bytes(tensors, sizes, selectively_freed(mode, fp8))


def _check_recompute(mode: str, layers: Optional[int], max_layers: int, fp8: bool) -> None:
    recompute_config_kwargs(mode, layers)  # the mode and N, as build_model checks them
    refuse_offload_under_fp8(layers if mode == "offload" else None, fp8)
    if layers is not None and layers > max_layers:
        raise ValueError(f"recompute_layers={layers} is more than the {max_layers} layers of a pipeline stage")


def layer_modes(mode: str, recompute_layers: Optional[int], layers: Sequence[int]) -> List[str]:
    """Each of a stage's (or model chunk's) layers' recompute: ``mode``, except that ``recompute_layers``
    = N fully recomputes the first N (Megatron's "block" method) and leaves the others at "selective"
    (mode "selective") or at "none" (mode "full"); mode "offload" offloads the first N ("host") and
    leaves the others at "selective"."""
    if mode == "none" or recompute_layers is None:
        return [mode] * len(layers)
    first = "host" if mode == "offload" else "full"
    rest = "none" if mode == "full" else "selective"
    return [first if i < recompute_layers else rest for i in range(len(layers))]


def offloadable_layers(stage_layers: int) -> int:
    """The most layers of a stage that ``recompute="offload"`` takes: a third. A layer's saved tensors
    take about three layers' forward to copy over PCIe 5 (~80-100 KiB a token against ~0.6 us of
    forward a token and layer on an H200), so the copies of a third of the layers still hide behind
    the forward; and the backward's copies back (``mcore.offload.prefetch_distance`` layers ahead)
    then stay below the activations' peak."""
    return stage_layers // 3


# ------------------------------------------------------------------------------------ the model
@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted bytes of one rank, by part (``parts``: name -> bytes)."""

    parts: Dict[str, float]
    host: float = 0.0  # pinned host memory beside it (prefix reuse's prompt activations, offloaded layers')

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    @property
    def total_gib(self) -> float:
        return self.total / GIB

    def describe(self) -> str:
        host = f", and {self.host / GIB:.1f} GiB on the host" if self.host else ""
        return (", ".join(f"{name} {value / GIB:.1f}" for name, value in self.parts.items())
                + f" = {self.total_gib:.1f} GiB" + host)


@dataclass(frozen=True)
class MemoryModel:
    """Memory of one policy-update step on every rank of a model (see the module docstring).

    config: the model's ``TransformerConfig`` (``build_transformer_config`` gives it without building);
    vocab_size: the (padded) vocabulary of the embedding and output layer; tied: shared embedding and
    output weights. dp: data-parallel size (for the distributed optimizer's shards). ref_model: a
    frozen bf16 reference policy of the same layout is resident. offload: ``fit`` may also offload
    layers before it recomputes any whole (not beside prefix reuse's held prompt, nor under FP8); on
    an H200 the copies hide where whole-layer recompute costs its forward again (docs/memory.md).
    """

    config: object
    vocab_size: int
    tied: bool
    sizes: ParallelSizes = field(default_factory=ParallelSizes)
    dp: int = 1
    distributed_optimizer: bool = False
    ref_model: bool = False
    transformer_engine: bool = False
    fp8: bool = False
    offload: bool = True  # ``fit``'s ladder also offers offloaded layers (``recompute="offload"``)

    @classmethod
    def for_card(cls, card, sizes: ParallelSizes = ParallelSizes(), dtype: torch.dtype = torch.bfloat16, dp: int = 1,
                 distributed_optimizer: bool = False, ref_model: bool = False, make_vocab_size_divisible_by: int = 128,
                 transformer_engine: bool = False, fp8: bool = False, offload: bool = True,
                 **overrides) -> "MemoryModel":
        """The model of a card (name, file or ``ModelCard``) as ``build_model`` would build it, without
        building it: ``overrides`` are ``build_model``'s config overrides (recompute is ``predict``'s);
        transformer_engine, fp8: its layer spec (``layer_tensors``); offload: as the field."""
        from .models.builder import build_transformer_config, family_of
        from .models.cards import load_card

        card = load_card(card)
        family = family_of(card)
        config = build_transformer_config(card, family, sizes, dtype, False, overrides)
        kwargs = family.gpt_model_kwargs(card)
        vocab_size = padded_vocab_size(kwargs["vocab_size"], sizes.tp, make_vocab_size_divisible_by)
        return cls(config, vocab_size, bool(kwargs.get("share_embeddings_and_output_weights")), sizes, dp,
                   distributed_optimizer, ref_model, transformer_engine, fp8, offload)

    # ---------------------------------------------------------------- static
    def static_parts(self, pp_rank: int = 0) -> Dict[str, float]:
        """Weights, fp32 gradient buffer, optimizer state (fp32 main weights for 16-bit models, Adam's
        two moments), and the reference model's weights."""
        params = rank_parameters(self.config, self.vocab_size, self.tied, self.sizes, pp_rank)
        half = self.config.params_dtype in (torch.bfloat16, torch.float16)
        weight_bytes = 2 if half else 4
        optimizer_bytes = (4 if half else 0) + 8
        dense_shards = self.dp * self.sizes.cp if self.distributed_optimizer else 1
        expert_shards = self._expert_dp() if self.distributed_optimizer else 1
        parts = {
            "weights": params.total * weight_bytes,
            "gradients": params.total * 4,  # Megatron's DDP buffer, grad_reduce_in_fp32
            "optimizer": optimizer_bytes * (params.dense / dense_shards + params.expert / expert_shards),
        }
        if self.ref_model:
            parts["reference model"] = params.total * 2
        return parts

    @property
    def _spec(self) -> Tuple[bool, bool]:
        return self.transformer_engine, self.fp8

    def _expert_dp(self) -> int:
        return max(1, self.dp * self.sizes.tp * self.sizes.cp // (self.sizes.ep * self.sizes.etp))

    # ---------------------------------------------------------------- activations
    def fp8_weight_bytes(self, mode: str, recompute_layers: Optional[int] = None, pp_rank: int = 0) -> float:
        """What FP8 linears keep of their weights for the backward of one micro-batch: each layer that is
        not recomputed whole keeps its linears' FP8 weights in both layouts (Hopper's FP8 matmuls read
        the weight and its transpose), 2 bytes a weight (``build_model`` turns TE's cache of them
        across micro-batches off). 0 without FP8."""
        if not self.fp8:
            return 0.0
        total = 0.0
        for layers in chunk_layers(self.config, self.sizes, pp_rank):
            for number, layer_mode in zip(layers, layer_modes(mode, recompute_layers, layers)):
                if layer_mode != "full":
                    total += 2 * layer_linear_parameters(self.config, number, self.sizes).total
        return total

    def activation_bytes_per_token(self, mode: str, recompute_layers: Optional[int] = None, pp_rank: int = 0,
                                   layout: str = "packed") -> float:
        """Bytes per micro-batch token that all layers of one rank keep until the backward."""
        total = 0.0
        for layers in chunk_layers(self.config, self.sizes, pp_rank):
            for number, layer_mode in zip(layers, layer_modes(mode, recompute_layers, layers)):
                total += layer_activation_bytes(self.config, number, self.sizes, layer_mode, layout, *self._spec)
        return total

    def in_flight_micro_batches(self, num_micro_batches: int, pp_rank: int = 0) -> float:
        """Micro-batches whose activations a rank holds at once: 1F1B's warm-up depth plus one, in units
        of the rank's whole model (an interleaved schedule's chunks count 1/vpp each)."""
        pp, vpp = self.sizes.pp, self.sizes.vpp
        if pp == 1:
            return 1.0
        if not vpp:
            return float(min(pp - pp_rank, num_micro_batches))
        chunks = (pp - pp_rank - 1) * 2 + (vpp - 1) * pp + 1  # Megatron's interleaved warm-up, plus one
        return min(chunks, num_micro_batches * vpp) / vpp

    # ---------------------------------------------------------------- transients
    def transient_bytes(self, tokens: int, predicting_rows: int, mode: str, recompute_layers: Optional[int],
                        pp_rank: int = 0, layout: str = "packed") -> float:
        """The largest working set on top of the held activations: one layer's backward (the gradient
        tensors of its widest parts, and its recomputed activations where recompute drops them), and on
        the last stage the output layer's logits chunk."""
        sizes, config = self.sizes, self.config
        local_tokens = tokens / sizes.cp
        layers = [n for chunk in chunk_layers(self.config, self.sizes, pp_rank) for n in chunk]
        widest = max(layers, key=lambda n: layer_activation_bytes(config, n, sizes, "none", layout, *self._spec))
        none_bytes = layer_activation_bytes(config, widest, sizes, "none", layout, *self._spec) * tokens
        # an offloaded layer's backward holds its selective set again, back from the host
        deepest = "selective" if mode == "offload" else "full" if mode == "full" or recompute_layers else mode
        held = layer_activation_bytes(config, widest, sizes, deepest, layout, *self._spec) * tokens
        # a layer's backward needs gradients about as large as the activations it differentiates, and a
        # recomputed layer holds what it dropped again during its own backward
        transient = GRADIENT_FACTOR * none_bytes + (none_bytes - held)
        if pp_rank == self.sizes.pp - 1:
            rows = predicting_rows / sizes.cp
            # one vocabulary chunk of logits and its gradient (bounded in fp32), the gathered hidden
            # states under SP, and their fp32 gradient (ops/linear_logprobs.py)
            chunk = min(rows * self.vocab_size / sizes.tp, CHUNK_ELEMENTS)
            hidden = 2 * config.hidden_size * (tokens if sizes.sp else local_tokens)
            transient = max(transient, 2 * chunk * 4 + hidden + 4 * rows * config.hidden_size)
        return transient

    def held_prompt_bytes(self, prompt_tokens: int, mode: str, recompute_layers: Optional[int] = None,
                          pp_rank: int = 0, prompt_on_host: bool = False) -> float:
        """What prefix reuse (``rl.prefix_reuse``) keeps beside the activations while a group's parts
        run: per layer, the gradients its parts accumulate for the held prompt K/V, and copies of
        what the prompt's layer does not keep itself: its keys where selective recompute frees them
        (``recompute_qk_norm_rope``), its keys and values where the layer is recomputed whole (else
        the held K/V are views of what its attention keeps, counted in the activations). With the
        prompt's activations on the host, every layer's held K/V count: nothing else keeps them. A
        Gated DeltaNet layer holds a copy of its prompt's final state and conv tail, and their
        gradients, whatever the prompt's length."""
        rows = {"none": 2, "selective": 3, "full": 4}
        return self._held_rows_bytes(prompt_tokens, lambda layer_mode: 4 if prompt_on_host else rows[layer_mode],
                                     mode, recompute_layers, pp_rank)

    def _held_rows_bytes(self, prompt_tokens: int, rows_of: Callable[[str], int], mode: str,
                         recompute_layers: Optional[int], pp_rank: int) -> float:
        """``rows_of(layer mode)`` rows of the prompt's K/V shape per attention layer, and per GDN layer
        its state and conv tail and their gradients."""
        config = self.config
        element = 2 if config.params_dtype in (torch.bfloat16, torch.float16) else 4
        total = 0.0
        for layers in chunk_layers(config, self.sizes, pp_rank):
            for number, layer_mode in zip(layers, layer_modes(mode, recompute_layers, layers)):
                if _is_gated_delta_net(config, number):
                    total += 2 * self._held_state_bytes(element)
                    continue
                # Gemma's full-attention layers hold their own heads and head dim
                layer = _layer_config(config, number)
                row = self._held_kv_heads(layer) * layer.kv_channels * element * prompt_tokens
                total += row * rows_of(layer_mode)
        return total

    def _held_state_bytes(self, element: int) -> float:
        """A GDN layer's final state (fp32, per value head Dk x Dv) and K-1 rows of its conv input, on a
        rank: its TP share of the heads, under Ulysses CP its share after the all-to-all."""
        config, gdn = self.config, _GatedDeltaNetWidths.of(self.config)
        state = gdn.value_heads * config.linear_key_head_dim * config.linear_value_head_dim * 4
        tail = (config.linear_conv_kernel_dim - 1) * gdn.conv * element
        return (state + tail) / (self.sizes.tp * self.sizes.cp)

    def _held_kv_heads(self, layer) -> int:
        """The K/V heads whose prompt rows a rank holds: its TP share, under Ulysses CP its share
        after the all-to-all (each KV head replicated where cp does not divide them)."""
        tp, cp = self.sizes.tp, self.sizes.cp
        heads = max(1, layer.num_query_groups // tp)
        return heads * kv_head_replication(layer.num_attention_heads // tp, heads, cp) // cp

    def _prompt_on_host_peak(self, tokens: int, rows: int, recompute: str, recompute_layers: Optional[int],
                             num_micro_batches: int, pp_rank: int, layout: str, held: int) -> MemoryEstimate:
        """Prefix reuse with the prompt's saved activations on the host (``prefix_reuse_prompt_on_host``):
        the larger of two phases. While the parts run, a part's own activations and backward beside the
        held K/V and their gradients; in the prompt's one backward, a layer's backward at the prompt's
        length with that layer's saved tensors back from the host, beside the held gradients (the held
        copies are dropped by then, and each layer's gradient once used)."""
        part_tokens = max(tokens - held, 1)
        parts = self._micro_batch_estimate(
            part_tokens, min(rows, part_tokens), recompute, recompute_layers, num_micro_batches, pp_rank, layout,
            self.held_prompt_bytes(held, recompute, recompute_layers, pp_rank, prompt_on_host=True))
        # On the host a layer keeps what autograd saves without selective recompute: that recompute
        # frees outputs on the GPU after their consumers saved them, and here the consumers' saves
        # are the copies (``recompute.outputs_kept``). Layers recomputed whole keep their inputs.
        layers = [(n, m) for chunk in chunk_layers(self.config, self.sizes, pp_rank)
                  for n, m in zip(chunk, layer_modes(recompute, recompute_layers, chunk))]
        host_layer_bytes = [layer_activation_bytes(self.config, n, self.sizes, "full" if m == "full" else "none", layout,
                                                   *self._spec) for n, m in layers]
        # The prompt's backward goes one layer at a time at the prompt's length: a layer that kept its
        # activations gets them back from the host, one recomputed whole computes them again, so
        # either holds its no-recompute activations beside its backward's working set.
        widest = max(layer_activation_bytes(self.config, n, self.sizes, "none", layout, *self._spec) for n, _ in layers)
        backward = {**self.static_parts(pp_rank),
                    "activations": widest * held,
                    "transient": self.transient_bytes(held, 1, "none", None, pp_rank, layout),
                    "held prompt": self._held_rows_bytes(held, lambda layer_mode: 2, recompute, recompute_layers,
                                                         pp_rank)}
        on_host = sum(host_layer_bytes) * held  # what the prompt's forward saves, all of it copied out
        return max(MemoryEstimate(parts.parts, on_host), MemoryEstimate(backward, on_host),
                   key=lambda estimate: estimate.total)

    # ---------------------------------------------------------------- totals
    def predict(self, tokens: int, predicting_rows: Optional[int] = None, recompute: str = "none",
                recompute_layers: Optional[int] = None, num_micro_batches: int = 1, pp_rank: int = 0,
                layout: str = "packed", held_prompt_tokens: int = 0, prompt_on_host: bool = False) -> MemoryEstimate:
        """Peak of pipeline rank ``pp_rank`` when every micro-batch has ``tokens`` tokens (the packed
        count before the TP/CP split; replicated: the padded batch's tokens) of which
        ``predicting_rows`` (default: all) predict a trained token. ``held_prompt_tokens``: the
        longest prompt that prefix reuse holds (its part's ``tokens`` count it, as a sub-group's
        would: its activations stay alive while the parts run), whose ``held_prompt_bytes`` add a
        part "held prompt"; ``prompt_on_host``: its activations wait on the host instead
        (``_prompt_on_host_peak``)."""
        _check_recompute(recompute, recompute_layers, self._min_chunk_layers(), self.fp8)
        if held_prompt_tokens and recompute == "offload":
            raise ValueError("prefix reuse does not run with offloaded layers (recompute='offload'): its held "
                             "prompt K/V are views of what the prompt's layers save")
        rows = tokens if predicting_rows is None else predicting_rows
        if held_prompt_tokens and prompt_on_host:
            return self._prompt_on_host_peak(tokens, rows, recompute, recompute_layers, num_micro_batches, pp_rank,
                                             layout, held_prompt_tokens)
        held = (self.held_prompt_bytes(held_prompt_tokens, recompute, recompute_layers, pp_rank)
                if held_prompt_tokens else None)
        return self._micro_batch_estimate(tokens, rows, recompute, recompute_layers, num_micro_batches, pp_rank, layout,
                                          held, held_prompt_tokens)

    def _micro_batch_estimate(self, tokens: int, rows: int, recompute: str, recompute_layers: Optional[int],
                              num_micro_batches: int, pp_rank: int, layout: str,
                              held_bytes: Optional[float], held_tokens: int = 0) -> MemoryEstimate:
        """The static parts, the in-flight micro-batches' activations, one backward's transient, and
        what prefix reuse holds beside them (``held_bytes``; None: no part "held prompt"). Of each
        micro-batch's ``tokens``, ``held_tokens`` are the held prompt's, whose activations a rank
        keeps once however many of its parts a pipeline stage holds at once."""
        parts = dict(self.static_parts(pp_rank))
        per_token = self.activation_bytes_per_token(recompute, recompute_layers, pp_rank, layout)
        in_flight = self.in_flight_micro_batches(num_micro_batches, pp_rank)
        fp8_weights = self.fp8_weight_bytes(recompute, recompute_layers, pp_rank)
        parts["activations"] = per_token * ((tokens - held_tokens) * in_flight + held_tokens) + fp8_weights * in_flight
        parts["transient"] = self.transient_bytes(tokens, rows, recompute, recompute_layers, pp_rank, layout)
        if held_bytes is not None:
            parts["held prompt"] = held_bytes
        host = 0.0
        if recompute == "offload":  # what the offloaded layers would keep under selective
            host = (self.activation_bytes_per_token("selective", None, pp_rank, layout) - per_token) * tokens * in_flight
        return MemoryEstimate(parts, host)

    def peak(self, *args, **kwargs) -> MemoryEstimate:
        """``predict`` of the pipeline rank with the largest peak."""
        return max((self.predict(*args, pp_rank=r, **kwargs) for r in range(self.sizes.pp)), key=lambda e: e.total)

    def _min_chunk_layers(self) -> int:
        return min(len(layers) for r in range(self.sizes.pp) for layers in chunk_layers(self.config, self.sizes, r))

    def recompute_ladder(self, offload: bool = True) -> List[Tuple[str, Optional[int]]]:
        """Recompute settings from the cheapest to the one that saves the most memory: none, selective,
        (with ``offload``) the first 1, 2, ... of ``offloadable_layers`` layers of each stage offloaded,
        selective with the first 1, 2, ... layers of each stage fully recomputed, full."""
        layers = self._min_chunk_layers()
        offloaded = [("offload", n) for n in range(1, offloadable_layers(layers) + 1)] if offload else []
        return ([("none", None), ("selective", None)] + offloaded + [("selective", n) for n in range(1, layers)]
                + [("full", None)])

    def fit(self, budget_bytes: float, min_tokens: int, predicting_fraction: float = 1.0,
            recompute: Optional[str] = None, recompute_layers: Optional[int] = None, num_micro_batches: int = 1,
            layout: str = "packed", multiple: int = 1,
            micro_batch: Optional[Callable[[int], Tuple[int, int]]] = None, held_prompt_tokens: int = 0,
            prompt_on_host: bool = False, host_budget_bytes: Optional[float] = None) -> "Fit":
        """The least recompute (``recompute`` None: the first of ``recompute_ladder``; else the one given)
        under which a micro-batch of ``min_tokens`` fits ``budget_bytes``, and the most tokens (a multiple
        of ``multiple``, at least ``min_tokens``) it fits. ``predicting_fraction``: the share of the tokens
        that predict a trained token. ``micro_batch``: when the tokens are the packed-token budget of
        ``plan_micro_batches`` rather than a micro-batch's tokens on ``layout`` (the launch script plans
        the replicated layout's micro-batches by packed tokens), the largest micro-batch that a budget
        of n makes, as (its tokens on ``layout``, its rows predicting a trained token).
        ``held_prompt_tokens``, ``prompt_on_host``: as in ``predict`` (prefix reuse's longest held
        prompt); a setting fits only where what it puts on the host fits ``host_budget_bytes`` too
        (default ``host_budget()``). ValueError when even the last setting does not fit
        ``min_tokens``, naming the budget and that setting's peak.
        """
        offload = self.offload and not self.fp8 and not held_prompt_tokens
        ladder = (self.recompute_ladder(offload) if recompute is None
                  else [(recompute, recompute_layers)])
        micro_batch = micro_batch or (lambda n: (n, int(n * predicting_fraction)))

        def fit_at(n: int, setting) -> Fit:
            return self.fit_at(n, *setting, num_micro_batches=num_micro_batches, layout=layout, micro_batch=micro_batch,
                               held_prompt_tokens=held_prompt_tokens, prompt_on_host=prompt_on_host)

        host_budget_bytes = host_budget() if host_budget_bytes is None else host_budget_bytes
        for setting in ladder:
            least = fit_at(min_tokens, setting).estimate
            if least.total <= budget_bytes and least.host <= host_budget_bytes:
                most = self._most_tokens(lambda n: fit_at(n, setting).estimate.total, budget_bytes, multiple, min_tokens)
                return fit_at(most, setting)
        last = fit_at(min_tokens, ladder[-1])
        if last.estimate.host > host_budget_bytes:
            raise ValueError(f"the held prompt's activations need {last.estimate.host / GIB:.1f} GiB of pinned host "
                             f"memory with {ladder[-1][0]} recompute, over the host budget of "
                             f"{host_budget_bytes / GIB:.1f} GiB")
        raise ValueError(
            f"a micro-batch of {last.micro_batch_tokens:,} tokens"
            + ("" if last.micro_batch_tokens == min_tokens else f" on the {layout} layout (planned with {min_tokens:,})")
            + f" needs more than the memory budget of {budget_bytes / GIB:.1f} GiB: "
            f"with {ladder[-1][0]} recompute it takes {last.estimate.describe()}; use more ranks "
            "(tp, pp, cp) or shorter sequences"
        )

    def fit_holding_prompt(self, budget_bytes: float, min_tokens: int, *args, held_prompt_tokens: int = 0,
                           **kwargs) -> "Fit":
        """``fit`` beside prefix reuse's held prompt: with the prompt's activations on the GPU, else,
        where no setting fits so, on the host (``prompt_on_host``; the copies cost its activations over
        PCIe twice a step, far less than carrying the prompt in sub-groups). What the launch script,
        the benchmark and the planning table run."""
        try:
            return self.fit(budget_bytes, min_tokens, *args, held_prompt_tokens=held_prompt_tokens, **kwargs)
        except ValueError:
            if not held_prompt_tokens:
                raise
        return self.fit(budget_bytes, min_tokens, *args, held_prompt_tokens=held_prompt_tokens, prompt_on_host=True,
                        **kwargs)

    def fit_at(self, tokens: int, recompute: str, recompute_layers: Optional[int] = None, num_micro_batches: int = 1,
               layout: str = "packed", micro_batch: Optional[Callable[[int], Tuple[int, int]]] = None,
               held_prompt_tokens: int = 0, prompt_on_host: bool = False) -> "Fit":
        """The ``Fit`` of one setting at ``tokens`` (``fit``'s arguments; ``micro_batch`` None: all rows
        predict), whether it fits or not: what a run with that setting is predicted to take."""
        layout_tokens, rows = (tokens, tokens) if micro_batch is None else micro_batch(tokens)
        estimate = self.peak(layout_tokens, rows, recompute, recompute_layers, num_micro_batches, layout=layout,
                             held_prompt_tokens=held_prompt_tokens, prompt_on_host=prompt_on_host)
        return Fit(recompute, recompute_layers, tokens, estimate, layout, layout_tokens,
                   prompt_on_host and held_prompt_tokens > 0)

    @staticmethod
    def _most_tokens(peak_of, budget: float, multiple: int, least: int) -> int:
        """The largest multiple of ``multiple`` whose peak fits (peaks grow with tokens), searched upwards
        from ``least`` (which fits), or ``least`` when no larger multiple does."""
        lo = -(-least // multiple)
        if peak_of(lo * multiple) > budget:
            return least
        hi = 2 * lo
        while peak_of(hi * multiple) <= budget:
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if peak_of(mid * multiple) <= budget else (lo, mid)
        return lo * multiple


@dataclass(frozen=True)
class Fit:
    """What ``MemoryModel.fit`` picked."""

    recompute: str
    recompute_layers: Optional[int]
    tokens: int  # the tokens ``fit`` searched over: a micro-batch's, or its planning budget (``micro_batch``)
    estimate: MemoryEstimate
    layout: str
    micro_batch_tokens: int  # of the largest micro-batch, in ``layout``
    prompt_on_host: bool = False  # prefix reuse's held prompt keeps its activations on the host

    def layers_recomputed_whole(self, num_layers: int, stages: int) -> int:
        """Of a model's ``num_layers`` over ``stages`` pipeline stages (model chunks), how many this setting
        recomputes whole."""
        if self.recompute == "full":
            return num_layers
        return 0 if self.recompute == "offload" else (self.recompute_layers or 0) * stages

    def describe(self) -> str:
        kind = "offloaded" if self.recompute == "offload" else "full"
        layers = "" if self.recompute_layers is None else f" + {self.recompute_layers} {kind} layer(s) per stage"
        layers += ", the held prompt's activations on the host" if self.prompt_on_host else ""
        micro_batch = (f"micro-batch {self.tokens:,} {self.layout} tokens" if self.micro_batch_tokens == self.tokens else
                       f"micro-batches planned with {self.tokens:,} packed tokens, the largest {self.micro_batch_tokens:,} "
                       f"{self.layout} tokens")
        return f"layout {self.layout}, recompute {self.recompute}{layers}, {micro_batch}, predicted peak {self.estimate.describe()}"


def setting_label(recompute: str, recompute_layers: Optional[int], prompt_on_host: bool = False) -> str:
    """A setting as the tables print it: "selective+31" (31 layers also recomputed whole), "offload+8"
    (8 layers offloaded, selective in all), with ", prompt on host" where prefix reuse's prompt keeps its
    activations there."""
    return (recompute + (f"+{recompute_layers}" if recompute_layers else "")
            + (", prompt on host" if prompt_on_host else ""))


def host_budget(share: float = HOST_SHARE) -> float:
    """Pinned host memory one rank may take for activations (prefix reuse's prompt, offloaded layers): ``share`` of the
    machine's memory over the ranks on it (torchrun's ``LOCAL_WORLD_SIZE``)."""
    import psutil

    return psutil.virtual_memory().total * share / int(os.environ.get("LOCAL_WORLD_SIZE", 1))


def use_expandable_segments() -> None:
    """Let torch's CUDA allocator grow its segments in place (``expandable_segments``) unless the user
    has configured it (``PYTORCH_CUDA_ALLOC_CONF``); call before the first CUDA allocation. Long packed
    micro-batches allocate tensors of several GiB whose sizes change from layer to layer and between
    a held prompt's forward, its parts and its backward; fixed segments then strand free memory that
    no request fits, which the memory model's margin does not cover."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


def device_budget(device=None, margin: float = DEFAULT_MARGIN) -> float:
    """The device's memory less ``margin`` of it (the allocator's fragmentation and the CUDA context are
    not in the model)."""
    total = torch.cuda.get_device_properties(device if device is not None else torch.cuda.current_device()).total_memory
    return total * (1.0 - margin)

