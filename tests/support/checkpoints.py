"""Saved checkpoints compared file by file, as the save tests and the CLI's save tests need."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from hp_dcp_hf.storage.format.journal import INDEX_FILE, SAVE_ID_KEY
from tests.support.families import (
    family_model_class,
    tiny_family_config,
)


def save_id_of(file: Path) -> str | None:
    """The save id in a safetensors file's ``__metadata__`` (None for save_pretrained's files)."""
    with safe_open(file, "pt") as handle:
        return (handle.metadata() or {}).get(SAVE_ID_KEY)


SHARD = "20KB"


def anonymized(files: dict[str, bytes]) -> dict[str, bytes]:
    """Files' bytes with every save id zeroed: two saves of the same model compare equal."""
    pattern = re.compile(rb'("' + SAVE_ID_KEY.encode() + rb'": ?")[0-9a-f]{32}"')
    return {name: pattern.sub(rb'\g<1>' + b"0" * 32 + b'"', data) for name, data in files.items()}


def assert_same_checkpoint(ours: Path, reference: Path) -> None:
    """Same files; in each safetensors file the same keys, dtypes, shapes and bits; same index and
    config. Ours carry one save id, in every file's header and in the index (its only difference)."""
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in reference.iterdir())
    ids = set()
    for file in reference.glob("*.safetensors"):
        expected, actual = load_file(file), load_file(ours / file.name)
        assert sorted(actual) == sorted(expected), file.name
        for key, value in expected.items():
            assert actual[key].dtype == value.dtype and torch.equal(actual[key], value), key
        ids.add(save_id_of(ours / file.name))
    assert len(ids) == 1 and re.fullmatch("[0-9a-f]{32}", ids.pop() or ""), ids
    for name in ("model.safetensors.index.json", "config.json", "generation_config.json"):
        if (reference / name).exists():
            actual = json.loads((ours / name).read_text())
            if name == INDEX_FILE:
                assert actual["metadata"].pop(SAVE_ID_KEY) == save_id_of(ours / next(iter(actual["weight_map"].values())))
            assert actual == json.loads((reference / name).read_text()), name


def big_llama(seed: int = 0):
    """A llama of about 21 MB in float32 (vocab 60001, untied): files over S3's 5 MiB part minimum."""
    torch.manual_seed(seed)
    config = tiny_family_config("llama", vocab_size=60001, tie_word_embeddings=False)
    return family_model_class("llama")._from_config(config, dtype=torch.float32).eval()


def local_files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir()}
