"""hp-dcp-hf: load Hugging Face safetensors checkpoints into parallelized models through
``torch.distributed.checkpoint``, each rank reading only the bytes its shards need.

The public names are imported on first use (module ``__getattr__``), so ``import hp_dcp_hf`` and
``python -m hp_dcp_hf --help`` do not pay for torch and transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hp_dcp_hf.lazy import lazy_exports

if TYPE_CHECKING:
    from hp_dcp_hf.api import load_hf_checkpoint, save_hf_checkpoint
    from hp_dcp_hf.mapping.stages import add_weight_mapping
    from hp_dcp_hf.pipeline import from_pretrained
    from hp_dcp_hf.planner import HFMappingPlanner, LoadReport
    from hp_dcp_hf.save_planner import HFSavePlanner
    from hp_dcp_hf.storage import HFStorageReader, HFStorageWriter

__all__ = [
    "HFMappingPlanner",
    "HFSavePlanner",
    "HFStorageReader",
    "HFStorageWriter",
    "LoadReport",
    "add_weight_mapping",
    "from_pretrained",
    "load_hf_checkpoint",
    "save_hf_checkpoint",
]
__version__ = "0.1.0"

_EXPORTS = {
    "HFMappingPlanner": "hp_dcp_hf.planner",
    "HFSavePlanner": "hp_dcp_hf.save_planner",
    "HFStorageReader": "hp_dcp_hf.storage",
    "HFStorageWriter": "hp_dcp_hf.storage",
    "LoadReport": "hp_dcp_hf.planner",
    "add_weight_mapping": "hp_dcp_hf.mapping.stages",
    "from_pretrained": "hp_dcp_hf.pipeline",
    "load_hf_checkpoint": "hp_dcp_hf.api",
    "save_hf_checkpoint": "hp_dcp_hf.api",
}


__getattr__ = lazy_exports(__name__, globals(), _EXPORTS, submodules=True)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
