"""Whole layers' saved activations in page-locked host memory from their forward to their backward,
the copies overlapped with compute: ``recompute="offload"`` with ``recompute_layers=N`` (the first N
layers of every pipeline stage, or model chunk; selective recompute in every layer).

Why: freeing a layer's activations by recomputing it whole costs its forward again (about 9 ms a
GiB on Qwen3.5-4B on an H200). Copying what it saved to the host and back costs copy-engine time,
which runs beside the kernels; only the copies that compute cannot hide cost the step.

Forward. An offloaded layer runs under saved-tensor hooks that only note what autograd saves. At
the layer's end every noted storage is copied once (tensors sharing a storage share the copy) into
a piece of a ``HostStash`` on a side stream, ordered after the layer's kernels, and the layer's
references go: the storage returns to the allocator when its copy is done (``record_stream``).
Left in place: parameters, storages under ``offload_min_bytes`` (the config's; index tables and
norms' statistics are not worth a copy), tensor subclasses (FP8), and the storages that selective
recompute released in the layer (their recompute restores them).

Backward. Every layer of a stage marks its output. When the gradient of layer j's output is computed
(the backward reaches layer j of that micro-batch), the offloaded layers of the same micro-batch at
positions j - distance .. j are copied back on a second stream, into storages allocated on the
compute stream; an unpack waits for its layer's copies and rebuilds its view (shape, strides, offset)
on the restored storage, which the layer drops once every tensor saved on it has been unpacked.

``prefetch_distance``: the copies back of N offloaded layers must run ahead of their backwards. A
layer's copy takes about as long as its backward (PCIe 5 at ~50 GB/s against ~80-100 KiB a token
a layer), so starting N / 3 + 1 layers early keeps the copy engine busy and the backward fed, and
the restored layers stay far below the peak (the layers above have freed theirs by then).
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager
from functools import lru_cache
from typing import Dict, List, Optional

import torch
from torch import Tensor

from ..rl.host_stash import HostStash, is_parameter


def prefetch_distance(offloaded_layers: int) -> int:
    """How many layers above an offloaded layer its copy back starts (see the module docstring)."""
    return offloaded_layers // 3 + 1


class _Storage:
    """One saved storage of an offloaded layer: on the device until the layer's end (``device``), then a
    host piece (``host``) and, once copied back, a device storage again (``restored``) until the last
    of the tensors saved on it is unpacked."""

    __slots__ = ("device", "host", "restored", "unpacks")

    def __init__(self, tensor: Tensor):
        self.device: Optional[Tensor] = _bytes_of(tensor)
        self.host: Optional[Tensor] = None
        self.restored: Optional[Tensor] = None
        self.unpacks = 0

    @property
    def released(self) -> bool:
        """Freed by selective recompute (``recompute._release``), which restores it itself."""
        return self.device.untyped_storage().nbytes() == 0


class _Saved:
    """One saved tensor: kept as it is (``storage`` None), or a view of an offloaded storage."""

    __slots__ = ("tensor", "storage", "dtype", "size", "stride", "offset")

    def __init__(self, tensor: Tensor, storage: Optional[_Storage] = None):
        self.tensor: Optional[Tensor] = tensor  # until the layer's end where offloaded
        self.storage = storage
        self.dtype, self.size, self.stride, self.offset = tensor.dtype, tensor.size(), tensor.stride(), tensor.storage_offset()


class OffloadedLayer:
    """The saved tensors of one offloaded layer's forward in one micro-batch."""

    def __init__(self, offload: "LayerOffload", position: int, min_bytes: int):
        self.offload, self.position, self.min_bytes = offload, position, min_bytes
        self.saved: List[_Saved] = []  # offloaded candidates, until the layer's end
        self.storages: Dict[int, _Storage] = {}  # by device address, until the layer's end
        self.copied: List[_Storage] = []  # on the host from the layer's end
        self.copied_out = self.copied_in = None  # CUDA events after the copies to the host / back
        self.fetched = False

    @property
    def done(self) -> bool:
        """Its backward has read back every storage it copied out (or it copied none)."""
        return all(record.unpacks <= 0 for record in self.copied) and (self.fetched or not self.copied)

    def pack(self, tensor: Tensor):
        streams = self.offload.streams
        if (type(tensor) is not Tensor or is_parameter(tensor) or (streams is not None and not tensor.is_cuda)
                or tensor.untyped_storage().nbytes() < self.min_bytes):
            return self, _Saved(tensor)
        address = tensor.untyped_storage().data_ptr()
        record = self.storages.get(address)
        if record is None or record.released:  # (an address freed and reused within the layer)
            record = self.storages[address] = _Storage(tensor)
        saved = _Saved(tensor, record)
        self.saved.append(saved)
        return self, saved

    def copy_out(self) -> None:
        """At the layer's end: each storage it saved that is still allocated, to the host."""
        for saved in self.saved:
            if saved.storage.released:
                saved.storage = None
            else:
                saved.storage.unpacks += 1
                saved.tensor = None
        self.copied = [record for record in self.storages.values() if record.unpacks]
        self.saved, self.storages = [], {}
        for record in self.copied:
            record.host = self.offload.stash.take(record.device.numel())
        streams = self.offload.streams
        if streams is None:
            for record in self.copied:
                record.host.copy_(record.device)
                record.device = None
            return
        after_layer = torch.cuda.current_stream().record_event()
        with torch.cuda.stream(streams.out):
            streams.out.wait_event(after_layer)
            for record in self.copied:
                record.host.copy_(record.device, non_blocking=True)
                record.device.record_stream(streams.out)  # the allocator reuses it once the copy is done
                record.device = None
            self.copied_out = streams.out.record_event()

    def fetch(self) -> None:
        """Copy back this layer's storages that are not on the device, once: on CUDA asynchronously,
        after the copies out and after what the compute stream has queued (whose freed memory the new
        storages may take)."""
        if self.fetched:
            return
        self.fetched = True
        missing = [record for record in self.copied if record.restored is None]
        streams = self.offload.streams
        if streams is None:
            for record in missing:
                record.restored = record.host.clone()
            return
        for record in missing:
            record.restored = torch.empty(record.host.numel(), dtype=torch.uint8, device=streams.device)
        queued = torch.cuda.current_stream().record_event()
        with torch.cuda.stream(streams.back):
            streams.back.wait_event(queued)
            streams.back.wait_event(self.copied_out)
            for record in missing:
                record.restored.copy_(record.host, non_blocking=True)
            self.copied_in = streams.back.record_event()

    def unpack(self, saved: _Saved) -> Tensor:
        record = saved.storage
        if record is None:
            return saved.tensor
        if record.restored is None:  # a second backward through a retained graph: from the host again
            self.fetched = False
        self.fetch()
        if self.copied_in is not None:
            torch.cuda.current_stream().wait_event(self.copied_in)
        restored = record.restored
        record.unpacks -= 1
        if record.unpacks <= 0:
            record.restored = None  # autograd holds the view while its node runs
        view = torch.empty(0, dtype=saved.dtype, device=restored.device)
        return view.set_(restored.untyped_storage(), saved.offset, saved.size, saved.stride)


