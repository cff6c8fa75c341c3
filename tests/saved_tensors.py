"""What autograd keeps for the backward of one forward: every tensor the graph saved, by the storage
it lives in (parameters excepted), as the recompute tests and their GPU variant count it."""
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

import torch

from megatron_dualkv.rl.logprobs import response_logprobs


@dataclass
class SavedTensors:
    """The storages saved during one forward, measured once it has returned.

    kept: bytes of those storages still allocated. released: bytes of saved tensors whose storage
    was freed after they were saved (what ``checkpoint_without_output`` releases: the tensor keeps
    its shape until the backward recomputes it). by_module: per innermost module that was running
    when the tensor was saved, (shape, dtype, bytes kept) of each storage.
    """

    kept: int = 0
    released: int = 0
    by_module: Dict[str, List[Tuple[tuple, torch.dtype, int]]] = field(default_factory=dict)


def saved_tensors(model, batch) -> SavedTensors:
    """Forward ``batch`` through ``model`` (packed layout) under autograd and count what the graph
    saved; the graph is then dropped without a backward (outside Megatron's schedule, a MoE
    backward would leave the aux-loss scale it sets unset)."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    running: List[str] = []

    def leave(module, args, output):
        running.pop()

    handles = []
    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(lambda m, args, name=name: running.append(name)))
        handles.append(module.register_forward_hook(leave))
    saved, released = {}, []  # live storages by address; tensors whose storage was freed since

    def pack(tensor):
        address = tensor.untyped_storage().data_ptr()
        if address in parameters:
            return tensor
        if address in saved and not saved[address][0].untyped_storage().nbytes():
            released.append(saved.pop(address))  # freed, and its address reused by this tensor
        saved.setdefault(address, (tensor, running[-1] if running else ""))
        return tensor

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            graph = response_logprobs(model, batch)
    finally:
        for handle in handles:
            handle.remove()
    result = SavedTensors()
    for tensor, module in [*saved.values(), *released]:
        nbytes = tensor.untyped_storage().nbytes()
        if nbytes:
            result.kept += nbytes
        else:
            result.released += tensor.numel() * tensor.element_size()
        result.by_module.setdefault(module, []).append((tuple(tensor.shape), tensor.dtype, nbytes))
    del graph  # alive until counted
    return result
