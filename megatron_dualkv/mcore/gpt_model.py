"""``DualKVGPTModel``: Megatron's ``GPTModel`` with RoPE at the packed logical positions.

``GPTModel`` ignores ``position_ids`` for RoPE: in thd format it builds a ``[max_seqlen, 1, 1, d]``
frequency table and Megatron's unfused thd RoPE (``rope_utils._apply_rotary_pos_emb_thd``)
restarts positions at 0 in every ``cu_seqlens`` segment, so each response would start at 0
instead of continuing at its prompt length P (and a prefix tree's segment at the length of its
path from the root). The same function has an exact-mapping mode: when
the frequency tensor has exactly ``cu_seqlens[-1]`` rows, token ``i`` gets row ``i``. This model
hands it one row per packed token, gathered at the token's logical position from Megatron's own
frequency table, so packed and replicated layouts see bit-identical rotations. The same holds for
YaRN RoPE (``position_embedding_type="yarn"``): its table is Megatron's ``YarnRotaryEmbedding``'s,
and the attention applies the YaRN attention factor to cos and sin wherever the rows come from.

Context parallelism (``mcore.context_parallel``): the model's context-parallel group is the
Ulysses group of its DualKV attention. ``forward`` hands Megatron's ``GPTModel`` this rank's slice
of the input ids, positions and masks, and params that carry the group (Megatron's ``cp_group``
field); Megatron's own modules get a group of one as their CP group, because their CP code paths
(load-balanced RoPE, TE attention) would split the sequence a second time.

Pipeline parallelism: every stage gets the micro-batch's layout (and positions) through the same
arguments; stages without the embedding ignore ``input_ids`` and take the hidden states the
schedule hands them, but still need the layout for RoPE and attention.

``forward(..., skip_output_layer=True)``: the last stage returns its final hidden states instead of
the logits, for callers that project only some rows onto the vocabulary (``rl.logprobs``: the rows
that predict response tokens). A keyword, so it passes through Megatron's DDP and ``Float16Module``
wrappers, which forward ``**kwargs``.
"""
from __future__ import annotations

import copy
from dataclasses import replace
from typing import Optional

from megatron.core import tensor_parallel
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.process_groups_config import ProcessGroupCollection
from torch import Tensor

from .context_parallel import context_parallel_params, context_parallel_size, local_tokens
from .packed_seq_params import DualKVPackedSeqParams
from .parallel import single_rank_group


# the position embeddings whose table this model gathers at the packed logical positions
ROTARY = ("rope", "yarn")


