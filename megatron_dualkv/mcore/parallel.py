"""Parallel settings: the one place where tp/pp/ep/cp are validated and turned into Megatron state.

``ParallelSizes`` gives the ``TransformerConfig`` fields; ``initialize_parallel_state`` brings
``torch.distributed`` and Megatron's ``parallel_state`` to those sizes: in a plain single
process it starts a world of one (gloo on CPU, nccl on GPU) on a free local port; under
torchrun it joins the launched world.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel


@dataclass(frozen=True)
class ParallelSizes:
    """Tensor, pipeline, expert and context parallel sizes of one model."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1

    def __post_init__(self):
        for name in ("tp", "pp", "ep", "cp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.pp > 1:
            raise NotImplementedError(
                f"pp={self.pp}: pipeline parallelism is not wired into the DualKV forward/backward entry points yet"
            )
        if self.cp > 1:
            raise NotImplementedError(
                f"cp={self.cp}: DualKV attention does not split the packed layout across context-parallel ranks yet"
            )

    def transformer_config_kwargs(self) -> dict:
        # Sequence parallelism stays off: the torch-native norms of the local spec reject it.
        return dict(
            tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=self.pp,
            expert_model_parallel_size=self.ep,
            context_parallel_size=self.cp,
            sequence_parallel=False,
        )


def current_parallel_sizes() -> ParallelSizes:
    """The sizes Megatron's parallel state was initialised with."""
    return ParallelSizes(
        tp=parallel_state.get_tensor_model_parallel_world_size(),
        pp=parallel_state.get_pipeline_model_parallel_world_size(),
        ep=parallel_state.get_expert_model_parallel_world_size(),
        cp=parallel_state.get_context_parallel_world_size(),
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
        if current != sizes:
            raise ValueError(f"Megatron's parallel state is already initialised with {current}; cannot build a model with {sizes}")
    else:
        check_world_fits(sizes, dist.get_world_size())
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=sizes.tp,
            pipeline_model_parallel_size=sizes.pp,
            context_parallel_size=sizes.cp,
            expert_model_parallel_size=sizes.ep,
        )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def check_world_fits(sizes: ParallelSizes, world: int) -> None:
    dense = sizes.tp * sizes.pp * sizes.cp
    if world % dense or world % (sizes.ep * sizes.pp):
        raise ValueError(
            f"{sizes} needs a world whose size is a multiple of tp*pp*cp={dense} and of ep*pp={sizes.ep * sizes.pp}, "
            f"but this world has {world} process(es); launch with e.g. torchrun --nproc-per-node {max(dense, sizes.ep * sizes.pp)}"
        )


def _init_process_group() -> None:
    """A world of one in a plain process; the launcher's world under torchrun (RANK/WORLD_SIZE set)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(_free_port())
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, rank=int(os.environ.get("RANK", 0)), world_size=int(os.environ.get("WORLD_SIZE", 1)))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
