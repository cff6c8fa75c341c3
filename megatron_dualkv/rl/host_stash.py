"""Saved activations in page-locked host memory at their own sizes: prefix reuse's prompt on the host.

``torch.autograd.graph.save_on_cpu(pin_memory=True)`` takes each saved tensor's host copy from
torch's pinned allocator, which rounds every block up to a power of two (a 650 MB layer input takes
1 GiB), and it copies the weights that the layers save too. A Qwen3-4B prompt of 126,976 tokens,
62 GiB of activations by the memory model, so took the whole 125 GiB of the H200's host and the
process was killed. ``HostStash`` instead hands out consecutive pieces of slabs that it page-locks
itself, keeps the slabs from one step to the next (page-locking is slow), and leaves parameters
where they are. A stash serves one held prompt at a time: ``hooks()`` starts over at the first slab.
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager
from functools import lru_cache
from typing import List

import torch

from ..mcore.recompute import outputs_kept

# Pieces start at multiples of this from their slab's start (itself 64-byte aligned), so that a
# uint8 slab can be viewed as any dtype.
ALIGN = 512
SLAB_BYTES = 1 << 30


class HostStash:
    """Host memory for saved tensors: ``take(nbytes)`` gives the next piece of a slab (a slab of
    its own when the piece is larger), ``hooks()`` the saved-tensor hooks that copy into it.

    pin: page-lock the slabs (cudaHostRegister), so that the copies to and from the GPU run
    asynchronously; False on a machine without CUDA (the copies are then plain host copies).
    """

    def __init__(self, pin: bool, slab_bytes: int = SLAB_BYTES):
        self.pin, self.slab_bytes = pin, slab_bytes
        self.slabs: List[torch.Tensor] = []
        self.slab, self.offset = 0, 0
        self.taken_bytes = 0  # handed out since ``hooks()`` last started over: the slabs' content
        if pin:  # the slabs stay page-locked until the stash goes; unregistered before their memory is freed
            weakref.finalize(self, _unpin, self.slabs)

    @property
    def reserved_bytes(self) -> int:
        return sum(s.numel() for s in self.slabs)

    def take(self, nbytes: int) -> torch.Tensor:
        """(nbytes,) uint8: the next piece, ``ALIGN``-aligned within its slab."""
        size = -(-max(nbytes, 1) // ALIGN) * ALIGN
        while True:
            if self.slab == len(self.slabs):
                self.slabs.append(self._new_slab(max(size, self.slab_bytes)))
            slab = self.slabs[self.slab]
            if self.offset + size <= slab.numel():
                piece = slab[self.offset : self.offset + nbytes]
                self.offset += size
                self.taken_bytes += nbytes
                return piece
            if self.offset == 0:  # a slab kept from an earlier step, too small for this piece
                self._drop_slab(self.slab)
                self.slabs.insert(self.slab, self._new_slab(size))
            else:
                self.slab, self.offset = self.slab + 1, 0

    @contextmanager
    def hooks(self):
        """Hooks that keep every saved tensor but the parameters in this stash until the backward
        unpacks it; they start over at the first slab, so the previous user's backward must be done.
        Selective recompute keeps its outputs inside (``outputs_kept``): what their consumers save
        is the copy here."""
        self.slab, self.offset, self.taken_bytes = 0, 0, 0
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack), outputs_kept():
            yield

    def _pack(self, tensor: torch.Tensor):
        if isinstance(tensor, torch.nn.Parameter) or isinstance(tensor._base, torch.nn.Parameter):
            return tensor  # alive anyway: a copy would only cost transfers
        piece = self.take(tensor.numel() * tensor.element_size()).view(tensor.dtype).view(tensor.shape)
        piece.copy_(tensor, non_blocking=self.pin)
        return tensor.device, piece

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


def _unpack(packed):
    if isinstance(packed, torch.Tensor):
        return packed
    device, piece = packed
    return piece.to(device, non_blocking=True)


def _unpin(slabs: List[torch.Tensor]) -> None:
    for slab in slabs:
        torch.cuda.cudart().cudaHostUnregister(slab.data_ptr())
    slabs.clear()


@lru_cache(maxsize=None)
def host_stash() -> HostStash:
    """This process's stash (one rank holds one prompt at a time)."""
    return HostStash(pin=torch.cuda.is_available())