class DualKVGPTModel(GPTModel):
    """``GPTModel`` for DualKV packed micro-batches (``packed_seq_params=DualKVPackedSeqParams``).

    Without packed params it is a plain ``GPTModel`` (the replicated baseline runs that way).

    vocab_size: the rows of the embedding and output layer, padded for tensor parallelism
    (``megatron_dualkv.mcore.parallel.padded_vocab_size``); unpadded_vocab_size: the tokens among
    them (default: all), what token ids and the log-probs' softmax range over.
    """

    def __init__(
        self, config, transformer_layer_spec, vocab_size, max_sequence_length, pg_collection=None,
        *, unpadded_vocab_size: Optional[int] = None, **kwargs,
    ):
        unpadded_vocab_size = vocab_size if unpadded_vocab_size is None else unpadded_vocab_size
        if not 1 <= unpadded_vocab_size <= vocab_size:
            raise ValueError(f"unpadded_vocab_size ({unpadded_vocab_size}) must be in 1 .. vocab_size ({vocab_size})")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        context_parallel_group = pg_collection.cp
        if context_parallel_group.size() > 1:
            pg_collection = copy.copy(pg_collection)
            pg_collection.cp = single_rank_group()
        super().__init__(config, transformer_layer_spec, vocab_size, max_sequence_length, pg_collection=pg_collection, **kwargs)
        self.context_parallel_group = context_parallel_group
        # set by forward for the duration of one call: GPTModel.forward hands _postprocess fixed arguments
        self._skip_output_layer = False
        self.unpadded_vocab_size = unpadded_vocab_size
        if self.position_embedding_type == "mrope":
            raise ValueError("DualKVGPTModel supports rope, yarn, learned_absolute or no position embedding, got 'mrope'")
        if self.position_embedding_type in ROTARY and config.apply_rope_fusion:
            raise ValueError(
                "DualKVGPTModel needs apply_rope_fusion=False: the fused thd RoPE restarts positions in "
                "every packed segment, while responses continue at their prompt length"
            )
        if self.position_embedding_type == "yarn" and self.rotary_percent != 1.0:
            raise ValueError(
                f"YaRN RoPE needs rotary_percent=1.0, got {self.rotary_percent}: Megatron's YarnRotaryEmbedding "
                "computes its frequencies over the whole head"
            )

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor,
        attention_mask: Tensor,
        decoder_input: Tensor = None,
        labels: Tensor = None,
        inference_context=None,
        packed_seq_params=None,
        *args,
        loss_mask: Optional[Tensor] = None,
        padding_mask: Optional[Tensor] = None,
        skip_output_layer: bool = False,
        **kwargs,
    ):
        """``GPTModel.forward``; under context parallelism on this rank's slice of the packed tokens
        (``[b, s]`` inputs, labels and masks and an ``[s, b, h]`` ``decoder_input`` are cut here;
        the output covers the rank's tokens only).

        skip_output_layer: on the last pipeline stage, return the final hidden states ``[s, b, h]``
        (after the final norm; sequence-split under sequence parallelism, as the output layer gets
        them) instead of the logits. Other stages return their hidden states either way.
        """
        if skip_output_layer and labels is not None:
            raise ValueError("skip_output_layer=True returns hidden states: it cannot compute the loss of labels")
        if skip_output_layer and self.config.mtp_num_layers:
            raise ValueError("skip_output_layer=True skips multi-token prediction too: build with mtp_num_layers=None")
        if isinstance(packed_seq_params, DualKVPackedSeqParams) and context_parallel_size(self.context_parallel_group) > 1:
            _check_inputs_match_layout(packed_seq_params, input_ids)
            packed_seq_params = context_parallel_params(packed_seq_params, self.context_parallel_group)
            tokens = local_tokens(packed_seq_params)
            input_ids, position_ids, labels, loss_mask, padding_mask = (
                None if x is None else x[:, tokens] for x in (input_ids, position_ids, labels, loss_mask, padding_mask)
            )
            decoder_input = None if decoder_input is None else decoder_input[tokens]
        self._skip_output_layer = skip_output_layer
        try:
            return super().forward(
                input_ids, position_ids, attention_mask, decoder_input, labels, inference_context, packed_seq_params,
                *args, loss_mask=loss_mask, padding_mask=padding_mask, **kwargs,
            )
        finally:
            self._skip_output_layer = False

    def _postprocess(self, hidden_states, *args, **kwargs):
        if self._skip_output_layer and self.post_process:
            return hidden_states  # the decoder applied the final norm
        return super()._postprocess(hidden_states, *args, **kwargs)

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
        if padding_mask is not None and self.config.sequence_parallel and not self.pre_process:
            # GPTModel scatters the padding mask to the sequence-parallel split only on the stage
            # that embeds; later pipeline stages (MoE routing) need it split the same way.
            padding_mask = tensor_parallel.scatter_to_sequence_parallel_region(padding_mask.transpose(0, 1)).transpose(0, 1)
        if not dualkv or self.position_embedding_type not in ROTARY:
            return super()._preprocess(
                input_ids, position_ids, decoder_input, inference_context, packed_seq_params, padding_mask
            )
        # Megatron builds its table for max_seqlen rows: ask for the rows our positions need (the
        # same power-of-two lengths every step, so its table cache hits) and gather from it.
        positions, rows = self._rope_positions(packed_seq_params, position_ids)
        table_params = replace(packed_seq_params, max_seqlen_q=rows, max_seqlen_kv=rows)
        outputs = super()._preprocess(input_ids, position_ids, decoder_input, inference_context, table_params, padding_mask)
        table = outputs[1]
        return (outputs[0], table[positions.to(table.device)], *outputs[2:])

    def rotary_pos_emb_at(self, packed_seq_params: DualKVPackedSeqParams, position_ids: Optional[Tensor]) -> Tensor:
        """``[T, 1, 1, rot_dim]`` RoPE frequencies of every packed token at its logical position.

        ``position_ids`` (``[1, T]``, or None on pipeline stages without inputs, where the layout's
        positions are used) must be the packed positions of the layout's tokens (of this rank's
        slice of them under context parallelism: then T is the slice's length).
        """
        positions, rows = self._rope_positions(packed_seq_params, position_ids)
        table = self.rotary_pos_emb(rows, packed_seq=True)
        if self.position_embedding_type == "yarn":
            table, _ = table  # its attention factor: the attention reads it from the config
        return table[positions.to(table.device)]

    def _rope_positions(self, packed_seq_params: DualKVPackedSeqParams, position_ids: Optional[Tensor]):
        """(logical positions of this rank's tokens, rows of the RoPE table they need); ValueError
        when they do not match the layout or pass the model's max_sequence_length."""
        layout = packed_seq_params.layout
        tokens = local_tokens(packed_seq_params)
        positions = layout.position_ids[tokens] if position_ids is None else position_ids.reshape(-1)
        if positions.numel() != tokens.stop - tokens.start:
            raise ValueError(
                f"position_ids has {positions.numel()} entries but the {type(layout).__name__} describes "
                f"{layout.total_tokens} tokens"
                + _split_note(packed_seq_params)
            )
        longest = layout.max_logical_len
        if longest > self.max_sequence_length:
            raise ValueError(
                f"a packed sequence reaches position {longest - 1}, beyond the model's max_sequence_length "
                f"{self.max_sequence_length}"
            )
        # Rows depend only on their position, so a table just long enough gives the same values;
        # powers of two keep the number of cached tables small (262144 rows would be ~0.8 GB for Gemma 4).
        return positions, min(self.max_sequence_length, 1 << max(longest - 1, 1).bit_length())


def _check_inputs_match_layout(packed_seq_params: DualKVPackedSeqParams, input_ids: Optional[Tensor]) -> None:
    layout = packed_seq_params.layout
    if layout is None:
        raise ValueError("DualKVPackedSeqParams without a layout: build them with DualKVPackedSeqParams.from_layout(layout)")
    tokens = local_tokens(packed_seq_params)
    if input_ids is not None and input_ids.numel() != tokens.stop - tokens.start:
        raise ValueError(
            f"input_ids has {input_ids.numel()} tokens but the {type(layout).__name__} describes {layout.total_tokens}"
            f"{_split_note(packed_seq_params)}; pass the layout the micro-batch was packed with"
        )


def _split_note(packed_seq_params: DualKVPackedSeqParams) -> str:
    cp = context_parallel_size(packed_seq_params.cp_group)
    return f" ({cp} context-parallel slices)" if cp > 1 else ""
