"""The trainer side of the ``hp_dcp_hf`` backend as vLLM's ``TrainerWeightTransferEngine``, for
trainers that drive weight transfers through vLLM's ``WeightTransferTrainerFactory``: a thin
adapter over :class:`~hp_dcp_hf.sync.trainer.TrainerWeightSync` (which needs no vLLM)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch.distributed as dist
from torch import nn
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
)

from hp_dcp_hf.errors import ArgumentError
from hp_dcp_hf.integrations.vllm.plugin import BACKEND
from hp_dcp_hf.sync.sender import DEFAULT_BUCKET_BYTES
from hp_dcp_hf.sync.source import HFWeightSource
from hp_dcp_hf.sync.trainer import TrainerWeightSync


@dataclass
class HFSyncTrainerInitInfo(TrainerInitInfo):
    """:class:`~hp_dcp_hf.sync.trainer.TrainerWeightSync`'s settings (``rank``: this trainer
    process's rank, as vLLM asks for it)."""

    backend: ClassVar[str] = BACKEND
    host: str = "127.0.0.1"
    timeout_s: float = 60.0
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    delta: bool = False
    verify: bool = False


class HFSyncTrainerEngine(TrainerWeightTransferEngine[HFSyncTrainerInitInfo]):
    """vLLM's trainer engine for the ``hp_dcp_hf`` backend. ``source``: an
    :class:`~hp_dcp_hf.sync.source.HFWeightSource`, or the model to build one from."""

    init_info_cls = HFSyncTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, sync: TrainerWeightSync) -> None:
        super().__init__(client=client, source=None, is_sender=sync.is_sender)
        self.sync = sync

    @classmethod
    def trainer_init(cls, init_info: HFSyncTrainerInitInfo, *, client: VLLMWeightSyncClient,
                     source: Any = None) -> HFSyncTrainerEngine:
        if dist.is_initialized() and init_info.rank != dist.get_rank():
            raise ArgumentError(f"HFSyncTrainerInitInfo(rank={init_info.rank}) on default-group rank {dist.get_rank()}: "
                                "the hp_dcp_hf backend runs on the trainer's default process group")
        if isinstance(source, nn.Module):
            source = HFWeightSource(source)
        if not isinstance(source, HFWeightSource):
            raise ArgumentError("the hp_dcp_hf backend sends an HFWeightSource (or the model to build one from), "
                                f"not {type(source).__name__}")
        sync = TrainerWeightSync(source, client, host=init_info.host, timeout_s=init_info.timeout_s,
                                 bucket_bytes=init_info.bucket_bytes, delta=init_info.delta,
                                 verify=init_info.verify)
        return cls(client=client, sync=sync)

    def send_weights(self) -> None:
        self.sync.send_weights()

    def shutdown(self) -> None:
        self.sync.shutdown()
