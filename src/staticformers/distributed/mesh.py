"""The process group and the named `DeviceMesh` of a torchrun job, and a clean shutdown.

`init_distributed` starts `torch.distributed` from the torchrun environment with the device's c10d
backend (neuron, nccl, xccl or gloo, from `devices.dist_backend_for`) unless the caller already did,
and pins the local device. `build_mesh` lays the ranks out as `(dp_replicate, fsdp, tp)` with those
names, tp innermost so that tensor-parallel traffic stays on neighbouring devices (one node). With
expert parallelism the same ranks are also viewed as `(edp_replicate, efsdp, ep)` (the world flattened
and unflattened again, so both views share one root mesh, as FSDP2 needs for a DTensor on another
view): an EP group is `ep` consecutive ranks of a replica, which holds whole TP groups.

`shutdown` exists because of a measured gloo quirk (ARCHITECTURE.md, "Known to bite"): destroying the process group
while FSDP/DTensor objects are still alive aborts a rank with SIGABRT in 10-40% of runs. Delete the
model and optimizer first, then call it: it collects garbage, waits for every rank, then destroys.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..backends import device_kind, for_device
from ..backends.devices import dist_backend_for, resolve_device
from .distributed_config import DistributedConfig

logger = logging.getLogger("staticformers")

MESH_DIMS = ("dp_replicate", "fsdp", "tp")


def local_device(device_map=None) -> torch.device:
    """This rank's device: the requested kind at index LOCAL_RANK (the CPU stays "cpu")."""
    base = resolve_device(device_map if device_map is not None else "auto")
    if not for_device(base).per_rank_device:
        return base
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return resolve_device(f"{device_kind(base)}:{local_rank}")


def init_distributed(device: torch.device) -> None:
    """Start the default process group from torchrun's env:// variables, once, with the device's backend."""
    if dist.is_initialized():
        return
    backend = dist_backend_for(device)
    for_device(device).before_process_group(device)  # register the c10d backend, set this rank's device
    dist.init_process_group(backend=backend)
    atexit.register(_destroy_at_exit)
    logger.info("torch.distributed started: rank %d of %d, backend %s", dist.get_rank(), dist.get_world_size(), backend)


@dataclass
class ParallelDims:
    """The resolved layout and its mesh; attached to a partitioned model as `model.parallel_dims`."""

    config: DistributedConfig
    mesh: DeviceMesh
    # the flattened meshes ("dp", "fsdp_tp") as `_flatten` returned them: kept here, because slicing a
    # flattened dim out of the root mesh (`mesh["dp"]`) is deprecated in PyTorch (and warns)
    flattened: dict = field(default_factory=dict)
    # expert parallelism's views: {"ep": the EP group's mesh, "efsdp": the mesh FSDP shards experts over}
    expert: dict = field(default_factory=dict)

    @property
    def tp(self) -> int:
        return self.config.tp_size

    @property
    def dp(self) -> int:
        return self.config.dp_size

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.mesh["tp"]

    @property
    def dp_mesh(self) -> DeviceMesh:
        """(dp_replicate, fsdp): FSDP2 shards over the last dim and replicates over the first (HSDP)."""
        return self.mesh["dp_replicate", "fsdp"]

    @property
    def dp_rank(self) -> int:
        """Index of this rank's data shard: equal across tp, distinct across dp_replicate x fsdp."""
        coord = self.mesh.get_coordinate()
        return coord[0] * self.config.fsdp_size + coord[1]

    @property
    def tp_rank(self) -> int:
        return self.mesh.get_coordinate()[2]

    @property
    def ep(self) -> int:
        return self.config.ep_size

    @property
    def ep_mesh(self) -> DeviceMesh:
        return self.expert["ep"]

    @property
    def expert_fsdp_mesh(self) -> DeviceMesh:
        """(edp_replicate, efsdp) with HSDP, else efsdp: the ranks holding the same experts."""
        return self.expert["efsdp"]

    def dp_group(self):
        """One process group over the data-parallel ranks (for loss and metric averages)."""
        if self.dp == 1:
            return None
        return self.flattened["dp"].get_group()


def build_mesh(config: DistributedConfig, device: torch.device) -> ParallelDims:
    """A resolved config's `(dp_replicate, fsdp, tp)` DeviceMesh on the device's kind."""
    shape = (config.dp_replicate_size, config.fsdp_size, config.tp_size)
    from .quiet import silence_pytorch_notices

    silence_pytorch_notices()
    mesh = init_device_mesh(device_kind(device), shape, mesh_dim_names=MESH_DIMS)
    # flattened views let DTensor reduce over several dims in one collective (gradient norms, gathers)
    flattened = {"dp": mesh["dp_replicate", "fsdp"]._flatten("dp"), "fsdp_tp": mesh["fsdp", "tp"]._flatten("fsdp_tp")}
    expert = {}
    if config.ep_size > 1:
        world = mesh._flatten("world")
        names = ("edp_replicate", "efsdp", "ep")
        sparse = world._unflatten(0, (config.dp_replicate_size, config.efsdp_size, config.ep_size), names)
        expert = {
            "ep": sparse["ep"],
            "efsdp": sparse["edp_replicate", "efsdp"] if config.dp_replicate_size > 1 else sparse["efsdp"],
        }
    return ParallelDims(config, mesh, flattened, expert)


def is_main_process() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def shutdown() -> None:
    """Collect garbage, wait for every rank, then destroy the process group (`del model, optimizer` first)."""
    gc.collect()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _destroy_at_exit() -> None:
    """A fallback for scripts that never call shutdown(): destroy the group without waiting."""
    if dist.is_initialized():
        gc.collect()
        try:
            dist.destroy_process_group()
        except Exception:  # pragma: no cover - at exit there is nobody to tell
            pass


__all__ = [
    "MESH_DIMS",
    "ParallelDims",
    "init_distributed",
    "build_mesh",
    "local_device",
    "shutdown",
    "barrier",
    "is_main_process",
]
