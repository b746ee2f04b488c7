"""TrainerWeightSync: the trainer's whole side of a weight update, driven through an inference
engine's control plane, with no import of the engine's code.

The control plane is any object with vLLM's four weight-sync methods (its ``VLLMWeightSyncClient``
protocol is structural): :class:`~hp_dcp_hf.sync.client.HTTPEngineClient` for a ``vllm serve``,
vLLM's own clients, or an ``LLM`` in the same process. A trainer's environment need not have vLLM
installed (trainers and engines often pin different transformers releases). Every trainer rank
builds one and calls :meth:`send_weights`; rank 0 alone talks to the engine, every rank sends its
own bytes straight to the engine workers that consume them. Nothing is gathered.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Protocol

import torch.distributed as dist

from hp_dcp_hf.errors import HPDCPHFError, SyncError
from hp_dcp_hf.sync.sender import DEFAULT_BUCKET_BYTES, UpdateStats, WeightSender
from hp_dcp_hf.sync.source import HFWeightSource
from hp_dcp_hf.sync.wire import dtype_name
from hp_dcp_hf.util.collectives import agree_on_failure, should_broadcast

logger = logging.getLogger(__name__)


class EngineClient(Protocol):
    """vLLM's ``VLLMWeightSyncClient``: the engine's weight-sync control plane."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...

    def start_weight_update(self) -> None: ...

    def update_weights(self, update_info: dict[str, Any]) -> None: ...

    def finish_weight_update(self, weight_version: str | None = None) -> None: ...


class TrainerWeightSync:
    """One trainer rank's end of the ``hp_dcp_hf`` weight-transfer backend; every rank builds it
    (collective: the ranks exchange their addresses and rank 0 initializes the engine's side).

    Args:
        source: the weights to send (:class:`~hp_dcp_hf.sync.source.HFWeightSource`).
        client: the engine's control plane (used on rank 0 only).
        host: the address engine workers reach this rank at.
        timeout_s: how long any peer may stay silent before an update fails (SyncError).
        bucket_bytes: the most tensor bytes per frame (the extra memory per worker served).
        delta: send only the pieces whose bytes changed since the engine's last update.
        verify: the engine checks every received box against the trainer's digest of it.
    """

    def __init__(self, source: HFWeightSource, client: EngineClient, *, host: str = "127.0.0.1",
                 timeout_s: float = 60.0, bucket_bytes: int = DEFAULT_BUCKET_BYTES, delta: bool = False,
                 verify: bool = False) -> None:
        self.client = client
        self.sender = WeightSender(source, host=host, timeout_s=timeout_s, bucket_bytes=bucket_bytes, delta=delta)
        self.is_sender = self.sender.rank == 0
        self.update = 0
        self.stats: UpdateStats | None = None
        error = None
        if self.is_sender:
            try:  # the workers connect to every rank during this call; their hellos wait in the sockets
                client.init_weight_transfer_engine({
                    "trainers": self.sender.addresses,
                    "tensors": [[m.name, dtype_name(m.dtype), list(m.shape)] for m in source.metadata()],
                    "timeout_s": timeout_s, "verify": verify})
            except Exception as exc:
                error = _engine_error("init_weight_transfer_engine", exc)
        _raise_on_all(error)
        self.sender.accept()

    def send_weights(self, weight_version: str | None = None) -> UpdateStats:
        """One update, on every rank: rank 0 starts it, asks the engine to receive it, finishes it
        and resets the engine's prefix cache (when the client has ``reset_prefix_cache``, as
        :class:`~hp_dcp_hf.sync.client.HTTPEngineClient` and vLLM's ``LLM`` do), while every rank
        sends its bytes. Returns this rank's figures."""
        self.update += 1
        start = time.perf_counter()
        control: list[BaseException] = []
        thread = None
        error: BaseException | None = None
        try:
            if self.is_sender:
                self.client.start_weight_update()
                thread = threading.Thread(target=self._engine_receives, args=(control,), daemon=True)
                thread.start()
            self.stats = self.sender.send(self.update)
        except Exception as exc:
            error = exc if isinstance(exc, HPDCPHFError) else _engine_error("start_weight_update", exc)
        finally:
            if thread is not None:
                thread.join()
        error = error or (control[0] if control else None)
        if error is None and self.is_sender:
            try:
                self.client.finish_weight_update(weight_version)
                reset = getattr(self.client, "reset_prefix_cache", None)
                if reset is not None:  # KV the old weights computed must not answer new requests
                    reset()
            except Exception as exc:
                error = _engine_error("finish_weight_update", exc)
        _raise_on_all(error)
        assert self.stats is not None
        self.stats.seconds = time.perf_counter() - start
        if self.is_sender:
            logger.info("weight update %d: rank 0 sent %d bytes (%d pieces, %d unchanged) to %d engine workers "
                        "in %.3f s", self.update, self.stats.bytes_sent, self.stats.pieces_sent,
                        self.stats.pieces_unchanged, len(self.stats.bytes_per_worker), self.stats.seconds)
        return self.stats

    def _engine_receives(self, errors: list[BaseException]) -> None:
        try:
            self.client.update_weights({"update": self.update})
        except Exception as exc:
            errors.append(_engine_error("update_weights", exc))

    def shutdown(self) -> None:
        self.sender.close()


def _engine_error(call: str, error: Exception) -> SyncError:
    return SyncError(f"the engine's {call} failed: {type(error).__name__}: {error}")


def _raise_on_all(error: BaseException | None) -> None:
    """Every trainer rank raises when one did (rank 0's control-plane failures reach the others)."""
    if should_broadcast() and dist.is_initialized():
        error = agree_on_failure(error)
    if error is not None:
        raise error
