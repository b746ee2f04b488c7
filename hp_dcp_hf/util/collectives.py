"""One rank's outcome shared with all: rank 0's bytes, or the first failing rank's error.

Used for checkpoint metadata: on N ranks, N readers of every header is N times the requests (and,
on object stores, the bill) for the same answer. The bytes travel as a uint8 tensor in two
broadcasts on the default group (length, then payload); nothing is pickled. When rank 0 fails, it
broadcasts the error instead, so the other ranks raise too rather than wait forever. After a load,
:func:`agree_on_failure` makes every rank raise when any rank failed, for the price of one
all-reduce of one integer when none did.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import torch
import torch.distributed as dist

from hp_dcp_hf import errors
from hp_dcp_hf.errors import HPDCPHFError, StorageReadError

_OK, _ERROR = 0, 1


def should_broadcast() -> bool:
    """True when a default process group of more than one rank is up."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def collective_device() -> torch.device:
    # NCCL only moves CUDA tensors; gloo (and mixed "cpu:gloo,cuda:nccl" groups) take CPU ones.
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _encode_error(error: BaseException) -> bytes:
    if isinstance(error, HPDCPHFError):
        fields = {"type": type(error).__name__, "reason": error.reason, "file": error.file, "key": error.key}
    else:
        fields = {
            "type": StorageReadError.__name__,
            "reason": f"{type(error).__name__}: {error}",
            "file": None,
            "key": None,
        }
    return json.dumps(fields).encode()


def _decode_error(raw: bytes, rank: int = 0) -> HPDCPHFError:
    fields = json.loads(raw)
    cls = getattr(errors, fields["type"], StorageReadError)
    error = cls(f"on rank {rank}: {fields['reason']}", file=fields["file"], key=fields["key"])
    error.rank = rank
    return error


def _from_rank(error: BaseException, rank: int) -> BaseException:
    """``error``, marked as the one every rank raises: ``error.rank`` is the rank that failed."""
    error.rank = rank  # type: ignore[attr-defined]
    return error


def _broadcast(payload: bytes | None, src: int = 0) -> bytes:
    device = collective_device()
    length = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64, device=device)
    dist.broadcast(length, src=src)
    if payload is not None:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    else:
        data = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    dist.broadcast(data, src=src)
    return data.cpu().numpy().tobytes()


def agree_on_failure(error: BaseException | None) -> BaseException | None:
    """Every rank learns whether any rank failed: the error this rank must raise, or None.

    Every rank raises the first failing rank's error (that rank its own object, the others the
    same :mod:`hp_dcp_hf.errors` type rebuilt from JSON), so all ranks report one cause, as DCP's
    gathered failures do; on every rank ``error.rank`` is the failing rank.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    first = torch.tensor([rank if error is not None else world], dtype=torch.int64, device=collective_device())
    dist.all_reduce(first, op=dist.ReduceOp.MIN)
    src = int(first.item())
    if src == world:
        return None
    raw = _broadcast(_encode_error(error) if rank == src else None, src=src)
    return _from_rank(error, src) if rank == src else _decode_error(raw, src)


def share_from_rank0(produce: Callable[[], bytes]) -> bytes:
    """``produce()`` run on rank 0 alone and its bytes returned on every rank; errors raise on all."""
    if dist.get_rank() != 0:
        message = _broadcast(None)
        if message[0] == _ERROR:
            raise _decode_error(message[1:])
        return message[1:]
    try:
        payload = produce()
    except Exception as error:
        _broadcast(bytes([_ERROR]) + _encode_error(error))
        _from_rank(error, 0)
        raise
    _broadcast(bytes([_OK]) + payload)
    return payload


def all_gather_bytes(payload: bytes) -> list[bytes]:
    """Every rank's ``payload``, in rank order, on every rank (two all-gathers: lengths, then the
    bytes padded to the longest); nothing is pickled."""
    device, world = collective_device(), dist.get_world_size()
    length = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(length) for _ in range(world)]
    dist.all_gather(lengths, length)
    longest = max(int(n.item()) for n in lengths)
    data = torch.zeros(longest, dtype=torch.uint8, device=device)
    data[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else data[:0]
    gathered = [torch.empty_like(data) for _ in range(world)]
    dist.all_gather(gathered, data)
    return [g.cpu().numpy().tobytes()[: int(n.item())] for g, n in zip(gathered, lengths)]
