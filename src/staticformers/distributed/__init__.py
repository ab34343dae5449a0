"""Tensor parallel + FSDP2 on torchrun for staticformers models (PyTorch's DTensor, FSDP2, DCP).

`DistributedConfig` (config.py) describes the layout; `from_pretrained(..., distributed_config=...)`
builds the mesh (mesh.py), partitions the model (parallelize.py) and loads each rank's slices
(loading.py); checkpoint.py saves and resumes sharded state; training.py holds what a training loop
needs (data shards, loss reduction, clipping across meshes).
"""

from .config import DistributedConfig, DistributedConfigError
from .mesh import shutdown

__all__ = ["DistributedConfig", "DistributedConfigError", "shutdown"]
