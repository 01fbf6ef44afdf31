"""Device specs: what each accelerator is, as datasheet facts plus achievable efficiencies.

A :class:`DeviceSpec` is the only thing the cost model, planner and emulator know about a
GPU. Peak numbers come from vendor datasheets (dense, i.e. without 2:4 sparsity). Peak is
not what kernels reach, so each spec also carries *efficiency* factors: the fraction of
peak that large GEMMs, the fused attention kernel and streaming memory traffic sustain.
They are calibrated so that the cost model reproduces the HeterMoE paper's measured
ratios (see :mod:`lightning_hetermoe.profile.cost_model` for the derivation).

Devices come from three places:
- :data:`KNOWN_DEVICES`, the built-in registry;
- ``custom_devices`` in a cluster YAML (``{name: {memory_gb: ..., fp16_tflops: ...}}``),
  or :func:`register_device` from Python;
- :func:`detect_cuda_devices`, which reads CUDA properties on every rank and maps the
  marketing name onto the registry.
"""

from __future__ import annotations

import re
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any, Iterable, Mapping

from ..configs import ConfigError

# bf16 in hardware: Ampere and newer (on a V100 or T4 PyTorch only emulates it)
BF16_MIN_CAPABILITY = (8, 0)


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator kind.

    ``fp16_tflops`` is the dense fp16/bf16 tensor-core peak; ``fp32_tflops`` the fp32 peak
    on CUDA cores (0: an eighth of ``fp16_tflops``); ``tf32_tflops`` the dense TF32
    tensor-core peak (0: no TF32, before Ampere); ``mem_bw_gbps`` the HBM/GDDR bandwidth in
    GB/s; ``flash_attention`` whether FlashAttention-class fused kernels (causal block
    skipping, on-chip softmax) run on it (Ampere and newer, or CDNA2+; fp16/bf16 only).
    """

    name: str
    memory_gb: float
    fp16_tflops: float
    mem_bw_gbps: float
    flash_attention: bool
    # CUDA compute capability (major, minor); (0, 0) for non-CUDA devices.
    compute_capability: tuple[int, int] = (0, 0)
    # Fraction of peak that large GEMMs sustain (clocks under power limits, cuBLAS tiles).
    gemm_efficiency: float = 0.7
    # Fraction of peak that the fused attention core sustains: FlashAttention-2 where
    # ``flash_attention`` is true, else the memory-efficient (cutlass/xformers) kernel.
    attn_efficiency: float = 0.5
    # Fraction of ``mem_bw_gbps`` that streaming kernels reach.
    bw_efficiency: float = 0.8
    # Memory the runtime keeps for itself (CUDA context, allocator slack, NCCL buffers).
    reserved_gb: float = 1.5
    # Fixed cost of launching one task (a few kernels), seconds.
    launch_overhead_s: float = 20e-6
    vendor: str = "nvidia"
    fp32_tflops: float = 0.0
    tf32_tflops: float = 0.0

    def __post_init__(self) -> None:
        checks = {
            "memory_gb": self.memory_gb > 0,
            "fp16_tflops": self.fp16_tflops > 0,
            "mem_bw_gbps": self.mem_bw_gbps > 0,
            "gemm_efficiency": 0 < self.gemm_efficiency <= 1,
            "attn_efficiency": 0 < self.attn_efficiency <= 1,
            "bw_efficiency": 0 < self.bw_efficiency <= 1,
            "reserved_gb": 0 <= self.reserved_gb < self.memory_gb,
            "launch_overhead_s": self.launch_overhead_s >= 0,
            "fp32_tflops": self.fp32_tflops >= 0,
            "tf32_tflops": self.tf32_tflops >= 0,
        }
        for key, ok in checks.items():
            if not ok:
                raise ValueError(f"DeviceSpec {self.name!r}: {key}={getattr(self, key)!r} is out of range")
        # YAML gives lists; keep the spec hashable and comparable.
        object.__setattr__(self, "compute_capability", tuple(self.compute_capability))

    @property
    def usable_bytes(self) -> float:
        return (self.memory_gb - self.reserved_gb) * 1e9

    @property
    def has_bf16(self) -> bool:
        """bf16 in hardware: CUDA compute capability 8.0 and up (non-CUDA devices: assumed)."""
        return self.compute_capability == (0, 0) or self.compute_capability >= BF16_MIN_CAPABILITY

    def peak_tflops(self, precision: str, tf32: bool = False) -> float:
        """The dense peak a GEMM reaches in ``precision``: tensor cores for 16-mixed and
        bf16-mixed; for 32-true the TF32 tensor cores where the device has them and
        ``tf32`` allows them, else the CUDA cores' fp32 peak."""
        if precision_dtype_bytes(precision) == 2:
            return self.fp16_tflops
        if tf32 and self.tf32_tflops > 0:
            return self.tf32_tflops
        return self.fp32_tflops or self.fp16_tflops / 8

    @property
    def stream_bw(self) -> float:
        """Sustained bytes/s of streaming memory traffic."""
        return self.mem_bw_gbps * 1e9 * self.bw_efficiency

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["compute_capability"] = list(self.compute_capability)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "DeviceSpec":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"DeviceSpec: unknown field(s) {unknown}; valid fields are {sorted(known)}")
        return cls(**dict(d))


