"""TrainerWeightSync: the trainer's whole side of a weight update, driven through an inference
engine's control plane, with no import of the engine's code.

The control plane is any object with vLLM's four weight-sync methods (its ``VLLMWeightSyncClient``
protocol is structural): :class:`~hp_dcp_hf.sync.client.HTTPEngineClient` for a ``vllm serve``,
vLLM's own clients (``HTTPVLLMWeightSyncClient``, ``RayVLLMWeightSyncClient``). A trainer's environment need not have vLLM
installed (trainers and engines often pin different transformers releases). Every trainer rank
builds one and calls :meth:`send_weights`; rank 0 alone talks to the engine, every rank sends its
own bytes straight to the engine workers that consume them. Nothing is gathered.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Protocol

from hp_dcp_hf.errors import HPDCPHFError, SyncError
from hp_dcp_hf.sync.sender import DEFAULT_BUCKET_BYTES, UpdateStats, WeightSender
from hp_dcp_hf.sync.source import HFWeightSource
from hp_dcp_hf.sync.wire import tensors_json
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
        accepted: list[BaseException] = []
        # Every rank accepts while rank 0 initializes the engine: a worker's hello (its needs) may not
        # fit in a socket buffer, and would wait for an accept that waits for the init to return.
        accepting = threading.Thread(target=self._accept, args=(accepted,), daemon=True)
        accepting.start()
        error = None
        if self.is_sender:
            try:
                client.init_weight_transfer_engine({"trainers": self.sender.addresses,
                                                    "tensors": tensors_json(source.metadata()),
                                                    "timeout_s": timeout_s, "verify": verify})
            except Exception as exc:
                error = _engine_error("init_weight_transfer_engine", exc)
        accepting.join()
        _raise_on_all(error or (accepted[0] if accepted else None))

    def _accept(self, errors: list[BaseException]) -> None:
        try:
            self.sender.accept()
        except BaseException as error:
            errors.append(error)

    def send_weights(self, weight_version: str | None = None) -> UpdateStats:
        """One update, on every rank. Rank 0 starts it on the engine and asks the engine's workers to
        receive it while every rank sends its bytes; once every rank has every worker's verdict, rank
        0 has the engine load it on all workers (or drop it on all, after a failure anywhere),
        finishes it and resets the engine's prefix cache (when the client has
        ``reset_prefix_cache``, as :class:`~hp_dcp_hf.sync.client.HTTPEngineClient` does). Returns this rank's figures; raises on every rank when any part failed, and
        then the engine serves its previous weights."""
        self.update += 1
        start = time.perf_counter()
        started = None
        if self.is_sender:
            try:
                self.client.start_weight_update()
            except Exception as exc:
                started = _engine_error("start_weight_update", exc)
        failure = _agree(started)  # also lines the ranks up: no rank's deadline runs while rank 0 is late
        if failure is not None:
            if self.is_sender and started is None:  # the engine started the update: leave it finished
                self._call("finish_weight_update", None, [])
            raise failure
        receiving: list[BaseException] = []
        thread = None
        if self.is_sender:
            thread = threading.Thread(target=self._call, args=("update_weights", {"update": self.update}, receiving),
                                      daemon=True)
            thread.start()
        transfer: BaseException | None = None
        try:
            self.stats = self.sender.send(self.update)
        except Exception as exc:
            transfer = exc if isinstance(exc, HPDCPHFError) else SyncError(
                f"trainer rank {self.sender.rank}: {type(exc).__name__}: {exc}")
        if thread is not None:
            thread.join()
        outcome = _agree(transfer or (receiving[0] if receiving else None))
        finished: list[BaseException] = []
        if self.is_sender:  # the engine is never left mid-update: load on all workers or on none, then finish
            self._call("update_weights", {"update": self.update, "commit": outcome is None}, finished)
            self._call("finish_weight_update", weight_version, finished)
            if outcome is None and not finished and hasattr(self.client, "reset_prefix_cache"):
                self._call("reset_prefix_cache", None, finished)  # KV of the old weights must not answer
        failure = outcome or _agree(finished[0] if finished else None)
        if failure is not None:
            raise failure
        assert self.stats is not None
        self.stats.seconds = time.perf_counter() - start
        if self.is_sender:
            logger.info("weight update %d: rank 0 sent %d bytes (%d pieces, %d unchanged) to %d engine workers "
                        "in %.3f s", self.update, self.stats.bytes_sent, self.stats.pieces_sent,
                        self.stats.pieces_unchanged, len(self.stats.bytes_per_worker), self.stats.seconds)
        return self.stats

    def _call(self, method: str, argument: Any, errors: list[BaseException]) -> None:
        """``client.method(argument)`` (no argument when None), its failure kept in ``errors``."""
        try:
            getattr(self.client, method)(*(() if argument is None else (argument,)))
        except Exception as exc:
            errors.append(_engine_error(method, exc))

    def shutdown(self) -> None:
        self.sender.close()


def _engine_error(call: str, error: Exception) -> SyncError:
    return SyncError(f"the engine's {call} failed: {type(error).__name__}: {error}")


def _agree(error: BaseException | None) -> BaseException | None:
    """The first failing rank's error on every rank (rank 0's control-plane failures reach the
    others), or None. A rank that is gone breaks the agreement itself: then this rank's own error,
    or a SyncError saying so."""
    if not should_broadcast():
        return error
    try:
        return agree_on_failure(error)
    except Exception as exc:
        return error or SyncError(f"the trainer ranks cannot agree on the update (a rank is gone?): "
                                  f"{type(exc).__name__}: {exc}")


def _raise_on_all(error: BaseException | None) -> None:
    error = _agree(error)
    if error is not None:
        raise error
