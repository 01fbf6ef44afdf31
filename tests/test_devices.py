"""Device registry, custom devices, cluster resolution and CUDA detection mapping."""

import pytest

from lightning_hetermoe.cluster import (
    KNOWN_DEVICES,
    ClusterConfig,
    DeviceSpec,
    detect_cuda_devices,
    get_device,
    match_device_name,
    register_device,
    resolve_cluster,
    spec_from_properties,
)

REQUIRED = ["b200", "h200", "h100", "a100", "a100_40gb", "l40s", "rtx6000_ada", "a40", "rtx_a6000", "a10", "a10g",
            "l4", "rtx4090", "v100", "t4", "mi300x", "mi250x", "cpu"]


def test_registry_has_the_required_devices_with_sane_datasheet_order():
    for name in REQUIRED:
        spec = get_device(name)
        assert spec.name == name and spec.memory_gb > 0 and spec.fp16_tflops > 0 and spec.mem_bw_gbps > 0
    # datasheet ordering facts
    assert get_device("h100").fp16_tflops > get_device("a100").fp16_tflops > get_device("a40").fp16_tflops
    assert get_device("v100").fp16_tflops > get_device("t4").fp16_tflops
    assert get_device("a40").flash_attention and not get_device("v100").flash_attention
    assert not get_device("t4").flash_attention and get_device("l40s").flash_attention
    assert get_device("h200").memory_gb > get_device("h100").memory_gb
    assert get_device("b200").fp16_tflops > get_device("h100").fp16_tflops
    assert get_device("mi300x").fp16_tflops > get_device("mi250x").fp16_tflops
    assert get_device("mi300x").vendor == get_device("mi250x").vendor == "amd"
    # the same chips: the same compute, other memory
    assert get_device("a100_40gb").fp16_tflops == get_device("a100").fp16_tflops
    assert get_device("a100_40gb").memory_gb < get_device("a100").memory_gb
    assert get_device("rtx6000_ada").fp16_tflops == pytest.approx(get_device("l40s").fp16_tflops, rel=0.01)
    assert get_device("rtx_a6000").fp16_tflops == pytest.approx(get_device("a40").fp16_tflops, rel=0.05)
    # the T4's successor: faster, with bf16 and FlashAttention; the A10G is AWS's slower A10
    assert get_device("l4").fp16_tflops > get_device("t4").fp16_tflops and get_device("l4").has_bf16
    assert get_device("l4").flash_attention and get_device("a10").fp16_tflops > get_device("a10g").fp16_tflops


def test_lookup_is_case_insensitive_and_unknown_names_list_known_ones():
    assert get_device("A40") is get_device("a40")
    with pytest.raises(ValueError) as err:
        get_device("b9000")
    assert "b9000" in str(err.value) and "a40" in str(err.value) and "v100" in str(err.value)


def test_custom_devices_from_yaml_and_resolve_cluster_per_rank():
    cfg = ClusterConfig(
        name="mix",
        devices=["a40", "mygpu", "v100", "half_a40"],
        custom_devices={
            "mygpu": {"memory_gb": 24, "fp16_tflops": 200, "mem_bw_gbps": 1000, "flash_attention": True},
            "half_a40": {"base": "a40", "memory_gb": 24},
        },
    )
    specs = resolve_cluster(cfg)
    assert [s.name for s in specs] == ["a40", "mygpu", "v100", "half_a40"]
    assert specs[1].fp16_tflops == 200 and specs[1].flash_attention
    assert specs[3].memory_gb == 24 and specs[3].fp16_tflops == get_device("a40").fp16_tflops
    # a plain dict works as well as the dataclass
    assert resolve_cluster({"devices": ["t4"]})[0] is get_device("t4")


def test_bad_custom_device_and_bad_spec_raise():
    with pytest.raises(ValueError, match="unknown field"):
        resolve_cluster({"devices": ["x"], "custom_devices": {"x": {"memory_gb": 1, "teraflops": 3}}})
    with pytest.raises(ValueError, match="gemm_efficiency"):
        DeviceSpec("bad", 10, 10, 10, False, gemm_efficiency=1.5)
    with pytest.raises(ValueError, match="unknown device"):
        resolve_cluster({"devices": ["a40", "nope"]})


def test_register_device_refuses_silent_replacement():
    spec = DeviceSpec("testgpu_x", 8, 10, 100, False)
    try:
        register_device(spec)
        assert get_device("testgpu_x") == spec
        with pytest.raises(ValueError, match="already registered"):
            register_device(DeviceSpec("testgpu_x", 16, 10, 100, False))
        register_device(DeviceSpec("testgpu_x", 16, 10, 100, False), overwrite=True)
        assert get_device("testgpu_x").memory_gb == 16
    finally:
        KNOWN_DEVICES.pop("testgpu_x", None)


@pytest.mark.parametrize(
    "cuda_name,key",
    [
        ("NVIDIA A40", "a40"),
        ("Tesla V100-SXM2-32GB", "v100"),
        ("NVIDIA L40S", "l40s"),
        ("Tesla T4", "t4"),
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("NVIDIA GeForce RTX 4090", "rtx4090"),
        ("NVIDIA A10G", "a10g"),
        ("NVIDIA A10", "a10"),
        ("NVIDIA L4", "l4"),
        ("NVIDIA A100-SXM4-40GB", "a100_40gb"),
        ("NVIDIA A100-PCIE-40GB", "a100_40gb"),
        ("NVIDIA A100 80GB PCIe", "a100"),
        ("NVIDIA RTX A6000", "rtx_a6000"),
        ("NVIDIA RTX 6000 Ada Generation", "rtx6000_ada"),
        ("NVIDIA B200", "b200"),
        ("AMD Instinct MI300X", "mi300x"),
        ("Quadro RTX 6000", None),
        ("NVIDIA L40", None),
    ],
)
def test_cuda_names_map_to_registry(cuda_name, key):
    assert match_device_name(cuda_name) == key


def test_spec_from_properties_keeps_measured_memory_and_handles_unknown():
    s = spec_from_properties("Tesla V100-SXM2-16GB", 16 * 10**9, 7, 0)
    assert s.name == "v100" and s.memory_gb == 16.0 and s.compute_capability == (7, 0)
    u = spec_from_properties("Mystery GPU 9", 40 * 10**9, 9, 0)
    assert u.name == "mystery_gpu_9" and u.flash_attention and u.memory_gb == 40.0


def test_detect_cuda_devices(monkeypatch):
    import torch

    faked = not torch.cuda.is_available()
    if faked:
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            detect_cuda_devices()

        class P:
            def __init__(self, name, mem, major, minor):
                self.name, self.total_memory, self.major, self.minor = name, mem, major, minor

        props = [P("NVIDIA A40", 48 * 10**9, 8, 6), P("Tesla V100-SXM2-32GB", 32 * 10**9, 7, 0)]
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: len(props))
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props[i])
    specs = detect_cuda_devices()
    assert len(specs) >= 1 and all(isinstance(s, DeviceSpec) for s in specs)
    if faked:
        assert [s.name for s in specs] == ["a40", "v100"]
