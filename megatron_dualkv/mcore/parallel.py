"""Parallel layout: the one place where the parallel sizes are validated, the world is split, and
Megatron's parallel state is brought to those sizes.

    world  = dp x tp x pp x cp           (dense layers: tp inside cp inside dp, one pp stage each)
    dp x tp x cp = edp x ep x etp        (expert layers re-split the same ranks of one pp stage)

``plan_parallel(world_size, tp, pp, ep, cp, ...)`` checks that a world splits that way and returns
the ``ParallelPlan`` (including dp) that launch scripts use; ``ParallelSizes`` gives the
``TransformerConfig`` fields and the token multiple a packed micro-batch must be padded to;
``initialize_parallel_state`` brings ``torch.distributed`` and Megatron's ``parallel_state`` to the
sizes: in a plain single process it starts a world of one (gloo on CPU, nccl on GPU), under
torchrun it joins the launched world.

Layer counts and vocabularies that do not divide: ``pipeline_stage_fields`` splits a layer count
that pp does not divide with Megatron's own uneven-split fields
(``num_layers_in_first_pipeline_stage`` / ``num_layers_in_last_pipeline_stage``), and checks those
fields when the caller sets them; ``padded_vocab_size`` is Megatron-LM's vocabulary padding for
tensor parallelism.

Context parallelism is DualKV's own (Ulysses, ``megatron_dualkv.mcore.context_parallel``): the
context-parallel group of Megatron's ``parallel_state`` has ``cp`` ranks, so DDP,
``finalize_model_grads`` and the schedules reduce gradients over dp x cp and scale the loss by cp
exactly as for Megatron's own context parallelism, while ``TransformerConfig.context_parallel_size``
stays 1: that field switches on Megatron's TE-only implementation (TE attention and load-balanced
RoPE), which must not run on top of ours.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any, Dict, Mapping, Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

_single_rank_group: Optional[dist.ProcessGroup] = None


@dataclass(frozen=True)
class ParallelSizes:
    """The parallel sizes of one model.

    tp, pp, ep, cp: tensor, pipeline, expert and (Ulysses) context parallel sizes.
    etp: tensor-parallel size of the experts (None: tp, Megatron's default).
    vpp: model chunks per pipeline rank, for the interleaved 1F1B schedule (None: plain 1F1B).
    sp: sequence parallelism over the tensor-parallel group (None: on whenever tp > 1; Megatron's
        MoE layers need it under tensor parallelism, and it splits the norms' activations by tp).
    """

    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    etp: Optional[int] = None
    vpp: Optional[int] = None
    sp: Optional[bool] = None

    def __post_init__(self):
        for name in ("tp", "pp", "ep", "cp", "etp", "vpp"):
            value = getattr(self, name)
            if value is None and name in ("etp", "vpp"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)
        if self.vpp == 1:
            object.__setattr__(self, "vpp", None)
        if self.vpp is not None and self.pp == 1:
            raise ValueError(f"vpp={self.vpp} interleaves pipeline stages and needs pp > 1")
        if self.sp is None:
            object.__setattr__(self, "sp", self.tp > 1)
        elif not isinstance(self.sp, bool):
            raise ValueError(f"sp must be a bool or None, got {self.sp!r}")
        elif self.sp and self.tp == 1:
            raise ValueError("sp=True splits the sequence over the tensor-parallel group and needs tp > 1")

    @property
    def model_ranks(self) -> int:
        """Ranks that hold one replica of the model: tp x pp x cp."""
        return self.tp * self.pp * self.cp

    @property
    def token_multiple(self) -> int:
        """What the packed token count of every micro-batch must be a multiple of: context
        parallelism cuts the packed sequence into cp equal slices, sequence parallelism each slice
        into tp. Pack with ``pack_groups(groups, pad_to_multiple_of=sizes.token_multiple)`` (or a
        multiple of it); the padding is its own segment, so it never changes a loss."""
        return self.cp * (self.tp if self.sp else 1)

    def transformer_config_kwargs(self) -> dict:
        return dict(
            tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=self.pp,
            virtual_pipeline_model_parallel_size=self.vpp,
            expert_model_parallel_size=self.ep,
            expert_tensor_parallel_size=self.etp,
            # Megatron's own (TE-only) context parallelism stays off: see the module docstring.
            context_parallel_size=1,
            sequence_parallel=self.sp,
            # Packed micro-batches differ in length: pipeline stages exchange each one's shape,
            # except in the interleaved schedule, where Megatron 0.16.1's shape exchange deadlocks
            # (forward_backward pads its micro-batches to one length instead).
            variable_seq_lengths=self.pp > 1 and not self.vpp,
            # The interleaved schedule on two stages sends to both neighbours, the same peer, in one
            # step: only Megatron's unbatched p2p path keeps the two directions apart.
            batch_p2p_comm=not (self.pp == 2 and self.vpp),
        )

    def same_parallel_state(self, other: "ParallelSizes") -> bool:
        """Whether both need the same Megatron parallel state (``sp`` is a model setting only)."""
        return all(getattr(self, f.name) == getattr(other, f.name) for f in fields(self) if f.name != "sp")


@dataclass(frozen=True)
class ParallelPlan:
    """How ``world_size`` processes are split for ``sizes``.

    dp: data-parallel replicas of the dense layers (world / (tp x pp x cp)).
    expert_dp: data-parallel replicas of every expert (dp x tp x cp / (ep x etp)).
    """

    sizes: ParallelSizes
    world_size: int
    dp: int
    expert_dp: int


def plan_parallel(
    world_size: int,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    cp: int = 1,
    *,
    etp: Optional[int] = None,
    vpp: Optional[int] = None,
    sp: Optional[bool] = None,
) -> ParallelPlan:
    """The ``ParallelPlan`` of a world of ``world_size`` processes; ValueError when it does not split."""
    sizes = ParallelSizes(tp=tp, pp=pp, ep=ep, cp=cp, etp=etp, vpp=vpp, sp=sp)
    return plan_for_world(sizes, world_size)


def plan_for_world(sizes: ParallelSizes, world_size: int) -> ParallelPlan:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if world_size % sizes.model_ranks:
        raise ValueError(
            f"{sizes} needs tp*pp*cp = {sizes.model_ranks} ranks per model replica, but this world has "
            f"{world_size} process(es); launch a multiple of {sizes.model_ranks}, e.g. "
            f"torchrun --nproc-per-node {sizes.model_ranks}"
        )
    dp = world_size // sizes.model_ranks
    stage_ranks = dp * sizes.tp * sizes.cp
    expert_ranks = sizes.ep * sizes.etp
    if stage_ranks % expert_ranks:
        raise ValueError(
            f"{sizes}: the dp*tp*cp = {stage_ranks} ranks of a pipeline stage cannot hold experts split "
            f"ep*etp = {expert_ranks} ways; choose ep*etp dividing {stage_ranks}"
        )
    return ParallelPlan(sizes=sizes, world_size=world_size, dp=dp, expert_dp=stage_ranks // expert_ranks)


def check_model_split(config, sizes: ParallelSizes) -> None:
    """ValueError when a model of ``config`` cannot be split ``sizes`` ways (what Megatron would
    only assert, or find out in the middle of a forward)."""
    heads_split = sizes.tp * sizes.cp
    if config.num_attention_heads % heads_split:
        raise ValueError(
            f"num_attention_heads ({config.num_attention_heads}) is not divisible by tp*cp ({heads_split}): "
            "tensor parallelism and then Ulysses context parallelism split the attention heads"
        )
    if config.num_moe_experts and config.num_moe_experts % sizes.ep:
        raise ValueError(f"num_moe_experts ({config.num_moe_experts}) is not divisible by ep ({sizes.ep})")
    if config.num_moe_experts and sizes.tp > 1 and not sizes.sp:
        raise ValueError("Megatron's MoE layers train under tensor parallelism only with sequence parallelism: sp=True (the default)")


STAGE_FIELDS = ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage")
# Megatron's other ways of placing layers on stages: given any of them, the split is the caller's.
_OTHER_SPLIT_FIELDS = ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")


def pipeline_stage_fields(num_layers: int, sizes: ParallelSizes, config_fields: Mapping[str, Any]) -> Dict[str, int]:
    """The ``TransformerConfig`` fields that put ``num_layers`` on the pipeline stages of ``sizes``,
    given the fields the config already has (``config_fields``: the card's and the caller's).

    A split the caller set is checked (``num_layers_in_first/last_pipeline_stage``: ValueError
    naming the field when Megatron cannot run it; ``pipeline_model_parallel_layout``: its model
    chunks per stage must be ``vpp``) and nothing is added. Otherwise a layer count that divides
    by pp*vpp keeps Megatron's even split, and one that does not gets ``balanced_stage_layers``
    (per model chunk under vpp) as Megatron's first- and last-stage layer counts (at pp=2 the
    first only: Megatron then gives the second stage the rest).
    """
    first, last = (config_fields.get(name) for name in STAGE_FIELDS)
    layout = config_fields.get("pipeline_model_parallel_layout")
    if layout is not None:
        _check_layout_chunks(layout, sizes)
        return {}
    if first is not None or last is not None:
        _check_stage_layers(num_layers, sizes, first, last)
        return {}
    chunks = sizes.vpp or 1
    if chunks > 1 and num_layers < sizes.pp * chunks:
        raise ValueError(f"num_layers ({num_layers}) is fewer than the pp*vpp ({sizes.pp * chunks}) pipeline stages and "
                         "model chunks: each needs a layer")
    if sizes.pp == 1 or num_layers % (sizes.pp * chunks) == 0 or any(config_fields.get(f) for f in _OTHER_SPLIT_FIELDS):
        return {}
    if num_layers % chunks:
        raise ValueError(
            f"num_layers ({num_layers}) does not split over pp={sizes.pp} stages of vpp={chunks} model chunks: an "
            "uneven split needs every stage's layer count to be a multiple of vpp; choose a vpp dividing num_layers"
        )
    counts = balanced_stage_layers(num_layers // chunks, sizes.pp)
    if sizes.pp == 2:  # the second stage as Megatron's one middle stage: see _check_stage_layers
        return {STAGE_FIELDS[0]: counts[0] * chunks}
    return dict(zip(STAGE_FIELDS, (counts[0] * chunks, counts[-1] * chunks)))


def balanced_stage_layers(num_layers: int, pp: int) -> Tuple[int, ...]:
    """Layers per pipeline stage when ``num_layers`` does not divide by ``pp``, in Megatron's uneven
    form (the middle stages equal): the split whose largest stage is smallest; among those, the
    one whose first and last stages are lightest (they also hold the embedding and the output
    layer), the last no heavier than the first. 62 layers over 4 stages: 15, 16, 16, 15."""
    if num_layers < pp:
        raise ValueError(f"num_layers ({num_layers}) is fewer than pp ({pp}): every pipeline stage needs a layer")
    if pp == 2:
        return (num_layers - num_layers // 2, num_layers // 2)

    def split(middle: int) -> Tuple[int, ...]:
        ends = num_layers - (pp - 2) * middle
        return (ends - ends // 2,) + (middle,) * (pp - 2) + (ends // 2,)

    candidates = [split(middle) for middle in range(1, (num_layers - 2) // (pp - 2) + 1)]
    return min(candidates, key=lambda counts: (max(counts), -counts[1]))


def _check_stage_layers(num_layers: int, sizes: ParallelSizes, first: Optional[int], last: Optional[int]) -> None:
    """ValueError naming the field when Megatron cannot build these first/last-stage layer counts."""
    given = {name: value for name, value in zip(STAGE_FIELDS, (first, last)) if value is not None}
    chunks = sizes.vpp or 1
    for name, value in given.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
        if sizes.pp == 1:
            raise ValueError(f"{name}={value} places layers on pipeline stages and needs pp > 1")
        if value % chunks:
            raise ValueError(
                f"{name} ({value}) must be a multiple of vpp ({chunks}): the stage's model chunks get equal layers"
            )
    middle_stages, middle_layers = sizes.pp - len(given), num_layers - sum(given.values())
    named = " + ".join(f"{name} ({value})" for name, value in given.items())
    if sizes.vpp and middle_stages == 0:
        # Megatron (0.16 to 0.19) divides the interleaved layer offsets by the number of middle stages
        raise ValueError(
            f"{named} with vpp={sizes.vpp} leave no middle pipeline stage, which Megatron's interleaved layer offsets "
            "need: set num_layers_in_first_pipeline_stage only"
        )
    if middle_stages == 0 and middle_layers:
        raise ValueError(f"{named} must add up to num_layers ({num_layers}) over pp={sizes.pp} stages")
    if middle_stages and (middle_layers < middle_stages or middle_layers % middle_stages):
        raise ValueError(
            f"{named} leave {middle_layers} of num_layers ({num_layers}) for the other {middle_stages} pipeline "
            f"stage(s), which Megatron gives equal layer counts of at least 1: choose values that leave a multiple "
            f"of {middle_stages}"
        )
    if middle_stages and middle_layers // middle_stages % chunks:
        raise ValueError(
            f"{named} leave {middle_layers // middle_stages} layers on each other pipeline stage, not a multiple of "
            f"vpp ({chunks})"
        )


def _check_layout_chunks(layout, sizes: ParallelSizes) -> None:
    """ValueError when ``pipeline_model_parallel_layout`` has another number of model chunks per stage than vpp."""
    if isinstance(layout, PipelineParallelLayerLayout):
        chunks = layout.virtual_pipeline_model_parallel_size
    else:
        stages = PipelineParallelLayerLayout.parse_str_to_list(layout) if isinstance(layout, str) else layout
        chunks = len(stages) // sizes.pp
    if chunks != (sizes.vpp or 1):
        raise ValueError(
            f"pipeline_model_parallel_layout has {chunks} model chunk(s) per pipeline stage, but build_model was given "
            f"vpp={sizes.vpp}: pass vpp={chunks if chunks > 1 else None}"
        )


def padded_vocab_size(vocab_size: int, tp: int, make_vocab_size_divisible_by: int = 128) -> int:
    """Megatron-LM's padded vocabulary: the smallest multiple of ``make_vocab_size_divisible_by * tp``
    that holds ``vocab_size`` (itself when it already is one). The padded rows of the embedding
    and the output layer are never a token: log-probs leave them out of every softmax."""
    divisor = make_vocab_size_divisible_by
    if isinstance(divisor, bool) or not isinstance(divisor, int) or divisor < 1:
        raise ValueError(f"make_vocab_size_divisible_by must be a positive int, got {divisor!r}")
    multiple = divisor * tp
    return -(-vocab_size // multiple) * multiple


# Transformer Engine's FP8 matmuls take row counts that are multiples of 16
FP8_TOKEN_MULTIPLE = 16


def micro_batch_token_multiple(sizes: ParallelSizes, fp8) -> int:
    """What the packed token count of every micro-batch must be a multiple of:
    ``sizes.token_multiple``, times 16 where the linears run in FP8 (``fp8``: a format or None/False;
    every rank's slice of the tokens is then a multiple of 16 rows)."""
    return sizes.token_multiple * (FP8_TOKEN_MULTIPLE if fp8 else 1)


def current_parallel_sizes(config=None) -> ParallelSizes:
    """The sizes Megatron's parallel state was initialised with; ``sp`` from the model's
    ``TransformerConfig`` when given (sequence parallelism is a model setting, not parallel state)."""
    return ParallelSizes(
        tp=parallel_state.get_tensor_model_parallel_world_size(),
        pp=parallel_state.get_pipeline_model_parallel_world_size(),
        ep=parallel_state.get_expert_model_parallel_world_size(),
        cp=parallel_state.get_context_parallel_world_size(),
        etp=parallel_state.get_expert_tensor_parallel_world_size(),
        vpp=parallel_state.get_virtual_pipeline_model_parallel_world_size(),
        sp=None if config is None else config.sequence_parallel,
    )


def initialize_parallel_state(sizes: ParallelSizes, seed: int) -> None:
    """Make ``torch.distributed`` and Megatron's parallel state match ``sizes``, then seed Megatron's RNG.

    Raises ValueError when the world cannot hold ``sizes``, or when Megatron's parallel state
    already exists with other sizes (one parallel layout per process).
    """
    if not dist.is_initialized():
        _init_process_group()
    if parallel_state.model_parallel_is_initialized():
        current = current_parallel_sizes()
        if not current.same_parallel_state(sizes):
            raise ValueError(f"Megatron's parallel state is already initialised with {current}; cannot build a model with {sizes}")
    else:
        plan_for_world(sizes, dist.get_world_size())
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=sizes.tp,
            pipeline_model_parallel_size=sizes.pp,
            virtual_pipeline_model_parallel_size=sizes.vpp,
            context_parallel_size=sizes.cp,
            expert_model_parallel_size=sizes.ep,
            expert_tensor_parallel_size=sizes.etp,
        )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def single_rank_group() -> dist.ProcessGroup:
    """A process group of this rank alone: what Megatron's own context-parallel code paths are
    handed inside a DualKV model, so that they see no context parallelism (created once)."""
    global _single_rank_group
    if _single_rank_group is None:
        # Local synchronisation: every rank creates its own group without the others joining in.
        _single_rank_group = dist.new_group([dist.get_rank()], use_local_synchronization=True)
    return _single_rank_group


def _init_process_group() -> None:
    """The launcher's world under torchrun (RANK/WORLD_SIZE/MASTER_* set); else a world of one whose
    store lives in this process: no port (a port found free can be taken by another process before
    it is bound) and no change to the environment that child processes would inherit."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        local_rank, gpus = int(os.environ.get("LOCAL_RANK", 0)), torch.cuda.device_count()
        if local_rank >= gpus:
            raise RuntimeError(
                f"LOCAL_RANK={local_rank} needs GPU {local_rank}, but this machine shows {gpus}: start at most {gpus} "
                "processes per node (torchrun --nproc-per-node), one per GPU"
            )
        torch.cuda.set_device(local_rank)
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
