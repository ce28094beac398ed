"""Group offloading without copy-back, for any ``torch.nn.Module``; pure torch, no ComfyUI."""
from .backoff import OutOfMemoryAfterBackOff, call_backing_off
from .engine import GroupOffloadHandle, GroupSnapshot, apply_group_offload, handle_of
from .group import check_offloadable, split_into_groups
from .grouping import OffloadConfig
from .hostmem import FileMappings, SourceChangedError, map_file
from .mirror import CudaHostRegister, Pinner
from .residency import Residency, device_footprint, format_bytes, plan_residency
from .runtime import CaptureError
from .subclass import UnpackableTensorError, flatten, packed_nbytes, plain_subclass
from .watch import OutsideUseError, OutsideUseWatch

__all__ = [
    "CaptureError",
    "CudaHostRegister",
    "FileMappings",
    "GroupOffloadHandle",
    "GroupSnapshot",
    "OffloadConfig",
    "OutOfMemoryAfterBackOff",
    "OutsideUseError",
    "OutsideUseWatch",
    "Pinner",
    "Residency",
    "SourceChangedError",
    "UnpackableTensorError",
    "apply_group_offload",
    "call_backing_off",
    "check_offloadable",
    "device_footprint",
    "flatten",
    "format_bytes",
    "handle_of",
    "map_file",
    "packed_nbytes",
    "plain_subclass",
    "plan_residency",
    "split_into_groups",
]
