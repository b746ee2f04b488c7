"""Which elements of each Hugging Face checkpoint tensor this engine worker's ``load_weights`` reads.

A receiver that fills only part of a full-shape buffer before handing it to vLLM's
``model.load_weights([(name, buffer)])`` is exact only if the part it fills covers every element the
worker's loaders read: its TP rank's rows of ``q_proj``, its columns of ``o_proj``, its experts under
EP, the whole of a norm. vLLM spreads those rules over many loaders (fused ``qkv_proj`` /
``gate_up_proj`` / MoE ``w13``, padded vocabularies, replicated KV heads), so they are not restated
here: the worker's own loaders run on probe tensors, and what they read is recorded.

The probe runs ``model.load_weights`` once per checkpoint tensor, with a zero-filled probe of the
tensor's dtype and full shape, under a :class:`~torch.utils._python_dispatch.TorchDispatchMode`:

* view ops (``narrow``, ``slice``, ``select``, ``chunk``, ``t``...) read nothing; any other op that
  takes a view of the probe (``copy_``, ``cat``, ``index_select``, a cast) reads the elements that
  view covers, which are marked in a mask over the probe's storage;
* the module tensors are swapped, for the probe's duration, for meta tensors of the layout
  vLLM recorded at model construction (the checkpoint layout, as vLLM's layerwise reload restores
  it: the CPU backend packs dense weights away and leaves empty parameters), and every write into a
  tensor that existed before the probe (a module tensor that stayed real, such as a ``bias``) is
  skipped, so probing changes no weight;
* the mask is cut into disjoint boxes. A read the mask cannot hold (a view that reinterprets the
  probe's bytes as another dtype, a loader that fails on the probe) falls back to the whole tensor:
  correct, only more bytes, and logged.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO, _get_original_loader
from vllm.model_executor.model_loader.reload.meta import restore_layer_on_meta, to_meta_tensor
from vllm.model_executor.model_loader.reload.types import LayerReloadingInfo

from hp_dcp_hf.geometry.box import Box
from hp_dcp_hf.sync.source import TensorMeta

logger = logging.getLogger(__name__)

__all__ = ["consumed_boxes"]

# Ops that take a tensor only for its metadata (shape, dtype, device): they read no element.
_METADATA_ONLY = frozenset(
    {
        torch.ops.aten.empty_like.default,
        torch.ops.aten.zeros_like.default,
        torch.ops.aten.ones_like.default,
        torch.ops.aten.full_like.default,
        torch.ops.aten.new_empty.default,
        torch.ops.aten.new_empty_strided.default,
        torch.ops.aten.new_zeros.default,
        torch.ops.aten.new_ones.default,
        torch.ops.aten.new_full.default,
    }
)


class _Unexpressible(Exception):
    """The probe saw a read or a write it cannot account for; the tensor is read whole."""


def consumed_boxes(model: nn.Module, tensors: Sequence[TensorMeta]) -> dict[str, list[Box]]:
    """For every checkpoint tensor, the disjoint boxes (in its full index space) that this
    worker's ``model.load_weights`` reads; ``[]`` for a tensor it does not read at all (an expert
    another EP rank serves, a name the model skips).

    Runs inside an engine worker (``llm.collective_rpc``), on the model vLLM built. Leaves the
    model's parameters, buffers and their values exactly as they were. Not to be called while a
    layerwise reload is under way.
    """
    recorder = _ReadRecorder()
    found: dict[str, list[Box]] = {}
    with _checkpoint_layout(model), torch.no_grad():
        for meta in tensors:
            found[meta.name] = _probe(model, meta, recorder)
    return found


def _probe(model: nn.Module, meta: TensorMeta, recorder: _ReadRecorder) -> list[Box]:
    probe = torch.zeros(meta.shape, dtype=meta.dtype)
    recorder.start(probe)
    try:
        with recorder:
            model.load_weights([(meta.name, probe)])
    except Exception as error:  # noqa: BLE001 - any failure is answered by reading the tensor whole
        logger.warning("%s: the probe of load_weights cannot tell which elements it reads (%s: %s); "
                       "the whole tensor is sent", meta.name, type(error).__name__, error)
        return [Box.full(meta.shape)]
    finally:
        mask = recorder.stop()
    return _mask_boxes(mask.view(meta.shape))


class _ReadRecorder(TorchDispatchMode):
    """Marks the probe's elements each non-view op reads; skips writes into tensors that existed
    before the op stream began (the model's), keeping those a loader allocates itself."""

    def __init__(self) -> None:
        super().__init__()
        self._probe: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None
        self._created: set[int] = set()

    def start(self, probe: torch.Tensor) -> None:
        self._probe = probe
        self._mask = torch.zeros(probe.numel(), dtype=torch.bool)
        self._created = {_storage_ptr(probe)}

    def stop(self) -> torch.Tensor:
        mask = self._mask
        self._probe, self._mask, self._created = None, None, set()
        assert mask is not None
        return mask

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not _is_view(func) and func not in _METADATA_ONLY:
            for value in tree_flatten((args, kwargs))[0]:
                if self._is_probe(value):
                    self._mark(value)
        written = _written(func, args, kwargs)
        if any(self._is_foreign(t) for t in written):
            return _skipped(func, written)
        out = func(*args, **kwargs)
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor) and not value.is_meta:
                self._created.add(_storage_ptr(value))
        return out

    def _is_probe(self, value: object) -> bool:
        return (isinstance(value, torch.Tensor) and self._probe is not None and not value.is_meta
                and value.device == self._probe.device and _storage_ptr(value) == _storage_ptr(self._probe))

    def _is_foreign(self, tensor: torch.Tensor) -> bool:
        return not tensor.is_meta and tensor.numel() > 0 and _storage_ptr(tensor) not in self._created

    def _mark(self, view: torch.Tensor) -> None:
        assert self._probe is not None and self._mask is not None
        if view.dtype.itemsize != self._probe.dtype.itemsize:
            raise _Unexpressible(f"a view as {view.dtype} of a {self._probe.dtype} tensor")
        self._mask.as_strided(view.size(), view.stride(), view.storage_offset()).fill_(True)


