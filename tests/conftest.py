"""Shared test setup: quiet offline environment, one thread, tiny real checkpoints built once.

Fixtures (all session-scoped; checkpoints are written once into a session tmp dir):

* ``tiny_checkpoints``: a :class:`CheckpointFactory`. ``tiny_checkpoints("mixtral", torch.float32,
  max_shard_size=None, num_local_experts=8)`` -> :class:`TinyCheckpoint` (cached per arguments).
* ``ckpt_dtype``: parametrized over ``bf16`` and ``fp32`` (a ``torch.dtype``).
* ``tiny_model_type``: parametrized over every model type of ``tests.support.models.TINY_MODELS``.
* ``tiny_checkpoint``: the sharded checkpoint of ``tiny_model_type`` x ``ckpt_dtype``.
* ``llama_checkpoint``, ``mixtral_checkpoint``, ``qwen3_moe_checkpoint``, ``gte_checkpoint``,
  ``sarvam_moe_checkpoint``, ``qwen3_vl_moe_checkpoint``, ``gradium_phonon_tts_checkpoint``: one
  model type, bf16, sharded (``max_shard_size="20KB"``, several files + index).

``TinyCheckpoint.reference()`` is the oracle (single-process ``from_pretrained`` state dict);
``TinyCheckpoint.build_model()`` rebuilds the exact model that wrote the files.

Environment: ``HF_HUB_OFFLINE=1`` (no test may reach the Hub; a test that talks to a local fake Hub
server must lift it itself, e.g. ``monkeypatch.setattr(huggingface_hub.constants,
"HF_HUB_OFFLINE", False)``), ``TRANSFORMERS_VERBOSITY=error``, progress bars off, torch threads 1
(``OMP_NUM_THREADS=1`` is inherited by spawned ranks).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_VERBOSITY"] = "error"
os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

# ``tests.support.models`` must import the same way here, in test modules and in spawned ranks.
_REPO_ROOT = str(Path(__file__).resolve().parent.parent)
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

from tests.support.models import DEFAULT_SHARD_SIZE, MODEL_TYPES, build_model, load_reference, make_checkpoint  # noqa: E402
from tests.support.servers.s3 import BUCKET, MotoS3  # noqa: E402

try:  # transformers' own loading/saving bars ("Loading weights", "Writing model shards")
    from transformers.utils import logging as _hf_logging

    _hf_logging.set_verbosity_error()
    _hf_logging.disable_progress_bar()
except Exception:  # pragma: no cover - transformers is a hard dependency, but stay importable
    pass

DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp32": torch.float32}


def dtype_name(dtype: torch.dtype) -> str:
    return {value: key for key, value in DTYPES.items()}.get(dtype, str(dtype).removeprefix("torch."))


@dataclass(frozen=True, eq=False)
class TinyCheckpoint:
    """A tiny checkpoint on disk and how it was made."""

    model_type: str
    dtype: torch.dtype
    path: Path
    max_shard_size: str | int | None
    seed: int
    overrides: dict[str, Any] = field(default_factory=dict)
    _cache: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def sharded(self) -> bool:
        return (self.path / "model.safetensors.index.json").exists()

    def reference(self) -> dict[str, torch.Tensor]:
        """The oracle state dict (``from_pretrained``), computed once; a fresh dict of clones."""
        if "reference" not in self._cache:
            self._cache["reference"] = load_reference(self.path, self.model_type, self.dtype)
        return {key: value.clone() for key, value in self._cache["reference"].items()}

    def build_model(self):
        """A fresh copy of the model that wrote this checkpoint (same seed, dtype, overrides)."""
        return build_model(self.model_type, dtype=self.dtype, seed=self.seed, **self.overrides)

    def __str__(self) -> str:
        return f"{self.model_type}-{dtype_name(self.dtype)}"


class CheckpointFactory:
    """Builds tiny checkpoints under ``root``, each at most once per argument set."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._made: dict[str, TinyCheckpoint] = {}

    def __call__(
        self,
        model_type: str,
        dtype: torch.dtype = torch.bfloat16,
        *,
        max_shard_size: str | int | None = DEFAULT_SHARD_SIZE,
        seed: int = 0,
        **config_overrides: Any,
    ) -> TinyCheckpoint:
        spec = json.dumps(
            [model_type, str(dtype), max_shard_size, seed, config_overrides], sort_keys=True, default=str
        )
        if spec not in self._made:
            digest = hashlib.sha1(spec.encode()).hexdigest()[:8]
            shards = "single" if max_shard_size is None else f"shard{max_shard_size}"
            path = self.root / f"{model_type}-{dtype_name(dtype)}-{shards}-s{seed}-{digest}"
            make_checkpoint(
                model_type, path, dtype=dtype, max_shard_size=max_shard_size, seed=seed, **config_overrides
            )
            self._made[spec] = TinyCheckpoint(
                model_type, dtype, path, max_shard_size, seed, dict(config_overrides)
            )
        return self._made[spec]


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> CheckpointFactory:
    return CheckpointFactory(tmp_path_factory.mktemp("tiny_checkpoints"))


@pytest.fixture(scope="session", params=list(DTYPES), ids=list(DTYPES))
def ckpt_dtype(request: pytest.FixtureRequest) -> torch.dtype:
    return DTYPES[request.param]


@pytest.fixture(scope="session", params=MODEL_TYPES)
def tiny_model_type(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="session")
def tiny_checkpoint(
    tiny_checkpoints: CheckpointFactory, tiny_model_type: str, ckpt_dtype: torch.dtype
) -> TinyCheckpoint:
    return tiny_checkpoints(tiny_model_type, ckpt_dtype)


def _named_checkpoint_fixture(model_type: str):
    @pytest.fixture(scope="session", name=f"{model_type}_checkpoint")
    def _fixture(tiny_checkpoints: CheckpointFactory) -> TinyCheckpoint:
        return tiny_checkpoints(model_type, torch.bfloat16)

    _fixture.__doc__ = f"The bf16, sharded tiny {model_type} checkpoint."
    return _fixture


for _model_type in MODEL_TYPES:
    globals()[f"{_model_type}_checkpoint"] = _named_checkpoint_fixture(_model_type)
del _model_type


@pytest.fixture(scope="module")
def moto(tmp_path_factory: pytest.TempPathFactory):
    """moto's S3 server with :data:`BUCKET` created, for a module's saves and loads."""
    server = MotoS3(tmp_path_factory.mktemp("moto") / "recording.jsonl")
    server.create_bucket(BUCKET)
    yield server
    server.stop()
