"""Tensor parallel + FSDP2 on torchrun for staticformers models (PyTorch's DTensor, FSDP2, DCP).

`DistributedConfig` (distributed_config.py) describes the layout; `from_pretrained(..., distributed_config=...)`
builds the mesh (mesh.py), partitions the model (parallelize.py, expert_parallel.py, lora_partition.py) and
loads each rank's slices (sharded_loading.py, reader.py); dcp_checkpoint.py saves and resumes sharded state
(dcp_safety.py reads it without running code); training_support.py holds what a training loop needs (data
shards, loss reduction, clipping across meshes). It wraps a built model from outside: the model knows
nothing of it.

May import: backends, compilation, adapters, models, checkpoints, utils.
"""

from .distributed_config import DistributedConfig, DistributedConfigError
from .mesh import shutdown

__all__ = ["DistributedConfig", "DistributedConfigError", "shutdown"]
