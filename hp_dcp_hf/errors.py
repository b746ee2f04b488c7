"""Typed errors of hp-dcp-hf.

Every error names what it is about (``file``, ``key``) and why (``reason``), so a user reading one
line knows which checkpoint file or tensor to look at. All are plain ``Exception`` subclasses;
DCP wraps errors raised inside ``dcp.load`` in ``CheckpointException``, which
:func:`hp_dcp_hf.load_hf_checkpoint` unwraps again.
"""

from __future__ import annotations


class HPDCPHFError(Exception):
    """Base class of every error this package raises on purpose."""

    def __init__(self, reason: str, *, file: str | None = None, key: str | None = None) -> None:
        self.reason = reason
        self.file = file
        self.key = key
        where = ", ".join(part for part in (
            f"file {file!r}" if file is not None else "",
            f"key {key!r}" if key is not None else "",
        ) if part)
        super().__init__(f"{where}: {reason}" if where else reason)

    def __reduce__(self):
        # Errors cross process boundaries (DCP gathers them to rank 0): keep the keyword fields.
        return (_rebuild, (type(self), self.reason, self.file, self.key))


def _rebuild(cls: type[HPDCPHFError], reason: str, file: str | None, key: str | None) -> HPDCPHFError:
    return cls(reason, file=file, key=key)


class ArgumentError(HPDCPHFError, ValueError):
    """An argument of the API or the CLI is invalid (a dtype name, an option's value). Also a
    ``ValueError``, as Python's own checks of arguments are."""


class MeshSpecError(ArgumentError):
    """A mesh spec (``"dp=2,tp=2"``) that is malformed, names unknown dims or does not fit the ranks."""


class CheckpointNotFoundError(HPDCPHFError):
    """The path names no checkpoint, or a file the index names does not exist."""


class CheckpointFormatError(HPDCPHFError):
    """A safetensors header or an index file breaks the format's rules."""


class MixedCheckpointError(CheckpointFormatError):
    """The files of a checkpoint come from different saves (a shard copied in from another save)."""


class InterruptedSaveError(HPDCPHFError):
    """A save into the path died while it published: ``hp-dcp-hf repair`` or the next save completes it."""


class UnsupportedDtypeError(CheckpointFormatError):
    """A tensor's dtype is unknown to safetensors or has no torch equivalent."""


class UnsafeCheckpointError(HPDCPHFError):
    """A pickle-based checkpoint (``.bin``, ``.pt``): refused, never unpickled."""


class StorageReadError(HPDCPHFError):
    """Reading bytes failed: I/O error, short read, or a file changed since its header was read."""


class StorageWriteError(HPDCPHFError):
    """Writing a checkpoint failed (on any rank): nothing was published at the final names."""


class LayoutError(HPDCPHFError):
    """A parameter's placements cannot be loaded into (``Partial``, unknown placement types)."""


class MappingError(HPDCPHFError):
    """A conversion mapping cannot be composed: shapes disagree, sources are absent, ops fail."""


class PlanningError(HPDCPHFError):
    """The load plan is inconsistent with the model: uncovered or doubly covered elements, bad dtypes."""


class MissingKeysError(PlanningError):
    """``strict=True`` and some model tensors are not produced by the checkpoint."""


class UnexpectedKeysError(PlanningError):
    """``unexpected="raise"`` and the checkpoint holds tensors no model tensor is made from."""


class ArchitectureMismatchError(HPDCPHFError):
    """The checkpoint's ``config.json`` names another model type than the model's (a Mixtral
    checkpoint into a Llama model): named instead of reported as missing keys."""


class QuantizationError(CheckpointFormatError):
    """A quantized checkpoint this loader cannot read as values: unknown ``quant_method``, a weight
    without its scales, a scale grid that does not fit its weight."""


class PipelineError(HPDCPHFError):
    """A stage of :func:`from_pretrained` cannot run: no config, no model class, a bad transform."""


class SyncError(HPDCPHFError):
    """A weight update between a trainer and an inference engine failed: a peer died or timed out, a
    message broke the protocol, the two sides disagree on the tensors (``key`` names the tensor)."""


class VerificationError(HPDCPHFError):
    """A model's weights differ from the checkpoint's or the trainer's bytes (``key`` names the
    tensor, the reason the slice)."""
