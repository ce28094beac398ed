"""Group offloading without copy-back, for any ``torch.nn.Module``; pure torch, no ComfyUI."""
from .engine import GroupOffloadHandle, OffloadConfig, apply_group_offload, handle_of
from .group import check_offloadable
from .mirror import CudaHostRegister, Pinner
from .residency import device_footprint, plan_residency
from .subclass import UnpackableTensorError, flatten, packed_nbytes

__all__ = [
    "CudaHostRegister",
    "GroupOffloadHandle",
    "OffloadConfig",
    "Pinner",
    "UnpackableTensorError",
    "apply_group_offload",
    "check_offloadable",
    "device_footprint",
    "flatten",
    "handle_of",
    "packed_nbytes",
    "plan_residency",
]