class _Chain:
    """The layers of one micro-batch's forward through one stage (model chunk), by position."""

    def __init__(self):
        self.offloaded: List[OffloadedLayer] = []
        self.last_position = 0


class _Streams:
    def __init__(self, device: torch.device):
        self.device = device
        self.out = torch.cuda.Stream(device)
        self.back = torch.cuda.Stream(device)


class LayerOffload:
    """The process's offloaded layers (``layer_offload()``): host pieces from one ``HostStash``, which
    starts over at its first slab when every offloaded layer still alive has had its backward (a
    retained graph's second backward must come before the next forward)."""

    def __init__(self, stash: HostStash):
        self.stash = stash
        self.streams: Optional[_Streams] = None
        self._alive: "weakref.WeakSet[OffloadedLayer]" = weakref.WeakSet()
        self._chain = _Chain()

    @contextmanager
    def layer(self, position: int, offloaded: bool, device: torch.device, distance: int, min_bytes: int = 0):
        """Run one layer's forward at ``position`` (1-based within its stage) of the current micro-batch;
        ``offloaded``: its saved tensors of ``min_bytes`` or more go to the host. Yields
        ``mark_output(hidden)``, to be called on the layer's output, which starts the copies back of the
        layers up to ``distance`` below."""
        if position <= self._chain.last_position:
            self._chain = _Chain()  # positions start again: the next micro-batch (or chunk)
        chain = self._chain
        chain.last_position = position
        if device.type == "cuda" and self.streams is None:
            self.streams = _Streams(device)
        group = None
        if offloaded:
            if all(earlier.done for earlier in self._alive):
                self._start_over()
            group = OffloadedLayer(self, position, min_bytes)
            self._alive.add(group)
            chain.offloaded.append(group)

        def mark_output(hidden: Tensor) -> None:
            if hidden.requires_grad and chain.offloaded:
                hidden.register_hook(lambda grad: _prefetch(chain, position, distance))

        if group is None:
            yield mark_output
            return
        with torch.autograd.graph.saved_tensors_hooks(group.pack, _unpack):
            yield mark_output
        group.copy_out()

    def _start_over(self) -> None:
        if self.streams is not None:  # the last copies back read the pieces the next copies out write
            self.streams.out.wait_stream(self.streams.back)
        self.stash.start_over()


def _unpack(packed) -> Tensor:
    group, saved = packed
    return group.unpack(saved)


def _prefetch(chain: _Chain, position: int, distance: int) -> None:
    for group in chain.offloaded:
        if position - distance <= group.position <= position:
            group.fetch()


def _bytes_of(tensor: Tensor) -> Tensor:
    """The whole storage of ``tensor`` as a flat uint8 tensor."""
    storage = tensor.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage, 0, (storage.nbytes(),), (1,))


@lru_cache(maxsize=None)
def layer_offload() -> LayerOffload:
    """This process's offload (its own stash: prefix reuse's prompt on the host has the other)."""
    return LayerOffload(HostStash(pin=torch.cuda.is_available()))
