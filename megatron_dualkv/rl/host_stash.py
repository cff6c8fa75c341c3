"""Saved activations in page-locked host memory at their own sizes: prefix reuse's prompt on the host.

``torch.autograd.graph.save_on_cpu(pin_memory=True)`` takes each saved tensor's host copy from
torch's pinned allocator, which rounds every block up to a power of two (a 650 MB layer input takes
1 GiB), and it copies the weights that the layers save too. A Qwen3-4B prompt of 126,976 tokens,
62 GiB of activations by the memory model, so took the whole 125 GiB of the H200's host and the
process was killed. ``HostStash`` instead hands out pieces of slabs that it page-locks itself,
keeps the slabs from one step to the next (page-locking is slow), copies a storage range saved
twice once, and leaves parameters where they are. A stash serves one held prompt at a time:
``hooks()`` starts over at the first slab.
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager
from functools import lru_cache
from typing import Dict, List, Tuple

import torch

from ..mcore.recompute import outputs_kept

# Pieces start at multiples of this from their slab's start (itself 64-byte aligned), so that a
# uint8 slab can be viewed as any dtype.
ALIGN = 512
SLAB_BYTES = 1 << 30


class HostStash:
    """Host memory for saved tensors: ``take(nbytes)`` gives a piece of the first slab with room (a
    slab of its own when the piece is larger than a slab), ``hooks()`` the saved-tensor hooks that
    copy into it.

    A contiguous tensor whose bytes were saved already in this use (the same storage range, at
    the same version: one tensor saved by several nodes, or a reshaped view of it, such as the
    attention output that the attention and ``linear_proj`` both save) shares the first copy;
    autograd without hooks would keep that storage once too.

    pin: page-lock the slabs (cudaHostRegister), so that the copies to and from the GPU run
    asynchronously; False on a machine without CUDA (the copies are then plain host copies).
    """

    def __init__(self, pin: bool, slab_bytes: int = SLAB_BYTES):
        self.pin, self.slab_bytes = pin, slab_bytes
        self.slabs: List[torch.Tensor] = []
        self.used: List[int] = []  # per slab, bytes handed out since ``hooks()`` last started over
        self.taken_bytes = 0  # the same total: the slabs' content
        self._copies: Dict[Tuple[int, int, int], torch.Tensor] = {}  # (address, bytes, version) -> piece
        if pin:  # the slabs stay page-locked until the stash goes; unregistered before their memory is freed
            weakref.finalize(self, _unpin, self.slabs)

    @property
    def reserved_bytes(self) -> int:
        return sum(s.numel() for s in self.slabs)

    def take(self, nbytes: int) -> torch.Tensor:
        """(nbytes,) uint8: a piece ``ALIGN``-aligned within its slab. First fit: a slab holding one
        large piece still takes smaller ones (the inputs of layers recomputed whole, 0.6 GiB each
        at a 127K-token Qwen3-4B prompt, would otherwise leave 40% of every 1 GiB slab empty). The
        same sequence of sizes lands in the same places every step, on the slabs kept."""
        size = -(-max(nbytes, 1) // ALIGN) * ALIGN
        index = next((i for i, slab in enumerate(self.slabs) if self.used[i] + size <= slab.numel()), None)
        if index is None:
            index = next((i for i, used in enumerate(self.used) if used == 0), len(self.slabs))
            if index < len(self.slabs):  # a slab kept from an earlier, different use, too small: replaced
                self._drop_slab(index)
            self.slabs.insert(index, self._new_slab(max(size, self.slab_bytes)))
            self.used.insert(index, 0)
        start = self.used[index]
        self.used[index] += size
        self.taken_bytes += nbytes
        return self.slabs[index][start : start + nbytes]

    def start_over(self) -> None:
        """Hand out pieces from the first slab again: what was taken before must be no longer read."""
        self.used, self.taken_bytes = [0] * len(self.slabs), 0
        self._copies.clear()

    @contextmanager
    def hooks(self):
        """Hooks that keep every saved tensor but the parameters in this stash until the backward
        unpacks it; they start over at the first slab, so the previous user's backward must be done.
        Selective recompute keeps its outputs inside (``outputs_kept``): what their consumers save
        is the copy here."""
        self.start_over()
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack), outputs_kept():
            yield

    def _pack(self, tensor: torch.Tensor):
        if is_parameter(tensor):
            return tensor
        nbytes = tensor.numel() * tensor.element_size()
        key = None
        if tensor.is_contiguous():
            storage = tensor.untyped_storage()
            key = (storage.data_ptr() + tensor.storage_offset() * tensor.element_size(), nbytes, tensor._version)
        piece = self._copies.get(key) if key is not None else None
        if piece is None:
            piece = self.take(nbytes)
            piece.view(tensor.dtype).view(tensor.shape).copy_(tensor, non_blocking=self.pin)
            if key is not None:
                self._copies[key] = piece
                # the address may be reused once the storage is freed (its Python object lives as long)
                weakref.finalize(storage, self._copies.pop, key, None)
        return tensor.device, piece, tensor.dtype, tensor.shape

    def _new_slab(self, nbytes: int) -> torch.Tensor:
        slab = torch.empty(nbytes, dtype=torch.uint8)
        if self.pin:
            status = int(torch.cuda.cudart().cudaHostRegister(slab.data_ptr(), nbytes, 0))
            if status != 0:
                raise RuntimeError(f"prefix reuse on the host: page-locking {nbytes / 2**30:.1f} GiB of host memory "
                                   f"failed (cudaError {status}), with {self.reserved_bytes / 2**30:.1f} GiB locked "
                                   "already; lower the host budget (plan_memory --host-gib) or turn "
                                   "prefix_reuse_prompt_on_host off")
        return slab

    def _drop_slab(self, index: int) -> None:
        slab = self.slabs.pop(index)
        if self.pin:
            _unpin([slab])


def is_parameter(tensor: torch.Tensor) -> bool:
    """A parameter or a view of one (a weight saved transposed): alive anyway, a copy would only cost
    transfers."""
    return isinstance(tensor, torch.nn.Parameter) or isinstance(tensor._base, torch.nn.Parameter)


def _unpack(packed):
    if isinstance(packed, torch.Tensor):
        return packed
    device, piece, dtype, shape = packed
    return piece.view(dtype).view(shape).to(device, non_blocking=True)


def _unpin(slabs: List[torch.Tensor]) -> None:
    for slab in slabs:
        torch.cuda.cudart().cudaHostUnregister(slab.data_ptr())
    slabs.clear()


@lru_cache(maxsize=None)
def host_stash() -> HostStash:
    """This process's stash (one rank holds one prompt at a time)."""
    return HostStash(pin=torch.cuda.is_available())
