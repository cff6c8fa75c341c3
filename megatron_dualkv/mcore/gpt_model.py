"""``DualKVGPTModel``: Megatron's ``GPTModel`` with RoPE at the packed logical positions.

``GPTModel`` ignores ``position_ids`` for RoPE: in thd format it builds a ``[max_seqlen, 1, 1, d]``
frequency table and Megatron's unfused thd RoPE (``rope_utils._apply_rotary_pos_emb_thd``)
restarts positions at 0 in every ``cu_seqlens`` segment, so each response would start at 0
instead of continuing at its prompt length P. The same function has an exact-mapping mode: when
the frequency tensor has exactly ``cu_seqlens[-1]`` rows, token ``i`` gets row ``i``. This model
hands it one row per packed token, gathered at the token's logical position from Megatron's own
frequency table, so packed and replicated layouts see bit-identical rotations.
"""
from __future__ import annotations

from typing import Optional

from megatron.core.models.gpt.gpt_model import GPTModel
from torch import Tensor

from .packed_seq_params import DualKVPackedSeqParams


class DualKVGPTModel(GPTModel):
    """``GPTModel`` for DualKV packed micro-batches (``packed_seq_params=DualKVPackedSeqParams``).

    Without packed params it is a plain ``GPTModel`` (the replicated baseline runs that way).
    """

    def __init__(self, config, transformer_layer_spec, vocab_size, max_sequence_length, **kwargs):
        super().__init__(config, transformer_layer_spec, vocab_size, max_sequence_length, **kwargs)
        if self.position_embedding_type in ("yarn", "mrope"):
            raise ValueError(f"DualKVGPTModel supports rope, learned_absolute or no position embedding, got {self.position_embedding_type!r}")
        if self.position_embedding_type == "rope" and config.apply_rope_fusion:
            raise ValueError(
                "DualKVGPTModel needs apply_rope_fusion=False: the fused thd RoPE restarts positions in "
                "every packed segment, while responses continue at their prompt length"
            )

    def _preprocess(
        self,
        input_ids: Tensor,
        position_ids: Tensor,
        decoder_input: Tensor = None,
        inference_context=None,
        packed_seq_params=None,
        padding_mask: Optional[Tensor] = None,
    ):
        dualkv = isinstance(packed_seq_params, DualKVPackedSeqParams)
        if dualkv:
            _check_inputs_match_layout(packed_seq_params, input_ids)
        outputs = super()._preprocess(
            input_ids, position_ids, decoder_input, inference_context, packed_seq_params, padding_mask
        )
        rotary_pos_emb = outputs[1]
        if rotary_pos_emb is None or not dualkv:
            return outputs
        per_token = self.rotary_pos_emb_at(packed_seq_params, position_ids)
        return (outputs[0], per_token, *outputs[2:])

    def rotary_pos_emb_at(self, packed_seq_params: DualKVPackedSeqParams, position_ids: Optional[Tensor]) -> Tensor:
        """``[T, 1, 1, rot_dim]`` RoPE frequencies of every packed token at its logical position.

        ``position_ids`` (``[1, T]``, or None on pipeline stages without inputs, where the layout's
        positions are used) must be the packed positions of the layout's tokens.
        """
        layout = packed_seq_params.layout
        positions = layout.position_ids if position_ids is None else position_ids.reshape(-1)
        if positions.numel() != layout.total_tokens:
            raise ValueError(
                f"position_ids has {positions.numel()} entries but the DualKVLayout describes {layout.total_tokens} tokens"
            )
        longest = max((prefix_len + length for _, length, _, prefix_len in layout.segments), default=0)
        if longest > self.max_sequence_length:
            raise ValueError(
                f"a packed sequence reaches position {longest - 1}, beyond the model's max_sequence_length "
                f"{self.max_sequence_length}"
            )
        table = self.rotary_pos_emb(self.max_sequence_length, packed_seq=True)
        return table[positions.to(table.device)]


def _check_inputs_match_layout(packed_seq_params: DualKVPackedSeqParams, input_ids: Optional[Tensor]) -> None:
    layout = packed_seq_params.layout
    if layout is None:
        raise ValueError("DualKVPackedSeqParams without a layout: build them with DualKVPackedSeqParams.from_layout(layout)")
    if input_ids is not None and input_ids.numel() != layout.total_tokens:
        raise ValueError(
            f"input_ids has {input_ids.numel()} tokens but the DualKVLayout describes {layout.total_tokens}; "
            "pass the layout the micro-batch was packed with"
        )