PRECISIONS = ("32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true")


def precision_dtype_bytes(precision: str) -> int:
    """Bytes per value a model computes and moves in, under Lightning's ``precision``."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is invalid: must be one of {PRECISIONS}")
    return 4 if precision == "32-true" else 2


def check_bf16(precision: str, devices: Iterable[DeviceSpec], allow_emulated: bool) -> None:
    """Reject bf16 on a cluster whose CUDA devices cannot run it natively."""
    if not precision.startswith("bf16") or allow_emulated:
        return
    old = sorted({d.name for d in devices if not d.has_bf16})
    if old:
        raise ConfigError(
            f"trainer precision={precision!r} is invalid on {', '.join(old)}: compute capability below "
            f"{BF16_MIN_CAPABILITY[0]}.{BF16_MIN_CAPABILITY[1]} has no bf16 hardware, PyTorch only emulates it there; "
            f"use precision='16-mixed' (fp16 with loss scaling, tensor cores), or strategy allow_emulated_bf16=true "
            f"to run the emulation anyway")


def _spec(name, mem, tflops, bw, flash, cc, gemm, attn, fp32=0.0, tf32=0.0, **kw) -> DeviceSpec:
    return DeviceSpec(name, mem, tflops, bw, flash, cc, gemm_efficiency=gemm, attn_efficiency=attn, fp32_tflops=fp32,
                      tf32_tflops=tf32, **kw)


# Datasheet peaks (dense fp16/bf16 tensor, fp32 on CUDA cores, dense TF32 tensor; no
# sparsity: half the "with sparsity" figures vendors headline). Efficiencies: A40, V100,
# L40S and T4 are fitted to the paper's measured ratios (cost_model.py explains the fit);
# the others use typical published cuBLAS / FlashAttention-2 utilisation for their
# generation, and a device on the same chip as a fitted one (RTX A6000 and A40, RTX 6000
# Ada and L40S) takes its fit. The same efficiency is applied to the fp32 and TF32 peaks
# (an approximation: measure a Profile where it matters).
_BUILTIN: tuple[DeviceSpec, ...] = (
    # B200 (HGX, 1000 W): 180 GB HBM3e usable, 2250 TFLOPS, 8 TB/s; fp32 75, TF32 1100.
    _spec("b200", 180, 2250.0, 8000, True, (10, 0), 0.70, 0.55, fp32=75.0, tf32=1100.0),
    # H200 SXM: 141 GB HBM3e, 989 TFLOPS, 4.8 TB/s; fp32 67, TF32 495.
    _spec("h200", 141, 989.0, 4800, True, (9, 0), 0.70, 0.55, fp32=67.0, tf32=494.7),
    # H100 SXM: 80 GB HBM3, 989 TFLOPS, 3.35 TB/s; fp32 67, TF32 495.
    _spec("h100", 80, 989.0, 3350, True, (9, 0), 0.70, 0.55, fp32=67.0, tf32=494.7),
    # A100 SXM 80 GB: 312 TFLOPS, 2.04 TB/s; fp32 19.5, TF32 156.
    _spec("a100", 80, 312.0, 2039, True, (8, 0), 0.75, 0.60, fp32=19.5, tf32=156.0),
    # A100 40 GB: the same chip with 40 GB HBM2 at 1.56 TB/s.
    _spec("a100_40gb", 40, 312.0, 1555, True, (8, 0), 0.75, 0.60, fp32=19.5, tf32=156.0),
    # L40S: 48 GB GDDR6, 362 TFLOPS (fp32 accumulate), 864 GB/s; fp32 91.6, TF32 183.
    _spec("l40s", 48, 362.0, 864, True, (8, 9), 0.70, 0.55, fp32=91.6, tf32=183.0),
    # A40: 48 GB GDDR6, 149.7 TFLOPS, 696 GB/s; 300 W cap keeps clocks low; fp32 37.4, TF32 74.8.
    _spec("a40", 48, 149.7, 696, True, (8, 6), 0.68, 0.55, fp32=37.4, tf32=74.8),
    # RTX A6000: the A40's GA102 with active cooling: 48 GB GDDR6, 154.8 TFLOPS, 768 GB/s; fp32 38.7, TF32 77.4.
    _spec("rtx_a6000", 48, 154.8, 768, True, (8, 6), 0.68, 0.55, fp32=38.7, tf32=77.4),
    # RTX 6000 Ada: the L40S's AD102: 48 GB GDDR6, 364 TFLOPS (fp32 accumulate), 960 GB/s; fp32 91.1, TF32 182.
    _spec("rtx6000_ada", 48, 364.2, 960, True, (8, 9), 0.70, 0.55, fp32=91.1, tf32=182.1),
    # A10: 24 GB GDDR6, 125 TFLOPS, 600 GB/s, 150 W; fp32 31.2, TF32 62.5.
    _spec("a10", 24, 125.0, 600, True, (8, 6), 0.70, 0.55, fp32=31.2, tf32=62.5),
    # A10G (AWS): 24 GB GDDR6, ~70 TFLOPS dense fp16 tensor, 600 GB/s; fp32 31.2, TF32 35.
    _spec("a10g", 24, 70.0, 600, True, (8, 6), 0.70, 0.55, fp32=31.2, tf32=35.0),
    # L4: 24 GB GDDR6, 121 TFLOPS, 300 GB/s; fp32 30.3, TF32 60. A 72 W card: like the T4 (70 W)
    # its clocks sit far below boost under load, so its efficiencies are the T4's fit, a little
    # higher for Ada's tensor cores (an assumption: profile it).
    _spec("l4", 24, 121.0, 300, True, (8, 9), 0.50, 0.45, fp32=30.3, tf32=60.0),
    # RTX 4090: 24 GB GDDR6X, 165 TFLOPS (fp32 accumulate), 1008 GB/s; fp32 82.6, TF32 82.6.
    _spec("rtx4090", 24, 165.2, 1008, True, (8, 9), 0.70, 0.55, fp32=82.6, tf32=82.6),
    # V100 SXM2 32 GB: 125 TFLOPS, 900 GB/s; fp32 15.7, no TF32, no bf16. No FlashAttention-2 (needs sm80).
    _spec("v100", 32, 125.0, 900, False, (7, 0), 0.60, 0.34, fp32=15.7),
    # T4: 16 GB GDDR6, 65 TFLOPS, 320 GB/s; fp32 8.1, no TF32, no bf16; 70 W cap, clocks far below boost.
    _spec("t4", 16, 65.0, 320, False, (7, 5), 0.46, 0.42, fp32=8.1),
    # MI300X: 192 GB HBM3, 1307 TFLOPS, 5.3 TB/s; fp32 163.4 (vector), TF32 653.7 (matrix).
    _spec("mi300x", 192, 1307.4, 5300, True, (0, 0), 0.55, 0.40, fp32=163.4, tf32=653.7, vendor="amd"),
    # MI250X (both GCDs): 128 GB HBM2e, 383 TFLOPS, 3.28 TB/s; fp32 47.9 (vector); CK flash attention.
    _spec("mi250x", 128, 383.0, 3277, True, (0, 0), 0.55, 0.40, fp32=47.9, vendor="amd"),
    # Plain CPU process (tests, emulation hosts): a few hundred GFLOP/s at best, fp16 no faster.
    _spec("cpu", 16, 0.5, 20, False, (0, 0), 0.5, 0.3, fp32=0.5, reserved_gb=1.0, launch_overhead_s=5e-6,
          vendor="cpu"),
)

KNOWN_DEVICES: dict[str, DeviceSpec] = {d.name: d for d in _BUILTIN}


def register_device(spec: DeviceSpec, *, overwrite: bool = False) -> DeviceSpec:
    """Add ``spec`` to the global registry (refuses to silently replace a known name)."""
    if not isinstance(spec, DeviceSpec):
        raise ConfigError(f"register_device spec={spec!r} is invalid: expected a DeviceSpec (a cluster config's "
                          f"custom_devices takes a dict of its fields, or base: <known device> and the ones that "
                          f"differ)")
    key = spec.name.lower()
    if key in KNOWN_DEVICES and not overwrite and KNOWN_DEVICES[key] != spec:
        raise ValueError(f"device {key!r} is already registered; pass overwrite=True to replace it")
    KNOWN_DEVICES[key] = spec
    return spec


def custom_spec(name: str, body: Any, where: str | None = None) -> DeviceSpec:
    """A device from its YAML body; ``base: <known device>`` starts from a registry entry.
    Errors name ``where`` (the Hydra path) and the fields that are missing or unknown."""
    if isinstance(body, DeviceSpec):
        return body
    where = where or f"custom device {name!r}"
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(body, DictConfig):
            body = OmegaConf.to_container(body, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        pass
    if body is not None and not isinstance(body, Mapping):
        raise ValueError(f"{where} must be a mapping of DeviceSpec fields, got {body!r}")
    body = dict(body or {})
    body.setdefault("name", name)
    # A custom device may start from a known one: {base: a40, memory_gb: 24}.
    base = body.pop("base", None)
    if base is not None:
        if str(base).lower() not in KNOWN_DEVICES:
            raise ValueError(f"{where}.base={base!r} is invalid: must be one of {', '.join(sorted(KNOWN_DEVICES))}")
        merged = KNOWN_DEVICES[str(base).lower()].to_dict()
        merged.update(body)
        body = merged
    known = {f.name: f for f in fields(DeviceSpec)}
    unknown = sorted(set(body) - set(known))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; valid fields are {sorted(known)}")
    required = [f for f, spec in known.items() if spec.default is MISSING and f not in body]
    if required:
        raise ValueError(f"{where}: missing field(s) {required}; give them, or start from a known device "
                         f"with base: <one of {', '.join(sorted(KNOWN_DEVICES))}>")
    try:
        return DeviceSpec.from_dict(body)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: {err}") from None


def get_device(name: str, custom: Mapping[str, Any] | None = None) -> DeviceSpec:
    """Look ``name`` up in ``custom`` (cluster YAML ``custom_devices``), then the registry."""
    if isinstance(name, DeviceSpec):
        return name
    key = str(name).lower()
    for cname, body in (custom or {}).items():
        if str(cname).lower() == key:
            return custom_spec(key, body)
    if key in KNOWN_DEVICES:
        return KNOWN_DEVICES[key]
    known = sorted(set(KNOWN_DEVICES) | {str(c).lower() for c in (custom or {})})
    raise ValueError(
        f"unknown device {name!r}; known devices: {', '.join(known)} (define others under cluster.custom_devices)"
    )


# Marketing names as CUDA reports them ("NVIDIA A40", "Tesla V100-SXM2-32GB", ...).
_NAME_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"b200", "b200"),
    (r"h200", "h200"),
    (r"h100", "h100"),
    (r"a100.*\b40\s*gb", "a100_40gb"),
    (r"a100", "a100"),
    (r"l40s", "l40s"),
    (r"rtx a6000", "rtx_a6000"),
    (r"rtx 6000 ada", "rtx6000_ada"),
    (r"\ba40\b|a40", "a40"),
    (r"a10g", "a10g"),
    (r"\ba10\b", "a10"),
    (r"\bl4\b", "l4"),
    (r"4090", "rtx4090"),
    (r"v100", "v100"),
    (r"\bt4\b|tesla t4", "t4"),
    (r"mi300x", "mi300x"),
    (r"mi250", "mi250x"),
)


def match_device_name(cuda_name: str) -> str | None:
    """Registry key for a CUDA device name, or None if it is not a known kind."""
    low = cuda_name.lower()
    for pattern, key in _NAME_PATTERNS:
        if re.search(pattern, low):
            return key
    return None


def spec_from_properties(name: str, total_memory: int, major: int, minor: int) -> DeviceSpec:
    """Map CUDA properties to a spec: the registry entry with the measured memory.

    Unknown devices get a conservative spec derived from compute capability, so a run on
    new hardware still plans (it just plans on rough numbers; profile it to do better).
    """
    mem_gb = total_memory / 1e9
    key = match_device_name(name)
    if key is not None:
        base = KNOWN_DEVICES[key]
        return DeviceSpec.from_dict(
            {**base.to_dict(), "memory_gb": round(mem_gb, 1), "compute_capability": [major, minor]}
        )
    return DeviceSpec(
        name=re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_") or "unknown_gpu",
        memory_gb=round(mem_gb, 1),
        fp16_tflops=100.0 if major >= 8 else 50.0,
        mem_bw_gbps=800.0,
        flash_attention=major >= 8,
        compute_capability=(major, minor),
    )


def detect_cuda_devices() -> list[DeviceSpec]:
    """Per-rank specs of the GPUs actually present.

    With ``torch.distributed`` initialised, every rank reports its own current device and
    the lists are exchanged over the host side (``comm.gather_objects``) so all ranks return
    the same list in rank order. Without it, returns one spec per visible GPU of this process.
    """
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("detect_cuda_devices: CUDA is not available; name the devices in a cluster config")

    def props(i: int) -> tuple[str, int, int, int]:
        p = torch.cuda.get_device_properties(i)
        return (p.name, int(p.total_memory), int(p.major), int(p.minor))

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        from .. import comm

        raw = comm.gather_objects(comm.world(), props(torch.cuda.current_device()), what="cluster.devices")
    else:
        raw = [props(i) for i in range(torch.cuda.device_count())]
    return [spec_from_properties(*r) for r in raw]
