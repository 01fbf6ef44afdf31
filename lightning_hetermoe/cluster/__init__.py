"""What devices exist: per-rank device specs from a cluster config or from detection."""

from .spec import ClusterConfig, LinkConfig, resolve_cluster
from .devices import (
    KNOWN_DEVICES,
    DeviceSpec,
    detect_cuda_devices,
    get_device,
    match_device_name,
    register_device,
    spec_from_properties,
)

__all__ = [
    "ClusterConfig",
    "LinkConfig",
    "DeviceSpec",
    "KNOWN_DEVICES",
    "get_device",
    "register_device",
    "resolve_cluster",
    "detect_cuda_devices",
    "match_device_name",
    "spec_from_properties",
]
