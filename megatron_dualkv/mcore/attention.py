"""``DualKVAttention``: Megatron-Core core attention on the DualKV packed layout.

A drop-in for ``DotProductAttention`` in a layer spec (same constructor and forward contract).
With ``packed_seq_params`` a ``DualKVPackedSeqParams`` (thd: q/k/v ``[t, heads, dim]``) it runs
``megatron_dualkv.dualkv_attn_func`` on the layout the params carry (a ``DualKVLayout`` or a
``TreeLayout``; a window counts logical positions along each path) and returns ``[t, heads*dim]``.
Without ``packed_seq_params`` (sbhd: ``[s, b, heads, dim]``, a right-padded batch of plain
sequences) the same model runs the standard replicated layout, the baseline and the equivalence
oracle: on a GPU with a fused kernel (``replicated_attention``: PyTorch SDPA, or FlexAttention for a
window or softcap), elsewhere with Megatron's own ``DotProductAttention`` (causal), whose dense
``[b, heads, s, s]`` scores only fit short sequences.

Under context parallelism (the params' ``cp_group``, set by ``DualKVGPTModel``) q/k/v hold this
rank's slice of the packed tokens, and attention runs as Ulysses (``mcore.context_parallel``).
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention
from torch import Tensor

from ..attention import dualkv_attn_func, dualkv_prefix_attn_func
from ..layout import PrefixedLayout
from .context_parallel import context_parallel_size, local_tokens, ulysses_attention
from .packed_seq_params import DualKVPackedSeqParams

CAUSAL_MASK_TYPES = (AttnMaskType.causal, AttnMaskType.padding_causal)


class DualKVAttention(DotProductAttention):
    """Core attention for the packed DualKV layout (see the module docstring).

    Honours ``softmax_scale``, GQA, the per-layer sliding window of ``config.window_size`` /
    ``config.window_attn_skip_freq``, a logit softcap when the config defines one, and the
    tensor-parallel head split (heads per partition).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        _check_supported(config, attn_mask_type, attention_dropout, pg_collection.tp.size())
        super().__init__(
            config, layer_number, attn_mask_type, attention_type, attention_dropout, softmax_scale,
            cp_comm_type, pg_collection,
        )
        # Not self.softmax_scale: under apply_query_key_layer_scaling DotProductAttention divides
        # it by the layer number and multiplies back inside its softmax (an fp16 overflow guard);
        # DualKV backends accumulate scores in fp32 and take the true scale.
        self.dualkv_softmax_scale = (
            softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.hidden_size_per_attention_head)
        )
        self.dualkv_window = _left_window(config, layer_number)
        # TransformerConfig 0.16.1 has no softcap field; a family config that adds one (Gemma 2
        # calls it attn_logit_softcapping) is honoured.
        self.dualkv_softcap = getattr(config, "attn_logit_softcapping", None)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params: Optional[DualKVPackedSeqParams] = None,
    ) -> Tensor:
        if attention_bias is not None:
            raise ValueError("DualKVAttention does not take an attention_bias")
        if packed_seq_params is None:
            if query.dim() != 4:
                raise ValueError(
                    f"DualKVAttention got a {query.dim()}-D query without packed_seq_params: packed (thd) input "
                    "needs DualKVPackedSeqParams.from_layout(layout), which carries the packed layout"
                )
            if query.is_cuda:
                return replicated_attention(query, key, value, self.dualkv_softmax_scale, self.dualkv_window,
                                            self.dualkv_softcap)
            return super().forward(query, key, value, attention_mask, attn_mask_type)
        layout = getattr(packed_seq_params, "layout", None)
        if layout is None:
            raise ValueError(
                f"DualKVAttention needs the micro-batch's DualKVLayout or TreeLayout: pass "
                f"DualKVPackedSeqParams.from_layout(layout) as packed_seq_params, got {type(packed_seq_params).__name__} "
                "without a layout"
            )
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"DualKVAttention runs the packed thd format, got qkv_format={packed_seq_params.qkv_format!r}")
        if query.dim() != 3 or query.shape[1] != self.num_attention_heads_per_partition:
            raise ValueError(
                f"DualKVAttention expects thd query [tokens, {self.num_attention_heads_per_partition} heads per "
                f"partition, head_dim], got shape {tuple(query.shape)}"
            )
        tokens = local_tokens(packed_seq_params)
        if query.shape[0] != tokens.stop - tokens.start:
            raise ValueError(
                f"DualKVAttention: the query has {query.shape[0]} tokens but the {type(layout).__name__} describes "
                f"{layout.total_tokens} (split over {context_parallel_size(packed_seq_params.cp_group)} context-parallel "
                "rank(s)); the layout must be the one the micro-batch was packed with"
            )

        kernel_args = dict(softmax_scale=self.dualkv_softmax_scale, window_size=self.dualkv_window,
                           softcap=self.dualkv_softcap, deterministic=self.config.deterministic_mode)
        held = packed_seq_params.held_prompt

        # Prefix reuse holds and reads the prompt's K/V as attention sees them: under context
        # parallelism after the all-to-all, every prompt row of this rank's heads.
        def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            if held is not None and isinstance(layout, PrefixedLayout):
                return dualkv_prefix_attn_func(q, k, v, *held.kv[self.layer_number], layout, **kernel_args)
            if held is not None:
                # a layer that frees its rotated key after the forward: the held one is a copy
                copy_key = bool(getattr(self.config, "recompute_qk_norm_rope", False))
                k, v = held.hold(self.layer_number, k, v, copy_key)
            return dualkv_attn_func(q, k, v, layout, **kernel_args)

        if context_parallel_size(packed_seq_params.cp_group) > 1:
            return ulysses_attention(query, key, value, packed_seq_params.cp_group, attend)
        out = attend(query, key, value)
        return out.reshape(out.shape[0], -1)


