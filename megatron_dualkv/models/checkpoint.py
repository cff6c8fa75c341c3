"""Megatron checkpoints of a model card: conversion from and to Hugging Face folders, and loading
and saving a model at any parallel size.

A Megatron checkpoint folder (what ``hf_to_megatron`` and ``save_model`` write) holds::

    config.json              the model's Hugging Face config: its card (``load_model`` builds from it)
    dualkv_checkpoint.json   who wrote it, and the parallel sizes it was written for
    metadata.json, common.pt, .metadata, __*_*.distcp
                             Megatron-Core's dist_checkpointing format (torch_dist backend)
    tokenizer files, generation config, ...: the small files of the Hugging Face folder it came from

The tensors are stored under the keys of ``sharded_state_dict(model)`` (Megatron's sharded state
dict, one key per layer) as global tensors with sharding metadata: a checkpoint loads at any
tp/pp/ep, whatever it was written at. The embedding and output layer keep the rows their writer
had: the real vocabulary (``hf_to_megatron``), or the writer's vocabulary padded for its tp
(``save_model``). Megatron marks both tensors ``allow_shape_mismatch``: a model of another padding
loads the rows it shares with the stored tensor and zeros for the rest, and ``megatron_to_hf``
reads the real vocabulary's rows.

Memory: ``hf_to_megatron`` plans the whole checkpoint from the safetensors headers and a model on
the meta device (every name and shape checked before anything is written), then
torch.distributed.checkpoint's writer asks for one stored tensor at a time, computed then from the
memory-mapped Hugging Face tensors of the mappings that feed it: the peak is one stored tensor
plus one mapping's tensors (for Qwen3-30B-A3B in bf16: one layer's 128 experts of one projection,
0.8 GB, or the embedding, 0.6 GB), never a shard or the model. ``megatron_to_hf`` holds one layer
(read through Megatron's loader) plus one output shard (``max_shard_size``).
"""
from __future__ import annotations

import os
import shutil
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, replace
from itertools import groupby
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory
from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import unwrap_model
from torch import Tensor
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from tqdm.auto import tqdm

from ..mcore.cpu_compat import enable_cpu_compat
from ..mcore.parallel import ParallelSizes, check_model_split, current_parallel_sizes, initialize_parallel_state
from .builder import build_model, build_transformer_config, family_of
from .cards import ModelCard, load_card
from .family import ModelFamily, TensorMapping, _first, load_megatron_state_dict
from .hf_folder import (
    CONFIG_NAME, HFWeights, SafetensorsShardWriter, copy_small_files, hf_card, left_out_parts, parse_size, write_json,
)

FORMAT_NAME = "dualkv_checkpoint.json"
FORMAT_VERSION = 1
# Megatron's own files in a checkpoint folder; everything else there came from a Hugging Face folder.
_MEGATRON_FILES = ("metadata.json", "common.pt", ".metadata", FORMAT_NAME)
_CARD_ONLY_FIELDS = ("name", "source")

ShardedEntry = Union[ShardedTensor, ShardedTensorFactory]


def sharded_state_dict(model) -> dict:
    """Megatron's sharded state dict of one model chunk, with one key per layer.

    Megatron's default stacks the layers into one tensor per key, which needs every layer to have
    the same tensors: Gemma 4's full-attention layers differ in shape from its sliding ones, and a
    Qwen3-MoE model may mix dense and MoE layers.
    """
    return model.sharded_state_dict(metadata={"non_homogeneous_layers": True})


def checkpoint_card(megatron_dir: Union[str, os.PathLike]) -> ModelCard:
    """The card of the model in a Megatron checkpoint folder (its ``config.json``)."""
    path = Path(megatron_dir) / CONFIG_NAME
    if not path.is_file():
        raise ValueError(f"{megatron_dir} has no {CONFIG_NAME}: not a checkpoint written by hf_to_megatron or save_model")
    return load_card(path)


