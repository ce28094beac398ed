"""Group offloading without copy-back, for any ``torch.nn.Module``; pure torch, no ComfyUI."""
from .engine import GroupOffloadHandle, OffloadConfig, apply_group_offload, handle_of
from .group import check_offloadable
from .mirror import CudaHostRegister, Pinner
from .residency import device_footprint, plan_residency

__all__ = [
    "CudaHostRegister",
    "GroupOffloadHandle",
    "OffloadConfig",
    "Pinner",
    "apply_group_offload",
    "check_offloadable",
    "device_footprint",
    "handle_of",
    "plan_residency",
]
