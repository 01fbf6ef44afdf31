"""The compiled (GPU) path of the kernels, checked without a GPU: Triton's compiler runs
on the CPU down to a cubin for a chosen target. The interpreter tests cover the numbers;
this covers what the interpreter forgives (loop-carried types, constexpr flags, layouts)."""

from __future__ import annotations

import inspect
import shutil
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from lightning_hetermoe.kernels import triton_src, tuning  # noqa: E402

FLOAT_PTRS = {"x_ptr", "w_ptr", "b_ptr", "out_ptr", "dy_ptr", "dw_ptr"}


def compile_for(fn, dtype: str, capability: int, config: "triton.Config", flags: dict):
    consts = {**config.kwargs, **flags, "INPUT_PRECISION": "ieee", "UPCAST": False}
    sig = {}
    for name in inspect.signature(fn).parameters:
        if name in consts:
            sig[name] = "constexpr"
        elif name in FLOAT_PTRS:
            sig[name] = f"*{dtype}"
        elif name == "scale_ptr":
            sig[name] = "*fp32"
        elif name.endswith("_ptr"):
            sig[name] = "*i64"
        else:
            sig[name] = "i32"
    src = triton.compiler.ASTSource(fn=JITFunction(fn), signature=sig, constexprs=consts)
    return triton.compile(src, target=GPUTarget("cuda", capability, 32),
                          options={"num_warps": config.num_warps, "num_stages": config.num_stages})


@pytest.mark.parametrize("capability,dtype", [(80, "fp16"), (90, "bf16")], ids=["ampere-fp16", "hopper-bf16"])
def test_kernels_compile_to_cubin(capability, dtype, tmp_path, monkeypatch):
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if shutil.which("ptxas") is None and not bundled.exists():
        pytest.skip("no ptxas shipped with this triton")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # compile for real, not from a cache
    cap = (capability // 10, capability % 10)
    gemm = compile_for(triton_src.grouped_gemm_kernel, dtype, capability, tuning.gemm_configs(cap)[0],
                       dict(HAS_IDX=True, HAS_BIAS=True, HAS_OUT_IDX=True, HAS_SCALE=True))
    wgrad = compile_for(triton_src.grouped_wgrad_kernel, dtype, capability, tuning.wgrad_configs(cap)[0],
                        dict(HAS_IDX=True))
    for kernel in (gemm, wgrad):
        assert kernel.asm.get("cubin"), "no cubin produced"