def load_model(megatron_dir: Union[str, os.PathLike], tp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1, **build_kwargs):
    """``build_model`` of the checkpoint's card at these parallel sizes, with the checkpoint's weights.

    Every rank of the world calls it (under torchrun, as ``build_model``). build_kwargs: the other
    ``build_model`` arguments (``etp``, ``vpp``, ``sp``, ``dtype``, ``use_transformer_engine``, overrides).
    Returns what ``build_model`` returns: the model, or this rank's list of model chunks under vpp.
    """
    megatron_dir = Path(megatron_dir)
    built = build_model(checkpoint_card(megatron_dir), tp, pp, ep, cp, **build_kwargs)
    chunks = built if isinstance(built, list) else [built]
    request = {f"chunk{i}": weights_only(sharded_state_dict(chunk)) for i, chunk in enumerate(chunks)}
    loaded = dist_checkpointing.load(request, str(megatron_dir))
    for i, chunk in enumerate(chunks):
        load_megatron_state_dict(chunk, loaded[f"chunk{i}"])
    return built


def save_model(model, card: Union[str, os.PathLike, ModelCard], out_dir: Union[str, os.PathLike]) -> None:
    """Save a live model (a ``build_model``/``load_model`` result, DDP-wrapped or not, at any
    parallel sizes; every rank calls it) as a Megatron checkpoint folder that ``load_model`` and
    ``megatron_to_hf`` read. card: the card the model was built from."""
    chunks = unwrap_model(model if isinstance(model, list) else [model])
    card = load_card(card)
    sizes = current_parallel_sizes(chunks[0].config)
    with _staging(Path(out_dir)) as staging:
        dist_checkpointing.save({f"chunk{i}": sharded_state_dict(chunk) for i, chunk in enumerate(chunks)}, str(staging))
        if _rank() == 0:
            write_json(staging / CONFIG_NAME, _hf_config(card))
            _write_format(staging, "save_model", sizes, source=card.name)


def hf_to_megatron(
    hf_dir: Union[str, os.PathLike],
    out_dir: Union[str, os.PathLike],
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    *,
    text_only: bool = False,
    card: Union[str, os.PathLike, ModelCard, None] = None,
    progress: bool = True,
) -> None:
    """Convert a Hugging Face checkpoint folder into a Megatron checkpoint folder ``out_dir``.

    tp, pp, ep: the parallel sizes the checkpoint is meant for: checked against the model (heads
    and experts must split that many ways, layers over pp as ``build_model`` splits them) and
    recorded. The stored tensors are global, with the real vocabulary, so it loads at any sizes.
    text_only: convert the text decoder of a multimodal checkpoint (``model.language_model.*``
    tensors), leaving the vision tower (and Qwen3.5's ``mtp.*``) out, as one printed line says.
    card: the model card to build from instead of the folder's ``config.json`` (e.g.
    ``"gemma3-27b"``: published multimodal configs leave out the fields that take transformers'
    defaults); it becomes the checkpoint's ``config.json``.

    ValueError, before anything is written, for a model no family supports, missing, unexpected
    or misshapen tensors. ``out_dir`` must not exist; it appears only once complete.
    """
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    _refuse_existing(out_dir)
    _require_single_process()
    folder_card, rename = hf_card(hf_dir, text_only)
    card = folder_card if card is None else load_card(card)
    if card.model_type != folder_card.model_type:
        raise ValueError(f"card {card.name!r} describes a {card.model_type!r} model, {hf_dir} a {folder_card.model_type!r} one")
    family = family_of(card)
    sizes = ParallelSizes(tp=tp, pp=pp, ep=ep)
    _check_parallel_sizes(card, family, sizes)
    weights = HFWeights(hf_dir, rename)
    left_out = left_out_parts(weights.left_out)
    if left_out:
        print(f"{hf_dir}: converting the text decoder, leaving out {', '.join(left_out)} "
              f"({len(weights.left_out)} tensors)")
    layout = _model_layout(card)
    mapping = family.hf_file_state_dict_mapping(card, layout.config)
    mapping.check_hf_names(weights.names)
    # a tied alias is compared only where the folder has it (published tied checkpoints leave it out)
    present = set(weights.names)
    mapping.check_tied({name: weights.tensor(name) for pair in mapping.tied.items() if pair[0] in present for name in pair})
    tensors = _StreamedTensors(mapping.tensors, weights, layout.entries)
    with _staging(out_dir) as staging:
        _write_dist_checkpoint(staging, tensors.items, tensors.data, progress)
        if card is folder_card and rename is None:
            copy_small_files(hf_dir, staging, skip=_MEGATRON_FILES)
        else:  # the config of what was converted: the card's, or a multimodal checkpoint's text decoder's
            write_json(staging / CONFIG_NAME, _hf_config(card))
            copy_small_files(hf_dir, staging, skip=_MEGATRON_FILES + (CONFIG_NAME,))
        _write_format(staging, "hf_to_megatron", sizes, source=str(hf_dir.resolve()), left_out=left_out)


