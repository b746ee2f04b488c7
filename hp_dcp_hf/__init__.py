"""hp-dcp-hf: load Hugging Face safetensors checkpoints into parallelized models through
``torch.distributed.checkpoint``, each rank reading only the bytes its shards need."""

from hp_dcp_hf.api import load_hf_checkpoint
from hp_dcp_hf.mapping.stages import add_weight_mapping
from hp_dcp_hf.pipeline import from_pretrained
from hp_dcp_hf.planner import HFMappingPlanner, LoadReport
from hp_dcp_hf.storage import HFStorageReader

__all__ = [
    "HFMappingPlanner",
    "HFStorageReader",
    "LoadReport",
    "add_weight_mapping",
    "from_pretrained",
    "load_hf_checkpoint",
]
__version__ = "0.1.0"
