"""Saving an adapter: :func:`save_peft_adapter` writes each rank's shards into the one file peft
writes, published with ``adapter_config.json`` by :class:`AdapterStorageWriter`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from torch import nn
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan

from hp_dcp_hf.errors import ArgumentError, PlanningError
from hp_dcp_hf.integrations.peft.config import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    adapter_config_text,
    adapter_file,
)
from hp_dcp_hf.integrations.peft.names import AdapterTensors, adapter_keys
from hp_dcp_hf.save.api import save_hf_checkpoint
from hp_dcp_hf.save.planner import HFSavePlanner
from hp_dcp_hf.storage.format.journal import Journal, Step
from hp_dcp_hf.storage.write.writer import HFStorageWriter

_ONE_FILE = 2**62  # max_shard_size: peft writes every adapter into one file


class AdapterStorageWriter(HFStorageWriter):
    """:class:`~hp_dcp_hf.storage.HFStorageWriter` laying out the one file ``peft`` writes,
    ``adapter_model.safetensors`` (no index), and publishing it with ``adapter_config.json``
    through the same journaled switch as every save (:mod:`hp_dcp_hf.storage.format.journal`): the
    weights file is the entry, committed last; when the config changes, the old weights file is
    removed before the new config is written, so no reader pairs a new config with old weights."""

    def __init__(self, path: str | os.PathLike, *, config_text: str, **options: Any) -> None:
        options.setdefault("max_shard_size", _ONE_FILE)
        super().__init__(path, **options)
        self.config_text = config_text

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        plan = super().prepare_local_plan(plan)
        if self.index is not None or len(self.files) != 1:
            raise PlanningError(f"an adapter is one file, the layout has {len(self.files)}", file=self.path)
        file = self.files[0]
        self.files = [dataclasses.replace(file, name=ADAPTER_WEIGHTS, tensors=tuple(
            dataclasses.replace(t, file=ADAPTER_WEIGHTS) for t in file.tensors))]
        self.tensors = {t.key: t for t in self.files[0].tensors}
        self.extra_files = {ADAPTER_CONFIG: self.config_text}
        return plan

    def finish(self, metadata: Metadata, results: list[list[Any]]) -> None:
        """Coordinator, once every rank wrote: publish the adapter (one journaled switch)."""
        self.check_all_written(results)
        assert self.staged is not None
        staged, destination = self.staged, self.destination
        destination.check_staged(staged, self.files)
        existing = destination.list_names()
        texts = destination.published_texts(self.extra_files, existing)
        changed = {name: text for name, text in sorted(self.extra_files.items()) if texts.get(name) != text}
        steps = [Step("remove", ADAPTER_WEIGHTS)] if changed and ADAPTER_WEIGHTS in existing else []
        steps += [Step("write", name, text) for name, text in changed.items()]
        steps.append(Step("commit", staged.names[ADAPTER_WEIGHTS]))
        destination.carry_out(staged, Journal(staged.save_id, tuple(steps), staged.published_handles()))
        self.staged = None

    def saved(self) -> bool:
        return self.save_id is not None and self.destination.save_id_of(ADAPTER_WEIGHTS) == self.save_id


def save_peft_adapter(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    adapter_name: str = "default",
    save_embedding_layers: bool | str = "auto",
    writer: AdapterStorageWriter | None = None,
    planner: HFSavePlanner | None = None,
    **storage_options: Any,
) -> None:
    """Write adapter ``adapter_name`` of the (sharded) PEFT model ``model`` as ``peft``'s
    ``save_pretrained`` writes it for the unsharded adapter: ``adapter_model.safetensors`` (the
    same keys, dtypes and bits) and ``adapter_config.json``, into ``path`` (or ``path/<adapter_name>``
    for another adapter than ``"default"``, as peft does); every rank calls it.

    Every rank writes the bytes of its own shards at their final offsets (a replicated tensor by one
    of its replicas), nothing is gathered, and the files appear together only once every rank has
    written (:class:`AdapterStorageWriter`). The safetensors header carries the save's id next to
    ``"format": "pt"``; peft's README.md model card is not written.
    """
    names = adapter_keys(model, adapter_name, save_embedding_layers=save_embedding_layers)
    if not names:
        raise ArgumentError(f"adapter {adapter_name!r} of the model has no tensors to save")
    directory = os.fspath(path) if adapter_name == "default" else adapter_file(os.fspath(path), adapter_name)
    view = AdapterTensors(model, names)
    planner = planner or HFSavePlanner(view, weights_mapping=[])
    writer = writer or AdapterStorageWriter(directory, config_text=adapter_config_text(model, adapter_name),
                                            **storage_options)
    save_hf_checkpoint(view, directory, weights_mapping=[], writer=writer, planner=planner)