def megatron_to_hf(
    megatron_dir: Union[str, os.PathLike],
    out_dir: Union[str, os.PathLike],
    *,
    max_shard_size: Union[int, str] = "5GB",
    progress: bool = True,
) -> None:
    """Convert a Megatron checkpoint folder (``hf_to_megatron``'s or ``save_model``'s) into a
    Hugging Face folder: safetensors shards named as the published checkpoints name their tensors,
    the index, ``config.json`` and the small files that came along. transformers loads it with
    ``from_pretrained``. ValueError when the stored tensors do not match the model of its
    ``config.json``; ``out_dir`` must not exist and appears only once complete."""
    megatron_dir, out_dir = Path(megatron_dir), Path(out_dir)
    _refuse_existing(out_dir)
    _require_single_process()
    card = checkpoint_card(megatron_dir)
    family = family_of(card)
    max_shard_bytes = parse_size(max_shard_size)
    layout = _model_layout(card)
    stored = _stored_tensors(megatron_dir)
    _check_stored_tensors(megatron_dir, stored, layout.entries)
    mapping = family.hf_file_state_dict_mapping(card, layout.config)
    units = [list(unit) for _, unit in groupby(mapping.tensors, key=_layer_index)]
    with _staging(out_dir) as staging:
        writer = SafetensorsShardWriter(staging, max_shard_bytes)
        for unit in tqdm(units, desc="megatron-to-hf", unit="layer", disable=not progress):
            entries = {name: layout.entries[name] for m in unit for name in m.megatron}
            tensors = _load_full_tensors(megatron_dir, entries, stored)
            for m in unit:
                for name, tensor in m.convert("hf", *(tensors[n] for n in m.megatron)).items():
                    writer.add(name, tensor)
        writer.finish()
        copy_small_files(megatron_dir, staging, skip=_MEGATRON_FILES)


# ---------------------------------------------------------------- what Megatron stores of a model


@dataclass(frozen=True)
class _ModelLayout:
    """What Megatron stores of the tp=1 model of a card (from a model on the meta device)."""

    config: TransformerConfig
    entries: Dict[str, ShardedEntry]  # state-dict name -> how its tensor is stored


def _model_layout(card: ModelCard) -> _ModelLayout:
    model = _meta_model(card)
    weights = {name: entry for name, entry in sharded_state_dict(model).items() if not isinstance(entry, ShardedObject)}
    return _ModelLayout(model.config, weights)


def _meta_model(card: ModelCard):
    """The tp=1 model of ``card`` on the meta device: names, shapes and sharded keys, no memory.
    Needs a world of one process (started here in a plain process)."""
    family = family_of(card)
    sizes = ParallelSizes()
    enable_cpu_compat()
    # Host-side initialisation (skipped) creates parameters without a device, so they land on the
    # meta device; SequentialMLP experts are what the family mappings name.
    overrides = dict(use_cpu_initialization=True, perform_initialization=False, moe_grouped_gemm=False)
    config = build_transformer_config(card, family, sizes, torch.float32, False, overrides)
    if not parallel_state.model_parallel_is_initialized():  # else a world of one: all sizes are 1
        initialize_parallel_state(sizes, seed=0)
    with torch.device("meta"):
        return family.model_class(
            config, family.block_spec(config, False, None), pre_process=True, post_process=True, **family.gpt_model_kwargs(card)
        )


