"""Prefix reuse's prompt between pipeline stages (``rl.prefix_reuse``).

Megatron's schedule exchanges one tensor per micro-batch on the pipeline group, its calls paired in
order between neighbouring stages. The prompt's hidden states (inside its first part's forward step)
and their gradient (inside its last part's backward step) travel outside that order, so they go over
a process group of their own across the same ranks. A stage sends before the neighbour that receives
reaches the matching step (its own part's message on the schedule's group follows), so sends must not
block: they are waited for when the step's schedule has finished. Receives block.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import List, Optional, Tuple

import torch.distributed as dist
from megatron.core import parallel_state
from torch import Tensor


class PromptPipeline:
    """This rank's pipeline stage on the prompt's process group (``group``: one rank per stage, in
    stage order, as Megatron's pipeline group)."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.stage = group.rank()
        self.is_first, self.is_last = self.stage == 0, self.stage == group.size() - 1
        self._sends: List[Tuple[dist.Work, Tensor]] = []

    def send(self, tensor: Tensor, stage: int) -> None:
        tensor = tensor.detach().contiguous()
        self._sends.append((dist.isend(tensor, group=self.group, group_dst=stage), tensor))

    def receive(self, buffer: Tensor, stage: int) -> Tensor:
        dist.recv(buffer, group=self.group, group_src=stage)
        return buffer

    def finish_sends(self) -> None:
        for work, _ in self._sends:
            work.wait()
        self._sends = []


# (Megatron's pipeline group it was made for, this rank's PromptPipeline): Megatron's parallel state
# may be destroyed and initialised again, with other pipeline groups
_current: Optional[Tuple[dist.ProcessGroup, PromptPipeline]] = None


@contextmanager
def prompt_pipeline_step():
    """Around one step's schedule, entered on every rank (``forward_backward``): under the 1F1B
    pipeline schedule, sets up this rank's ``PromptPipeline`` (a collective over the world at the
    first step of a parallel state) and waits for the prompt's sends when the step ends."""
    pipelined = parallel_state.get_pipeline_model_parallel_world_size() > 1
    if not pipelined or parallel_state.get_virtual_pipeline_model_parallel_world_size():
        yield
        return
    _set_up()
    yield
    _current[1].finish_sends()


def _set_up() -> None:
    """Every rank creates every pipeline's prompt group, in one order (``new_group`` is collective)."""
    global _current
    pipeline_group = parallel_state.get_pipeline_model_parallel_group()
    if _current is not None and _current[0] is pipeline_group:
        return
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, dist.get_process_group_ranks(pipeline_group))
    group, _ = dist.new_subgroups_by_enumeration(sorted({tuple(ranks) for ranks in every}))
    _current = (pipeline_group, PromptPipeline(group))


def prompt_pipeline() -> Optional[PromptPipeline]:
    """This rank's ``PromptPipeline`` under pipeline parallelism, None without it."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return None
    if _current is None or _current[0] is not parallel_state.get_pipeline_model_parallel_group():
        raise ValueError("prefix reuse under pipeline parallelism exchanges its prompt between stages on a process "
                         "group of its own: run the step with forward_backward, or enter "
                         "megatron_dualkv.rl.prompt_pipeline.prompt_pipeline_step() on every rank around a "
                         "schedule of your own")
    return _current[1]
