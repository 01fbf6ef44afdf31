"""Per-device task times: measured (a :class:`Profile`) or modelled (:class:`CostModel`)."""

from .cost_model import CostModel
from .memory import MemoryModel
from .profile import DeviceProfile, Profile, interpolate
from .timer import CostModelTimer, ProfileTimer, make_timer

__all__ = [
    "CostModel",
    "MemoryModel",
    "Profile",
    "DeviceProfile",
    "interpolate",
    "CostModelTimer",
    "ProfileTimer",
    "make_timer",
]