def _holding(entry: ShardedEntry, tensor: Tensor) -> ShardedEntry:
    """``entry`` with ``tensor`` (a full tp=1 tensor) as its data."""
    if isinstance(entry, ShardedTensorFactory):
        return replace(entry, data=tensor)
    return replace(entry, data=tensor, dtype=tensor.dtype)


def _pieces(entry: ShardedEntry, tensor: Tensor) -> List[ShardedTensor]:
    """How Megatron stores ``tensor`` as ``entry``: one piece, or several (a gated ``linear_fc1`` as
    its gate and up halves)."""
    held = _holding(entry, tensor)
    return list(nested_values(held.build())) if isinstance(held, ShardedTensorFactory) else [held]


def weights_only(sharded: dict) -> dict:
    """Without the ``_extra_state`` objects (``ShardedObject``s): they hold no weights (None in
    torch-native layers, FP8 scaling state in Transformer Engine's), so ``hf_to_megatron`` stores none,
    and the checkpoint of one layer spec has none of the other's."""
    return {name: entry for name, entry in sharded.items()
            if not name.endswith("_extra_state") and not isinstance(entry, ShardedObject)}


# ---------------------------------------------------------------- writing: Hugging Face -> Megatron


class _StreamedTensors:
    """Every stored tensor of the model, planned from the Hugging Face files' headers (every shape
    checked) and computed when the checkpoint writer asks for it from the Hugging Face tensors of
    the mappings that feed it. Each tensor is one write item, and so one file: torch's writer
    keeps every tensor of a file until the file is closed."""

    def __init__(self, mappings, weights: HFWeights, entries: Dict[str, ShardedEntry]):
        self._mappings, self._weights, self._entries = mappings, weights, entries
        self._pieces: Dict[str, List[ShardedTensor]] = defaultdict(list)  # stored key -> its pieces (meta)
        self._sources: Dict[str, List[int]] = defaultdict(list)  # stored key -> the mappings making its pieces
        for index, mapping in enumerate(mappings):
            for piece in self._mapping_pieces(mapping, weights.meta):
                self._pieces[piece.key].append(piece)
                if index not in self._sources[piece.key]:
                    self._sources[piece.key].append(index)
        self.items = [_whole_tensor_write_item(key, pieces) for key, pieces in self._pieces.items()]
        self._computed: Tuple[Optional[int], List[ShardedTensor]] = (None, [])

    def data(self, item: WriteItem) -> Tensor:
        key = item.index.fqn
        if len(self._pieces[key]) == 1:
            return self._computed_pieces(key, self._sources[key][0])[0].data.reshape(item.tensor_data.size)
        whole = torch.empty(item.tensor_data.size, dtype=item.tensor_data.properties.dtype)
        for index in self._sources[key]:
            for piece in self._computed_pieces(key, index):
                target = whole[_chunk(piece)]
                target.copy_(piece.data.reshape(target.shape))
        return whole

    def _computed_pieces(self, key: str, index: int) -> List[ShardedTensor]:
        if self._computed[0] != index:
            self._computed = (None, [])  # let the previous mapping's tensors go first
            self._computed = (index, self._mapping_pieces(self._mappings[index], self._weights.tensor))
        return [piece for piece in self._computed[1] if piece.key == key]

    def _mapping_pieces(self, mapping: TensorMapping, read: Callable[[str], Tensor]) -> List[ShardedTensor]:
        inputs = [read(name) for name in mapping.hf]
        shapes = {name: tuple(t.shape) for name, t in zip(mapping.hf, inputs)}
        try:
            outputs = mapping.convert("megatron", *inputs)
        except RuntimeError as err:  # e.g. torch.cat of gate and up projections of different shapes
            raise ValueError(f"Hugging Face tensors of shapes {shapes} do not make {list(mapping.megatron)}: {err}") from None
        pieces = []
        for name, tensor in outputs.items():
            expected = tuple(self._entries[name].data.shape)
            if tuple(tensor.shape) != expected:
                raise ValueError(
                    f"Hugging Face tensors of shapes {shapes} make {name} of shape {tuple(tensor.shape)}, "
                    f"but the model of the card has {expected}"
                )
            pieces += _pieces(self._entries[name], tensor)
        return pieces


