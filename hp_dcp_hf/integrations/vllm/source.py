"""VLLMWeightSource: an :class:`~hp_dcp_hf.sync.source.HFWeightSource` as vLLM's trainer-side
``WeightSource``, so that vLLM's own trainer engines (``nccl``, ``ipc``) send a model's weights by
their Hugging Face names, whatever the model's own names and rewrites are, unchanged.

Those engines send full tensors from one sender (trainer rank 0) and only iterate the source on
the other ranks. Rank 0 therefore assembles each tensor, and it does so point to point, with no
all-gather: every other rank sends rank 0 its own slices of the tensor (``torch.distributed``
``send``, as bytes, on the collective device) and rank 0 receives them into the full tensor, where
its own slices already are. Built on a source with ``lowest_replica_holds=True``, a rank's slices
are the bytes no lower rank holds, so each rank sends only what rank 0 (and every rank below it)
lacks, and each byte moves once.

Order: vLLM checks that iteration follows ``metadata()`` and batches it by
``layerwise_groups``; metadata lists the checkpoint's tensors in the groups' flattened order (the
embeddings, each layer, the final norm and head), so vLLM's default ``iter_groups()`` takes it.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource, layerwise_groups

from hp_dcp_hf.errors import ArgumentError
from hp_dcp_hf.geometry.box import Box
from hp_dcp_hf.sync.source import HFWeightSource
from hp_dcp_hf.util.collectives import collective_device, should_broadcast


class VLLMWeightSource(WeightSource):
    """vLLM's ``WeightSource`` over ``source`` (see the module docstring); every trainer rank
    builds it (collective: rank 0 learns every rank's boxes, a few integers each) and iterates it
    once per update, in lockstep.

    ``metadata()`` is the whole checkpoint on every rank (HF names, wire dtypes, full shapes).
    Rank 0 holds every tensor once assembled (``held_names()``: all) and yields each full tensor;
    another rank holds the tensors it has a part of, sends its parts and yields ``(name, None)``.
    ``bytes_sent`` / ``bytes_received``: this rank's figures of the last full iteration.
    """

    def __init__(self, source: HFWeightSource) -> None:
        if not source.lowest_replica_holds:
            raise ArgumentError("VLLMWeightSource moves each rank's slices to rank 0: build its HFWeightSource "
                                "with lowest_replica_holds=True, so that no rank sends bytes rank 0 holds")
        self.source = source
        distributed = should_broadcast() and dist.is_initialized()
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
        names = [m.name for m in source.metadata()]
        self._metadata = [ParamMeta(meta.name, meta.dtype, meta.shape)
                          for meta in (source.meta(name) for group in layerwise_groups(names) for name in group)]
        self._slices = source.slices()
        self._mine: dict[str, list[int]] = {}  # name -> this rank's slice indices, in slice order
        for index, held in enumerate(self._slices):
            self._mine.setdefault(held.name, []).append(index)
        # Rank 0: per name, each other rank's boxes, in rank and slice order (what it will receive).
        self._theirs: dict[str, list[tuple[int, Box]]] = {}
        if self.world > 1:
            boxes = [(held.name, held.box.offsets, held.box.sizes) for held in self._slices]
            every: list | None = [None] * self.world if self.rank == 0 else None
            dist.gather_object(boxes, every, dst=0)
            for rank, theirs in enumerate(every or ()):
                for name, offsets, sizes in theirs if rank else ():
                    self._theirs.setdefault(name, []).append((rank, Box(tuple(offsets), tuple(sizes))))
        self.bytes_sent = 0
        self.bytes_received = 0

    def metadata(self) -> list[ParamMeta]:
        return list(self._metadata)

    def held_names(self) -> list[str]:
        if self.rank == 0:
            return [meta.name for meta in self._metadata]
        return [meta.name for meta in self._metadata if meta.name in self._mine]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        """One update's pass, every rank at once: ``snapshot()`` of the source (collective), then
        the tensors of this rank's ``groups()``, in metadata order."""
        self.source.snapshot()
        self.bytes_sent = self.bytes_received = 0
        device = collective_device()
        for group in self.groups():
            for name in group:
                if self.rank == 0:
                    yield name, self._assemble(name, device)
                else:
                    for index in self._mine.get(name, ()):
                        data = _as_bytes(self.source.read(index)).to(device)
                        dist.send(data, dst=0)
                        self.bytes_sent += data.numel()
                    yield name, None

    def _assemble(self, name: str, device: torch.device) -> torch.Tensor:
        meta = self.source.meta(name)
        full = torch.empty(meta.shape, dtype=meta.dtype, device=device)
        for index in self._mine.get(name, ()):
            full[self._slices[index].box.slices()] = self.source.read(index)
        for rank, box in self._theirs.get(name, ()):
            data = torch.empty(box.numel * meta.dtype.itemsize, dtype=torch.uint8, device=device)
            dist.recv(data, src=rank)
            full[box.slices()] = data.view(meta.dtype).reshape(box.sizes)
            self.bytes_received += data.numel()
        return full


def _as_bytes(values: torch.Tensor) -> torch.Tensor:
    """``values`` as a flat byte tensor: any dtype travels (gloo has no float8), 0-d tensors too."""
    return values.contiguous().reshape(-1).view(torch.uint8)
