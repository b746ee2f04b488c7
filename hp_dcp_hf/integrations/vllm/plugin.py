"""The ``vllm.general_plugins`` entry point: vLLM calls :func:`register` in every process it starts
(engine core, workers, the API server), before any model loads."""

from __future__ import annotations

BACKEND = "hp_dcp_hf"


def register() -> None:
    """Register the ``hp_dcp_hf`` weight-transfer backend, worker and trainer side, by module path
    (imported only when a weight transfer uses it). Idempotent: vLLM may call it more than once."""
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, "hp_dcp_hf.integrations.vllm.engine", "HFSyncEngine")
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, "hp_dcp_hf.integrations.vllm.trainer",
                                                     "HFSyncTrainerEngine")