def _chunk(piece: ShardedTensor) -> Tuple[slice, ...]:
    """Where ``piece`` sits in its global tensor; its prepended axes (layer, expert) have size 1."""
    sizes = (1,) * piece.prepend_axis_num + tuple(piece.local_shape)
    return tuple(slice(offset, offset + size) for offset, size in zip(piece.global_offset, sizes))


def _whole_tensor_write_item(key: str, pieces: List[ShardedTensor]) -> WriteItem:
    shape = torch.Size(pieces[0].global_shape)
    dtypes = {piece.dtype for piece in pieces}
    if len(dtypes) > 1:
        raise ValueError(f"the Hugging Face tensors stored as {key} have different dtypes: {sorted(map(str, dtypes))}")
    if sum(piece.data.numel() for piece in pieces) != shape.numel():
        raise ValueError(f"the pieces of {key} do not cover its global shape {tuple(shape)}")
    offsets = torch.Size([0] * len(shape))
    return WriteItem(
        index=MetadataIndex(key, offsets),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=offsets, sizes=shape),
            properties=TensorProperties(dtype=pieces[0].dtype),
            size=shape,
        ),
    )


class _StreamingSavePlanner(DefaultSavePlanner):
    """A save plan of given write items whose data ``resolve`` computes when the writer asks."""

    def __init__(self, items: List[WriteItem], resolve: Callable[[WriteItem], Tensor]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._items, self._resolve = items, resolve

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan(self._items)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        return self._resolve(write_item)


def _write_dist_checkpoint(folder: Path, items: List[WriteItem], resolve, progress: bool) -> None:
    """Megatron's torch_dist format, written by torch.distributed.checkpoint's own writer."""
    total = sum(item.tensor_storage_size() or 0 for item in items)
    with tqdm(total=total, unit="B", unit_scale=True, desc="hf-to-megatron", disable=not progress) as bar:

        def resolve_with_progress(item: WriteItem):
            data = resolve(item)
            bar.update(item.tensor_storage_size() or 0)
            return data

        # one writer thread, nothing copied ahead, a file per tensor: one tensor in memory at a time
        writer = dcp.FileSystemWriter(str(folder), single_file_per_rank=False, thread_count=1, per_thread_copy_ahead=0)
        try:
            dcp.save({}, storage_writer=writer, planner=_StreamingSavePlanner(items, resolve_with_progress), no_dist=True)
        except CheckpointException as err:  # a BaseException wrapping what failed: hand that on
            raise next(iter(err.failures.values()))[0] from None
    # An empty common.pt: Megatron-Core up to 0.16 requires it, later versions still read it.
    torch.save({}, folder / "common.pt")
    sharded = get_default_save_sharded_strategy()
    save_config(CheckpointingConfig(sharded.backend, sharded.version), str(folder))


# ---------------------------------------------------------------- reading: Megatron -> Hugging Face


def _stored_tensors(megatron_dir: Path) -> Dict[str, TensorStorageMetadata]:
    if not (megatron_dir / ".metadata").is_file():
        raise ValueError(f"{megatron_dir} holds no Megatron dist checkpoint (.metadata is missing)")
    metadata = dcp.FileSystemReader(str(megatron_dir)).read_metadata()
    return {key: md for key, md in metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)}


