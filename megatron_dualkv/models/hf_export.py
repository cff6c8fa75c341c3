"""Hugging Face-named full weights out of a live Megatron model, one tensor at a time: for
syncing an inference engine after a policy update without touching disk.

Each Megatron tensor is made whole where it lives, then handed to the ranks that lack it:

* tensor parallelism: the shards are all-gathered over the tensor-parallel group (the experts'
  over the expert-tensor-parallel group) and joined along the parameter's ``partition_dim`` as
  Megatron split them (``partition_stride`` s: the full tensor is s x tp blocks, rank r holds
  blocks r, r + tp, ...): rows for ``ColumnParallelLinear`` (QKV is split by key/value group,
  whose q, k and v rows are contiguous) and the vocabulary-parallel embedding and output layer,
  columns for ``RowParallelLinear``; a gated ``linear_fc1`` ``[gate; up]`` has stride 2, each rank
  holding ``[gate_r; up_r]``;
* expert parallelism: broadcast over the expert-parallel group from the rank holding the expert;
* pipeline parallelism: broadcast over the pipeline group from the stage holding the layer.

So every rank of the model yields every tensor, in the same order, and any of them can push the
weights on. The family's mapping then turns the Megatron tensors into Hugging Face ones.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.utils import unwrap_model
from torch import Tensor

from .cards import ModelCard, load_card
from .builder import family_of
from .family import _first, local_spec_state_dict

NAMINGS = ("checkpoint", "transformers")


def export_hf_weights(
    model, card: Union[str, os.PathLike, ModelCard], naming: str = "checkpoint"
) -> Iterator[Tuple[str, Tensor]]:
    """Yield ``(Hugging Face name, full tensor)`` for every weight of a live model, one at a time.

    model: a ``build_model``/``load_model`` result (DDP-wrapped or not; the list of model chunks
        under vpp), at any tp/pp/ep/cp. card: the card it was built from (a checkpoint's
        ``config.json`` for ``load_model``).
    naming: ``"checkpoint"`` yields the tensors of the published safetensors files (what
        ``save_pretrained`` writes and inference engines load: Qwen3-MoE experts one by one, no
        tied ``lm_head``); ``"transformers"`` yields a transformers model's ``state_dict()``
        (fused experts, tied aliases included).

    The tensors are on the model's device, in its dtype, and may be views of one fused tensor:
    copy them before changing them. Collective: every rank of the world iterates to the end, and
    every rank yields every tensor. Either layer spec: Transformer Engine's fused norms and grouped
    experts are read under the local spec's names (``local_spec_name``), which the family mappings use.
    """
    if naming not in NAMINGS:
        raise ValueError(f"naming must be one of {NAMINGS}, got {naming!r}")
    chunks = unwrap_model(model if isinstance(model, list) else [model])
    card = load_card(card)
    family = family_of(card)
    config = chunks[0].config
    mapping = (family.hf_file_state_dict_mapping if naming == "checkpoint" else family.hf_state_dict_mapping)(card, config)
    local = _local_tensors(chunks)
    directory = _directory(local)
    absent = [name for m in mapping.tensors for name in m.megatron if name not in directory]
    if absent:
        raise ValueError(
            f"the model has no tensors {_first(absent)} of card {card.name!r}: export_hf_weights reads models that "
            "build_model or load_model built from it (the experts as SequentialMLP or TEGroupedMLP, not Megatron's "
            "legacy GroupedMLP)"
        )
    aliases = {source: alias for alias, source in mapping.tied.items()} if naming == "transformers" else {}
    device = next(p.device for chunk in chunks for p in chunk.parameters())
    with torch.no_grad():
        for m in mapping.tensors:
            tensors = [_full_tensor(name, local.get(name), directory[name], device) for name in m.megatron]
            for name, tensor in m.convert("hf", *tensors).items():
                yield name, tensor
                if name in aliases:
                    yield aliases[name], tensor


@dataclass(frozen=True)
class _Placement:
    """Where the full tensor of one name is, and what it looks like."""

    stage: int  # pipeline rank holding it
    expert_rank: Optional[int]  # expert-parallel rank holding it (experts only)
    shape: Tuple[int, ...]
    dtype: torch.dtype


def _local_tensors(chunks) -> Dict[str, Tensor]:
    """This rank's parameters and buffers, under their names in the whole model (the names of a
    tp=pp=ep=1 model of the local spec: global layer and expert numbers)."""
    local = {}
    for chunk in chunks:
        for name, tensor in local_spec_state_dict(chunk, keep_vars=True).items():
            local[_global_name(chunk, name)] = tensor
    return local


def _global_name(chunk, name: str) -> str:
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        layer = chunk.decoder.layers[int(parts[2])]
        parts[2] = str(layer.layer_number - 1)  # Megatron numbers layers from 1 over the whole model
        if "local_experts" in parts:
            i = parts.index("local_experts") + 1
            local_experts = layer.mlp.experts.num_local_experts
            parts[i] = str(parallel_state.get_expert_model_parallel_rank() * local_experts + int(parts[i]))
    return ".".join(parts)


def _directory(local: Dict[str, Tensor]) -> Dict[str, _Placement]:
    """Every tensor of the model, from what each rank of the world holds (gathered once)."""
    stage = parallel_state.get_pipeline_model_parallel_rank()
    expert_rank = parallel_state.get_expert_model_parallel_rank()
    mine = {}
    for name, tensor in local.items():
        shape = list(tensor.shape)
        split = _tensor_parallel_split(name, tensor)
        if split is not None:
            shape[split[1]] *= split[0].size()
        mine[name] = _Placement(stage, expert_rank if _is_expert(name) else None, tuple(shape), tensor.dtype)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return mine
    everyone: List[Dict[str, _Placement]] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    directory = {}
    for placements in everyone:
        for name, placement in placements.items():
            directory.setdefault(name, placement)
    return directory


def _full_tensor(name: str, tensor: Optional[Tensor], placement: _Placement, device) -> Tensor:
    if tensor is not None:
        tensor = _gather_tensor_parallel(name, tensor)
    if placement.expert_rank is not None and placement.stage == parallel_state.get_pipeline_model_parallel_rank():
        tensor = _broadcast(tensor, placement, parallel_state.get_expert_model_parallel_group(), placement.expert_rank, device)
    return _broadcast(tensor, placement, parallel_state.get_pipeline_model_parallel_group(), placement.stage, device)


def _tensor_parallel_split(name: str, tensor: Tensor) -> Optional[Tuple[dist.ProcessGroup, int]]:
    """(group, dim) along which ``tensor`` is split by tensor parallelism, or None when it is whole."""
    if not getattr(tensor, "tensor_model_parallel", False):
        return None
    if _is_expert(name):
        group = parallel_state.get_expert_tensor_parallel_group()
    else:
        group = parallel_state.get_tensor_model_parallel_group()
    if group.size() == 1:
        return None
    return group, tensor.partition_dim


def _gather_tensor_parallel(name: str, tensor: Tensor) -> Tensor:
    """The whole of ``tensor`` (a parameter or buffer: its split is in its attributes)."""
    split = _tensor_parallel_split(name, tensor)
    if split is None:
        return tensor.detach()
    group, dim = split
    shards = [torch.empty_like(tensor, requires_grad=False) for _ in range(group.size())]
    dist.all_gather(shards, tensor.detach().contiguous(), group=group)
    blocks = [shard.chunk(tensor.partition_stride, dim=dim) for shard in shards]
    return torch.cat([rank_blocks[i] for i in range(len(blocks[0])) for rank_blocks in blocks], dim=dim)


def _broadcast(tensor: Optional[Tensor], placement: _Placement, group, holder: int, device) -> Tensor:
    """``tensor`` from the group rank ``holder`` on every rank of ``group``."""
    if dist.get_world_size(group) == 1:
        return tensor
    if tensor is None:
        tensor = torch.empty(placement.shape, dtype=placement.dtype, device=device)
    else:
        tensor = tensor.contiguous()
    dist.broadcast(tensor, src=dist.get_global_rank(group, holder), group=group)
    return tensor


def _is_expert(name: str) -> bool:
    return ".experts." in name
