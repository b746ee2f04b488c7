"""The worker side of the ``hp_dcp_hf`` backend: a vLLM ``WeightTransferEngine`` that receives the
checkpoint-tensor boxes its worker consumes from every trainer rank and loads them through vLLM's
own ``load_weights``, inside vLLM's layerwise reload (:mod:`~hp_dcp_hf.integrations.vllm.reload`, which
also re-runs what that reload skips on CPU). The engine's prefix cache must be reset after an update
(``LLM.reset_prefix_cache()``, ``POST /reset_prefix_cache``): it lives in the scheduler, not here.

An update is received whole by every worker before any of them loads a byte
(:class:`HFSyncUpdateInfo`: receive, then commit or drop): a trainer rank or a worker that fails
mid-update leaves every worker of the engine serving its previous weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.logger import init_logger

from hp_dcp_hf.errors import HPDCPHFError, SyncError
from hp_dcp_hf.geometry.box import Box
from hp_dcp_hf.integrations.vllm.reload import begin_update, finish_update
from hp_dcp_hf.sync.receiver import WeightReceiver
from hp_dcp_hf.sync.source import TensorMeta
from hp_dcp_hf.sync.wire import tensors_from_json

logger = init_logger(__name__)


@dataclass
class HFSyncInitInfo(WeightTransferInitInfo):
    """What the trainer's rank 0 sends once (``init_weight_transfer_engine``): where the trainer
    ranks listen and the checkpoint tensors they send (``[name, dtype, shape]``)."""

    trainers: list[list[Any]] = field(default_factory=list)
    tensors: list[list[Any]] = field(default_factory=list)
    timeout_s: float = 60.0
    verify: bool = False


@dataclass
class HFSyncUpdateInfo(WeightTransferUpdateInfo):
    """An update's two ``update_weights`` calls: ``{"update": n}`` receives it (all of it, or the
    failure is kept for the trainer, which hears it from this worker directly); ``{"update": n,
    "commit": ok}`` then loads it (``True``, once every worker of the engine received its part) or
    drops it, on every worker alike, so that an engine is never half updated."""

    update: int = 0
    commit: bool | None = None


def worker_needs(model: torch.nn.Module, tensors: list[TensorMeta], workers: int) -> dict[str, list[Box]]:
    """The boxes of each checkpoint tensor this worker's ``load_weights`` reads (the only worker of
    an engine reads them all)."""
    if workers == 1:
        return {meta.name: [Box.full(meta.shape)] for meta in tensors}
    from hp_dcp_hf.integrations.vllm.needs import consumed_boxes

    return consumed_boxes(model, tensors)


class HFSyncEngine(WeightTransferEngine[HFSyncInitInfo, HFSyncUpdateInfo]):
    """vLLM worker engine of the ``hp_dcp_hf`` backend (see the module docstring)."""

    init_info_cls = HFSyncInitInfo
    update_info_cls = HFSyncUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.receiver: WeightReceiver | None = None
        self.last_failure: BaseException | None = None  # of the last update's transfer, if it failed
        self._received: dict[str, torch.Tensor] | None = None
        self._loaded = False

    def init_transfer_engine(self, init_info: HFSyncInitInfo) -> None:
        from vllm.distributed.parallel_state import get_world_group

        tensors = tensors_from_json(init_info.tensors)
        group = get_world_group()
        needs = worker_needs(self.model, tensors, group.world_size)
        self.shutdown()  # a transfer initialized before: its connections go
        self.receiver = WeightReceiver([tuple(a) for a in init_info.trainers], tensors, needs,
                                       worker=group.rank, workers=group.world_size,
                                       timeout_s=init_info.timeout_s, verify=init_info.verify)
        logger.info("hp_dcp_hf weight sync: worker %d of %d consumes %d tensors, %d bytes", group.rank,
                    group.world_size, len(self.receiver.needs), self.receiver.needed_bytes)

    def start_weight_update(self) -> None:
        self._received, self._loaded, self.last_failure = None, False, None

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class synchronizes an accelerator afterwards; this engine's loads are synchronous.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: HFSyncUpdateInfo) -> None:
        if update_info.commit is None:
            self._receive(update_info.update)
        elif update_info.commit:
            self._load(update_info.update)
        else:
            self._received = None

    def _receive(self, update: int) -> None:
        if self.receiver is None:
            raise SyncError("the hp_dcp_hf weight transfer is not initialized (or its last update failed): call "
                            "init_weight_transfer_engine")
        try:
            self._received = self.receiver.receive(update)
        except HPDCPHFError as error:  # the trainer ranks have this worker's verdict: it commits nobody
            self.last_failure, self.receiver = error, None
            logger.warning("hp_dcp_hf weight sync: update %d failed on this worker, the engine keeps its weights: "
                           "%s", update, error)
            return
        stats = self.receiver.stats
        logger.info("hp_dcp_hf weight sync: update %d: %d bytes from %d trainer ranks in %.3f s", update,
                    stats.bytes_received, len(stats.bytes_per_trainer), stats.seconds)

    def _load(self, update: int) -> None:
        if self._received is None:
            raise SyncError(f"update {update} is committed, but this worker did not receive it: {self.last_failure}")
        begin_update(self.model)
        self._loaded = True
        self.model.load_weights(iter(self._received.items()))
        self._received = None

    def finish_weight_update(self) -> None:
        if self._loaded:
            finish_update(self.model, self.model_config)
            self._loaded = False

    def shutdown(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None