def _check_stored_tensors(megatron_dir: Path, stored: Dict[str, TensorStorageMetadata], entries: Dict[str, ShardedEntry]) -> None:
    pieces = {piece.key: piece for entry in entries.values() for piece in _pieces(entry, entry.data)}
    missing = sorted(set(pieces) - set(stored))
    unexpected = sorted(set(stored) - set(pieces))
    reshaped = [f"{key} {tuple(stored[key].size)} (expected {tuple(piece.global_shape)})"
                for key, piece in pieces.items() if key in stored and not _fits(tuple(stored[key].size), piece)]
    if missing or unexpected or reshaped:
        raise ValueError(
            f"{megatron_dir}: the stored tensors do not match the model of its {CONFIG_NAME}: missing {_first(missing)}, "
            f"unexpected {_first(unexpected)}, other shapes {_first(reshaped)}"
        )


def _fits(stored_shape: Tuple[int, ...], piece: ShardedTensor) -> bool:
    """Whether a stored tensor holds ``piece``: its shape, or for a vocabulary tensor (Megatron's
    ``allow_shape_mismatch``) at least its rows, padded by a writer at another tp."""
    shape = tuple(piece.global_shape)
    if piece.allow_shape_mismatch:
        return stored_shape[1:] == shape[1:] and stored_shape[0] >= shape[0]
    return stored_shape == shape


def _load_full_tensors(megatron_dir: Path, entries: Dict[str, ShardedEntry], stored) -> Dict[str, Tensor]:
    """The full (tp=1) tensors of ``entries``, in their stored dtype, through Megatron's loader
    (a padded vocabulary tensor: its first ``vocab_size`` rows)."""
    request = {
        name: _holding(entry, torch.empty(entry.data.shape, dtype=stored[entry.key].properties.dtype))
        for name, entry in entries.items()
    }
    return dist_checkpointing.load(request, str(megatron_dir))


def _layer_index(mapping: TensorMapping) -> Optional[int]:
    parts = mapping.megatron[0].split(".")
    return int(parts[2]) if parts[:2] == ["decoder", "layers"] else None


# ---------------------------------------------------------------- small helpers


def _check_parallel_sizes(card: ModelCard, family: ModelFamily, sizes: ParallelSizes) -> None:
    """ValueError when the model of ``card`` cannot be split ``sizes`` ways."""
    config = build_transformer_config(card, family, sizes, torch.float32, False, {"moe_grouped_gemm": False})
    check_model_split(config, sizes)


def _hf_config(card: ModelCard) -> dict:
    return {key: value for key, value in card.config.items() if key not in _CARD_ONLY_FIELDS}


def _write_format(folder: Path, written_by: str, sizes: ParallelSizes, **details) -> None:
    parallel = {"tp": sizes.tp, "pp": sizes.pp, "ep": sizes.ep, "cp": sizes.cp, "etp": sizes.etp}
    write_json(folder / FORMAT_NAME, dict(format_version=FORMAT_VERSION, written_by=written_by, parallel_sizes=parallel, **details))


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _require_single_process() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError("checkpoint conversion runs in one process (world size 1), not in a launched world")


def _refuse_existing(out_dir: Path) -> None:
    if out_dir.exists():
        raise ValueError(f"{out_dir} already exists; choose a new folder")


@contextmanager
def _staging(out_dir: Path) -> Iterator[Path]:
    """A temporary folder next to ``out_dir`` that becomes ``out_dir`` once everything is written;
    removed on error, so that no half checkpoint is ever left. Every rank of the world enters it."""
    _refuse_existing(out_dir)
    staging = out_dir.with_name(f".{out_dir.name}.partial")
    writer = _rank() == 0
    if writer:
        shutil.rmtree(staging, ignore_errors=True)  # left by a run that was killed
        staging.mkdir(parents=True)
    _barrier()
    try:
        yield staging
        _barrier()
        if writer:
            staging.rename(out_dir)
    except BaseException:
        if writer:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    _barrier()


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
