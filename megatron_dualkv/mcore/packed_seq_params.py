"""``DualKVPackedSeqParams``: how a micro-batch's packed layout travels through Megatron-Core.

Megatron hands ``packed_seq_params`` unchanged from ``GPTModel.forward`` to every core-attention
module, so the layout rides along in a ``PackedSeqParams`` subclass. ``qkv_format="thd"`` makes
Megatron squeeze the batch dimension before core attention and apply RoPE per token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron.core.packed_seq_params import PackedSeqParams

from ..layout import PackedLayout


@dataclass
class DualKVPackedSeqParams(PackedSeqParams):
    """``PackedSeqParams`` (thd) carrying the packed micro-batch's layout: a ``DualKVLayout``
    (prompts and responses) or a ``TreeLayout`` (prefix trees of trajectories), or a
    ``PrefixedLayout`` (responses whose prompt is held: ``rl.prefix_reuse``).

    held_prompt: prefix reuse's ``HeldPrompt``: with a ``DualKVLayout`` of the prompt alone, every
    layer holds its prompt K/V there; with a ``PrefixedLayout``, every layer attends to them.
    """

    layout: Optional[PackedLayout] = None
    held_prompt: Optional[object] = None

    @classmethod
    def from_layout(cls, layout: PackedLayout, held_prompt=None) -> "DualKVPackedSeqParams":
        if not isinstance(layout, PackedLayout):
            raise TypeError(f"from_layout: expected a DualKVLayout or a TreeLayout, got {type(layout).__name__}")
        # cu_seqlens stay on the host: Megatron's unfused thd RoPE reads them one element at a
        # time (.item() per segment), which on a device tensor would synchronise per segment.
        cu_seqlens = layout.to("cpu").cu_seqlens
        return cls(
            qkv_format="thd",
            cu_seqlens_q=cu_seqlens,
            cu_seqlens_kv=cu_seqlens,
            max_seqlen_q=layout.max_seqlen,
            max_seqlen_kv=layout.max_seqlen,
            layout=layout,
            held_prompt=held_prompt,
        )