def _storage_ptr(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _is_view(func: Any) -> bool:
    """An op whose output aliases an input without writing it: it moves no element."""
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def _written(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors ``func`` writes into: its in-place ``self``, its ``out=`` arguments."""
    written = []
    for index, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[index] if index < len(args) else kwargs.get(argument.name)
        written.extend(t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))
    return written


def _skipped(func: Any, written: list[torch.Tensor]) -> Any:
    """What ``func`` would have returned had it run: the tensors it writes into, unchanged."""
    returns = func._schema.returns
    if not returns:
        return None
    if len(returns) != len(written) or not all(r.alias_info is not None and r.alias_info.is_write for r in returns):
        raise _Unexpressible(f"{func} writes into a model tensor and returns something else")
    return written[0] if len(written) == 1 else tuple(written)


def _mask_boxes(mask: torch.Tensor) -> list[Box]:
    """Disjoint boxes covering exactly the ``True`` elements of ``mask``: runs of equal slices
    along dim 0, each run's slice cut the same way along the remaining dims."""
    if mask.ndim == 0:
        return [Box((), ())] if bool(mask) else []
    rows = mask.reshape(mask.shape[0], -1)
    changes = torch.ones(mask.shape[0], dtype=torch.bool)
    changes[1:] = (rows[1:] != rows[:-1]).any(dim=1)
    starts = [*changes.nonzero().flatten().tolist(), mask.shape[0]]
    boxes = []
    for lo, hi in zip(starts, starts[1:]):
        if not rows[lo].any():
            continue
        for inner in _mask_boxes(mask[lo]):
            boxes.append(Box((lo, *inner.offsets), (hi - lo, *inner.sizes)))
    return boxes


@contextmanager
def _checkpoint_layout(model: nn.Module) -> Iterator[None]:
    """Every module's tensors swapped for meta tensors of the layout vLLM recorded when it built
    the model (fresh copies: vLLM's own records stay untouched), then put back, the same objects.

    A module vLLM recorded nothing for keeps its tensors; writes into them are skipped by the
    recorder.
    """
    saved = [(module, dict(module._parameters), dict(module._buffers), set(module._non_persistent_buffers_set),
              dict(module.__dict__)) for module in model.modules()]
    try:
        for module in model.modules():
            recorded = LAYERWISE_INFO.get(module)
            if recorded is None or not any(recorded.restore_metadata):
                continue
            params, buffers = recorded.restore_metadata
            fresh = LayerReloadingInfo(
                restore_metadata=({n: _unwrapped(t) for n, t in params.items()},
                                  {n: _unwrapped(t) for n, t in buffers.items()}),
                restore_device=recorded.restore_device,
            )
            restore_layer_on_meta(module, fresh)
        yield
    finally:
        for module, parameters, buffers, non_persistent, attributes in saved:
            module._parameters.clear()
            module._parameters.update(parameters)
            module._buffers.clear()
            module._buffers.update(buffers)
            module._non_persistent_buffers_set.clear()
            module._non_persistent_buffers_set.update(non_persistent)
            for name in set(module.__dict__) - set(attributes):
                del module.__dict__[name]
            module.__dict__.update(attributes)


def _unwrapped(recorded: torch.Tensor) -> torch.Tensor:
    """A fresh meta copy of a tensor vLLM recorded, with its own loader: a layerwise reload leaves
    its deferring wrapper on the recorded tensor, and that wrapper loads nothing once the reload is
    over."""
    fresh = to_meta_tensor(recorded)
    if hasattr(fresh, "weight_loader"):  # an attribute, or vLLM parameters' property
        fresh.weight_loader = _get_original_loader(fresh)
    return fresh
