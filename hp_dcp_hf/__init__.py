"""hp-dcp-hf: load Hugging Face safetensors checkpoints into parallelized models through
``torch.distributed.checkpoint``, each rank reading only the bytes its shards need.

The public names are imported on first use (module ``__getattr__``), so ``import hp_dcp_hf`` and
``python -m hp_dcp_hf --help`` do not pay for torch and transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hp_dcp_hf.util.lazy import lazy_exports
from hp_dcp_hf.version import __version__ as __version__

if TYPE_CHECKING:
    from hp_dcp_hf.integrations.transformers import from_pretrained
    from hp_dcp_hf.load.api import load_hf_checkpoint
    from hp_dcp_hf.load.planner import HFMappingPlanner, LoadReport
    from hp_dcp_hf.mapping.stages import add_weight_mapping
    from hp_dcp_hf.save.api import save_hf_checkpoint
    from hp_dcp_hf.save.planner import HFSavePlanner
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

_EXPORTS = {
    "HFMappingPlanner": "hp_dcp_hf.load.planner",
    "HFSavePlanner": "hp_dcp_hf.save.planner",
    "HFStorageReader": "hp_dcp_hf.storage",
    "HFStorageWriter": "hp_dcp_hf.storage",
    "LoadReport": "hp_dcp_hf.load.planner",
    "add_weight_mapping": "hp_dcp_hf.mapping.stages",
    "from_pretrained": "hp_dcp_hf.integrations.transformers",
    "load_hf_checkpoint": "hp_dcp_hf.load.api",
    "save_hf_checkpoint": "hp_dcp_hf.save.api",
}


__getattr__ = lazy_exports(__name__, globals(), _EXPORTS, submodules=True)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
