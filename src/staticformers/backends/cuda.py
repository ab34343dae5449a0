"""NVIDIA GPUs: inductor with CUDA graphs where asked, NCCL, the CUDA generator, free device memory, TF32."""

from __future__ import annotations

from typing import Optional

import torch

from .base import Backend


class CUDABackend(Backend):
    """What differs on CUDA (see `base.Backend`)."""

    name = kind = "cuda"
    fused_optimizer = pin_memory = tf32 = True

    def fp8_arithmetic(self, device: torch.device) -> bool:
        """fp8 tensor cores: compute capability 8.9 (Ada) and later."""
        return torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= (8, 9)

    def available_memory(self, device: torch.device) -> Optional[int]:
        if not torch.cuda.is_available():
            return None
        try:
            free, _ = torch.cuda.mem_get_info(device)
        except Exception:  # pragma: no cover - a driver that cannot answer
            return None
        return int(free)

    def rng_state(self, device: torch.device) -> Optional[torch.Tensor]:
        return torch.cuda.get_rng_state(device) if torch.cuda.is_available() else None

    def set_rng_state(self, device: torch.device, state: torch.Tensor) -> None:
        if torch.cuda.is_available():
            torch.cuda.set_rng_state(state, device)

    def before_process_group(self, device: torch.device) -> None:
        torch.cuda.set_device(device)

    def set_tf32(self, enabled: bool) -> None:
        torch.backends.cuda.matmul.allow_tf32 = bool(enabled)
        torch.backends.cudnn.allow_tf32 = bool(enabled)


class XPUBackend(Backend):
    """Intel GPUs: inductor, XCCL; each rank on its own device."""

    name = kind = "xpu"

    def before_process_group(self, device: torch.device) -> None:
        torch.xpu.set_device(device)


class MPSBackend(Backend):
    """Apple silicon: inductor, gloo; one device shared by the ranks."""

    name = kind = "mps"
    per_rank_device = False


__all__ = ["CUDABackend", "XPUBackend", "MPSBackend"]