def replicated_attention(
    query: Tensor, key: Tensor, value: Tensor, softmax_scale: float, window: Optional[int] = None,
    softcap: Optional[float] = None,
) -> Tensor:
    """Causal attention over a right-padded batch of plain sequences, with a fused kernel.

    query ``[s, b, hq, d]``, key/value ``[s, b, hkv, d]`` (GQA: hq a multiple of hkv) -> ``[s, b, hq * d]``.
    Keys are visible iff ``k <= q`` and ``q - k < window`` (window optional); softcap: scores become
    ``c * tanh(x / c)``. Right padding needs no mask: a real token never attends to the padding after it.
    Plain causal attention runs PyTorch SDPA, whose dispatcher takes the first fused backend (flash, cuDNN,
    memory-efficient) that accepts the inputs; a window or a softcap, which SDPA's fused backends cannot
    express, runs FlexAttention (compiled on GPU).
    """
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
    gqa = q.shape[1] != k.shape[1]
    if window is None and softcap is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=softmax_scale, enable_gqa=gqa)
    else:
        block_mask = _causal_block_mask(q.shape[2], window, q.device)
        score_mod = None if softcap is None else _softcap_score_mod(float(softcap))
        # Triton's kernel by name: with Transformer Engine installed, the automatic choice found no
        # kernel for a small head dim (H200, torch 2.11)
        options = {"kernel_options": {"BACKEND": "TRITON"}} if q.is_cuda else {}
        out = _flex_attention(q.is_cuda)(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=softmax_scale,
                                         enable_gqa=gqa, **options)
    return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)


@lru_cache(maxsize=2)
def _flex_attention(compiled: bool):
    from torch.nn.attention.flex_attention import flex_attention

    # Uncompiled FlexAttention materialises the scores: only for the CPU tests of this path.
    return torch.compile(flex_attention, dynamic=False) if compiled else flex_attention


@lru_cache(maxsize=16)
def _causal_block_mask(seq_len: int, window: Optional[int], device: torch.device):
    from torch.nn.attention.flex_attention import create_block_mask

    def causal_in_window(b, h, q_idx, kv_idx):
        visible = kv_idx <= q_idx
        return visible if window is None else visible & (q_idx - kv_idx < window)

    return create_block_mask(causal_in_window, None, None, seq_len, seq_len, device=device)


def _softcap_score_mod(softcap: float):
    def score_mod(score, b, h, q_idx, kv_idx):
        return softcap * torch.tanh(score / softcap)

    return score_mod


def _check_supported(config: TransformerConfig, attn_mask_type, attention_dropout, tp_size: int) -> None:
    if config.num_attention_heads % tp_size:
        raise ValueError(
            f"num_attention_heads ({config.num_attention_heads}) is not divisible by the tensor-parallel size ({tp_size})"
        )
    if config.num_query_groups % tp_size:
        raise ValueError(
            f"num_query_groups ({config.num_query_groups}) is not divisible by the tensor-parallel size ({tp_size})"
        )
    if attn_mask_type not in CAUSAL_MASK_TYPES:
        raise ValueError(f"DualKVAttention is causal; got attn_mask_type={attn_mask_type}")
    dropout = config.attention_dropout if attention_dropout is None else attention_dropout
    if dropout:
        raise ValueError(f"DualKVAttention has no attention dropout; set attention_dropout=0 (got {dropout})")
    if config.softmax_type != "vanilla":
        raise ValueError(f"DualKVAttention supports softmax_type='vanilla' only, got {config.softmax_type!r}")
    if config.context_parallel_size != 1:
        raise ValueError(
            f"context_parallel_size={config.context_parallel_size} switches on Megatron's own (Transformer Engine) "
            "context parallelism; DualKV runs its own (Ulysses) on the context-parallel group of Megatron's "
            "parallel state: keep context_parallel_size=1 in the TransformerConfig (build_model(cp=...) does)"
        )


def _left_window(config: TransformerConfig, layer_number: int) -> Optional[int]:
    """Megatron's ``window_size=(left, right)`` (keys ``q-left..q+right``) as a DualKV window.

    DualKV sees a key when ``pos(q) - pos(k) < window``, so ``window = left + 1``; ``left=-1``
    means unbounded. A right window would look ahead, which causal attention never does.
    """
    if not is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
        return None
    left, right = config.window_size
    if right != 0:
        raise ValueError(f"DualKVAttention is causal: window_size right part must be 0, got {config.window_size}")
    return None if left < 0 else left + 1
