"""The compiled (GPU) path of the kernels, checked without a GPU: Triton's compiler runs
on the CPU down to a cubin for a chosen target. The interpreter tests cover the numbers;
this covers what the interpreter forgives (loop-carried types, constexpr flags, layouts).
Every test here runs the CUDA tools (ptxas, cuobjdump) as processes: the full suite's."""

from __future__ import annotations

import inspect
import shutil
import tempfile
from dataclasses import astuple
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402

from lightning_hetermoe.kernels import launch, triton_src, tuning  # noqa: E402
from lightning_hetermoe.kernels.tiles import Tile  # noqa: E402

pytestmark = pytest.mark.slow

FLOAT_PTRS = {"x_ptr", "w_ptr", "b_ptr", "out_ptr", "dy_ptr", "dw_ptr", "h_ptr", "g_ptr", "logits_ptr", "y_ptr",
              "dx_ptr"}


GEMM_FLAGS = dict(HAS_IDX=True, HAS_BIAS=True, HAS_OUT_IDX=True, HAS_SCALE=True, TILE_MAP=True, X_DESC=False,
                  W_DESC=False)
WGRAD_FLAGS = dict(HAS_IDX=True, X_DESC=False, DY_DESC=False)
TRITON_DTYPE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def compile_for(fn, dtype: str, capability: int, config: "triton.Config", flags: dict, precision: str = "ieee",
                descriptors: dict | None = None):
    """``descriptors``: the TMA descriptor arguments passed (name -> box shape); the others
    are placeholders the kernel's flags leave unread."""
    descriptors = descriptors or {}
    params = inspect.signature(fn).parameters
    consts = {k: v for k, v in {**config.kwargs, **flags, "INPUT_PRECISION": precision, "UPCAST": False}.items()
              if k in params}
    sig = {}
    for name in inspect.signature(fn).parameters:
        if name in consts:
            sig[name] = "constexpr"
        elif name in descriptors:
            sig[name] = f"tensordesc<{dtype}{list(descriptors[name])}>"
        elif name in FLOAT_PTRS:
            sig[name] = f"*{dtype}"
        elif name in ("scale_ptr", "loss_ptr", "rstd_ptr", "dw_part_ptr", "cos_ptr", "sin_ptr"):
            sig[name] = "*fp32"
        elif name.startswith("tile_"):
            sig[name] = "*i32"
        elif name.endswith("_ptr"):
            sig[name] = "*i64"
        elif name == "eps":
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    # the kernel as the launcher wraps it (E and the row bucket not specialised)
    src = triton.compiler.ASTSource(fn=launch.jitted(fn), signature=sig, constexprs=consts)
    return triton.compile(src, target=GPUTarget("cuda", capability, 32),
                          options={"num_warps": config.num_warps, "num_stages": config.num_stages})


@pytest.fixture(scope="module")
def fresh_cache(tmp_path_factory) -> str:
    """A Triton cache that starts empty in each run (every kernel compiled for real, none read
    from an earlier run's), shared by the module's tests: a kernel two tests compile alike
    (the same source, constants and target) is compiled once."""
    return str(tmp_path_factory.mktemp("triton_cache"))


def need_ptxas():
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if shutil.which("ptxas") is None and not bundled.exists():
        pytest.skip("no ptxas shipped with this triton")


def compile_tiles(capability: int, dtype: torch.dtype, tiles_by_kernel: dict) -> list:
    cap = (capability // 10, capability % 10)
    precision = launch.input_precision(dtype, "cuda", cap, tf32=True)
    assert precision != "ieee", "a CUDA launch never gets plain fp32"
    out = []
    for which, tiles in tiles_by_kernel.items():
        fn = triton_src.grouped_gemm_kernel if which == "gemm" else triton_src.grouped_wgrad_kernel
        flags = GEMM_FLAGS if which == "gemm" else WGRAD_FLAGS
        for tile in dict.fromkeys(tiles):  # distinct, in order
            try:
                kernel = compile_for(fn, TRITON_DTYPE[dtype], capability, tuning.as_config(tile), flags, precision)
            except Exception as err:
                if "not supported" in str(err).lower() or "unsupported" in str(err).lower():
                    pytest.skip(f"triton {triton.__version__} does not compile for sm{capability}: {err}")
                raise
            assert kernel.asm.get("cubin"), f"no cubin for {which} {tile}"
            # what the compiled kernel really allocates, against the device's opt-in budget
            assert kernel.metadata.shared <= tuning.smem_budget(cap), (which, tile, kernel.metadata.shared)
            out.append(kernel)
    return out


# Every heuristic default a launch can take (small and large row buckets), per generation:
# Volta/Turing in fp16 (no bf16 there; sm75 takes sm70's tiles), Ampere and Hopper in a
# 16-bit type and in TF32 (whose tiles differ: the reduction block halved). fp16 and bf16
# take the same tiles, so one of them per generation is enough (each compile costs ~4 s).
DEFAULTS = [(70, torch.float16), (80, torch.bfloat16), (80, torch.float32), (90, torch.bfloat16),
            (90, torch.float32)]


@pytest.mark.parametrize("capability,dtype", DEFAULTS, ids=[f"sm{c}-{TRITON_DTYPE[d]}" for c, d in DEFAULTS])
def test_heuristic_defaults_compile_to_cubin(capability, dtype, fresh_cache, monkeypatch):
    need_ptxas()
    monkeypatch.setenv("TRITON_CACHE_DIR", fresh_cache)
    cap = (capability // 10, capability % 10)
    buckets = (tuning.M_BUCKET_MIN, tuning.M_BUCKET_MAX)
    kernels = compile_tiles(capability, dtype, {
        which: [tuning.default_tile(cap, dtype, which, b) for b in buckets] for which in ("gemm", "wgrad")})
    assert kernels


def test_hopper_autotune_candidates_compile_to_cubin(fresh_cache, monkeypatch):
    need_ptxas()
    monkeypatch.setenv("TRITON_CACHE_DIR", fresh_cache)
    cands = {which: tuning.autotune_candidates((9, 0), torch.bfloat16, which) for which in ("gemm", "wgrad")}
    assert all(1 <= len(c) <= tuning.MAX_CANDIDATES for c in cands.values())
    assert compile_tiles(90, torch.bfloat16, cands)


def test_the_grouped_launch_order_reaches_the_compiled_gemm(fresh_cache, monkeypatch):
    """GROUP is compiled in: the grouped order reads the grid's size (the row tiles of the
    last, short group), the one-row-tile-at-a-time order does not."""
    need_ptxas()
    monkeypatch.setenv("TRITON_CACHE_DIR", fresh_cache)
    tile = tuning.default_tile((9, 0), torch.bfloat16, "gemm", tuning.M_BUCKET_MAX)
    assert tile.group > 1
    grouped, plain = compile_tiles(90, torch.bfloat16, {"gemm": [tile, Tile(*astuple(tile)[:5], 1)]})
    assert "tt.get_num_programs" in grouped.asm["ttir"]
    assert "tt.get_num_programs" not in plain.asm["ttir"]


def test_the_row_tile_map_and_the_autotuners_scan_compile(fresh_cache, monkeypatch):
    """The map's one-program kernel, and the GEMM without a map (under the autotuner)."""
    need_ptxas()
    monkeypatch.setenv("TRITON_CACHE_DIR", fresh_cache)
    for capability in (70, 90):
        kernel = compile_for(triton_src.row_tile_map_kernel, "i64", capability,
                             triton.Config({"BLOCK_M": 128, "BLOCK": launch.MAP_BLOCK}, num_warps=1, num_stages=1), {})
        assert kernel.asm.get("cubin")
    tile = tuning.default_tile((9, 0), torch.bfloat16, "gemm", tuning.M_BUCKET_MAX)
    scan = compile_for(triton_src.grouped_gemm_kernel, "bf16", 90, tuning.as_config(tile),
                       {**GEMM_FLAGS, "TILE_MAP": False}, "tf32")
    assert scan.asm.get("cubin")


@pytest.mark.parametrize("capability,dtype", [(70, "fp16"), (90, "bf16"), (90, "fp32")])
def test_the_fused_swiglu_compiles(capability, dtype, fresh_cache, monkeypatch):
    need_ptxas()
    monkeypatch.setenv("TRITON_CACHE_DIR", fresh_cache)
    blocks = {k: v for k, v in launch.ELEMENTWISE.items() if k != "num_warps"}
    config = triton.Config(blocks, num_warps=launch.ELEMENTWISE["num_warps"], num_stages=1)
    for fn in (triton_src.swiglu_forward_kernel, triton_src.swiglu_backward_kernel):
        assert compile_for(fn, dtype, capability, config, {}).asm.get("cubin")


@pytest.mark.parametrize("capability,dtype", [(70, "fp16"), (90, "bf16")])
def test_the_cross_entropy_rows_compile(capability, dtype, fresh_cache, monkeypatch):
    need_ptxas()
    monkeypatch.setenv("TRITON_CACHE_DIR", fresh_cache)
    config = triton.Config({"BLOCK_V": launch.CROSS_ENTROPY["BLOCK_V"]}, num_warps=launch.CROSS_ENTROPY["num_warps"],
                           num_stages=1)
    for write_grad in (True, False):
        kernel = compile_for(triton_src.cross_entropy_rows_kernel, dtype, capability, config,
                             {"WRITE_GRAD": write_grad})
        assert kernel.asm.get("cubin")


@pytest.mark.parametrize("capability,dtype,block", [(70, "fp16", 1024), (90, "bf16", 4096), (90, "fp32", 16384)])
def test_the_rms_norm_kernels_compile(capability, dtype, block, fresh_cache, monkeypatch):
    need_ptxas()
    monkeypatch.setenv("TRITON_CACHE_DIR", fresh_cache)
    config = triton.Config({"BLOCK_D": block}, num_warps=launch._norm_warps(block), num_stages=1)
    for fn in (triton_src.rms_norm_forward_kernel, triton_src.rms_norm_backward_kernel):
        assert compile_for(fn, dtype, capability, config, {"ROUND": dtype != "fp32"}).asm.get("cubin")


@pytest.mark.parametrize("capability,dtype", [(70, "fp16"), (90, "bf16")])
def test_the_rotary_kernel_compiles(capability, dtype, fresh_cache, monkeypatch):
    need_ptxas()
    monkeypatch.setenv("TRITON_CACHE_DIR", fresh_cache)
    config = triton.Config({"BLOCK_S": launch.ROTARY["BLOCK_S"], "BLOCK_HALF": 64},
                           num_warps=launch.ROTARY["num_warps"], num_stages=1)
    for sign in (1.0, -1.0):
        assert compile_for(triton_src.rotary_kernel, dtype, capability, config, {"SIGN": sign}).asm.get("cubin")


def test_tma_loads_compile_for_hopper_in_tf32(fresh_cache, monkeypatch):
    """Every descriptor combination the launches pass on sm90 (the up GEMM gathers its rows:
    weights only; the down GEMM and the gradient GEMMs: rows and weights; the weight
    gradient: its rows and dy), on fp32 (TF32) large-bucket tiles, down to cubins whose PTX
    copies by TMA (``cp.async.bulk.tensor``); bf16 as launched: the expert MLP's test below."""
    dtype = torch.float32
    need_ptxas()
    monkeypatch.setenv("TRITON_CACHE_DIR", fresh_cache)
    name = TRITON_DTYPE[dtype]
    precision = launch.input_precision(dtype, "cuda", (9, 0), tf32=True)
    gemm = tuning.default_tile((9, 0), dtype, "gemm", tuning.M_BUCKET_MAX)
    wgrad = tuning.default_tile((9, 0), dtype, "wgrad", tuning.M_BUCKET_MAX)
    rows_box = [1, 1, gemm.block_m, gemm.block_k]
    w_box = [1, gemm.block_k, gemm.block_n]
    cases = [
        (triton_src.grouped_gemm_kernel, gemm, {**GEMM_FLAGS, "W_DESC": True}, {"w_desc": w_box}),
        (triton_src.grouped_gemm_kernel, gemm, {**GEMM_FLAGS, "HAS_IDX": False, "X_DESC": True, "W_DESC": True},
         {"x_desc": rows_box, "w_desc": w_box}),
        (triton_src.grouped_wgrad_kernel, wgrad, {**WGRAD_FLAGS, "DY_DESC": True},
         {"dy_desc": [1, 1, wgrad.block_m, wgrad.block_n]}),
        (triton_src.grouped_wgrad_kernel, wgrad, {**WGRAD_FLAGS, "HAS_IDX": False, "X_DESC": True, "DY_DESC": True},
         {"x_desc": [1, 1, wgrad.block_m, wgrad.block_k], "dy_desc": [1, 1, wgrad.block_m, wgrad.block_n]}),
    ]
    for fn, tile, flags, descriptors in cases:
        kernel = compile_for(fn, name, 90, tuning.as_config(tile), flags, precision, descriptors)
        assert kernel.asm.get("cubin"), (fn.__name__, flags)
        assert "cp.async.bulk.tensor" in kernel.asm["ptx"], (fn.__name__, flags)
        assert kernel.metadata.shared <= tuning.smem_budget((9, 0)), (fn.__name__, kernel.metadata.shared)


def compile_as_launched(capability: int, launches, monkeypatch, kernels: tuple = ()) -> list:
    """Each kernel launch the ``launches`` callable makes (of the ``kernels`` functions, or
    of any), compiled for ``capability`` exactly
    as Triton's JIT would compile it on that GPU: the launch code runs on CPU tensors with the
    generation's heuristic tiles, the kernel call is recorded instead of run, and Triton's own
    binder specialises the recorded arguments (alignment, strides of 1, divisibility)."""
    from triton.compiler import make_backend
    from triton.runtime import jit as triton_jit

    if not hasattr(triton_jit, "create_function_from_signature") or not hasattr(triton_jit.JITFunction, "_pack_args"):
        pytest.skip(f"triton {triton.__version__}'s JIT binds arguments differently")
    cap = (capability // 10, capability % 10)
    calls = []

    class Recorder:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((self.fn, args, kwargs))

    monkeypatch.setattr(launch, "_kernel", lambda fn, which, device, dtype, bucket: (
        Recorder(fn), tuning.with_group(tuning.default_tile(cap, dtype, which, bucket).launch_kwargs())))
    monkeypatch.setattr(launch, "_one_config", lambda fn, device, on_cuda, interpreted=None: (
        Recorder(fn), dict(on_cuda)))
    monkeypatch.setattr(launch, "_precision", lambda dtype, device: "tf32")
    monkeypatch.setattr(launch, "_upcast", lambda dtype, device: False)
    monkeypatch.setattr(launch, "_tma", lambda device: tuning.uses_tma("cuda", cap))
    launches()
    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    out = []
    for fn, args, kwargs in calls:
        if kernels and fn not in kernels:
            continue
        jitted = launch.jitted(fn)
        binder = triton_jit.create_function_from_signature(jitted.signature, jitted.params, backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = jitted._pack_args(backend, kwargs, bound, specialization, options)
        src = triton.compiler.ASTSource(jitted, signature, constexprs, attrs)
        out.append(triton.compile(src, target=target, options=options.__dict__))
    return out


def resource_usage(kernel) -> dict[str, int]:
    """``REG``, ``STACK``, ``SHARED``, ``LOCAL`` of a compiled kernel's cubin, as the CUDA tools
    shipped with triton read them (``cuobjdump --dump-resource-usage``)."""
    import re
    import subprocess

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        pytest.skip("no cuobjdump shipped with this triton")
    cubin = Path(tempfile.mkdtemp()) / "kernel.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    out = subprocess.run([str(tool), "--dump-resource-usage", str(cubin)], capture_output=True, text=True,
                         check=True).stdout
    return {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", out)}


MLP_LAUNCHES = ("up (gathered)", "down", "down's weight gradient", "down's input gradient (w^T)",
                "up's weight gradient (gathered)", "up's input gradient (w^T)")


@pytest.mark.parametrize("capability,tma", [(80, False), (90, False), (90, True)])
def test_the_expert_mlps_gemms_are_pipelined_and_do_not_spill(capability, tma, fresh_cache, monkeypatch):
    """The six GEMMs of the expert MLP's forward and backward in bf16 (``TritonGemms``, as
    ``algorithm`` calls them), compiled as launched on the large-bucket tiles: every one
    pipelined as deep as the others (the same shared memory, copies issued ahead: cp.async,
    or TMA), on the generation's tensor-core instruction (wgmma on Hopper, overlapped), none
    spilling registers. Before the weight gradient over gathered rows loaded
    its row indices an iteration ahead it had half the buffers; before Ampere's 128x128
    GEMM tile took 8 warps, four of the six spilled (255 registers)."""
    from lightning_hetermoe.kernels.mlp import TritonGemms

    need_ptxas()
    monkeypatch.setenv("TRITON_CACHE_DIR", fresh_cache)
    counts = torch.tensor([700, 0, 1348])  # 2048 rows: the large-bucket tiles
    rows, T, D, F = int(counts.sum()), 1024, 256, 512
    x, idx = torch.empty(T, D, dtype=torch.bfloat16), torch.zeros(rows, dtype=torch.long)
    w_up, w_down = torch.empty(3, D, 2 * F, dtype=torch.bfloat16), torch.empty(3, F, D, dtype=torch.bfloat16)
    a, dy = torch.empty(rows, F, dtype=torch.bfloat16), torch.empty(rows, D, dtype=torch.bfloat16)
    dh = torch.empty(rows, 2 * F, dtype=torch.bfloat16)

    def launches():
        gemms = TritonGemms(counts)
        with tuning.tma_loads(tma):
            gemms.up(x, idx, w_up, None)
            gemms.down(a, w_down, None)
            gemms.grad_weight(a, dy, None, torch.bfloat16)
            gemms.grad_rows(dy, w_down.transpose(1, 2), torch.bfloat16)
            gemms.grad_weight(x, dh, idx, torch.bfloat16)
            gemms.grad_rows(dh, w_up.transpose(1, 2), torch.float32)

    gemms = (triton_src.grouped_gemm_kernel, triton_src.grouped_wgrad_kernel)  # not the row tile maps
    kernels = dict(zip(MLP_LAUNCHES, compile_as_launched(capability, launches, monkeypatch, gemms), strict=True))
    shared = {name: k.metadata.shared for name, k in kernels.items()}
    # the same operand buffers everywhere (the tiles are the same size); a TMA-loaded
    # operand adds its barriers, 8 bytes a stage
    assert max(shared.values()) - min(shared.values()) < 256, shared
    cap = (capability // 10, capability % 10)
    for name, kernel in kernels.items():
        which = "wgrad" if "weight gradient" in name else "gemm"
        tile = tuning.default_tile(cap, torch.bfloat16, which, 2048)
        per_stage = tile.smem_bytes(which, 2) // tile.num_stages
        # Ampere's pipeline buffers stages - 1 tiles of operands, Hopper's all of them
        assert kernel.metadata.shared >= per_stage * (tile.num_stages - (capability < 90)), (name, shared)
        assert "cp.async" in kernel.asm["ptx"], name
        # Hopper's asynchronous warpgroup MMA, one group left in flight while the next issues
        # (Ampere's mma.sync there would cap the GEMM well under the card's peak)
        tensor_core = "wgmma.mma_async" if capability >= 90 else "mma.sync"
        assert tensor_core in kernel.asm["ptx"], name
        if capability >= 90:
            assert "wgmma.wait_group.sync.aligned 1" in kernel.asm["ptx"], name
        usage = resource_usage(kernel)
        assert usage["LOCAL"] == 0 and usage["STACK"] == 0, (name, usage)
    if tma:  # the down GEMM's rows and weights, the gathered weight gradient's dy
        assert "cp.async.bulk.tensor" in kernels["down"].asm["ptx"]
        assert "cp.async.bulk.tensor" in kernels["up's weight gradient (gathered)"].asm["ptx"]


def test_the_elementwise_kernels_move_16_bytes_an_access(fresh_cache, monkeypatch):
    """The memory-bound kernels beside the GEMMs (SwiGLU both ways, the cross-entropy rows,
    RMSNorm both ways, the rotary embedding), compiled for sm90 in bf16 as launched at model
    widths: their rows move in 128-bit loads and stores (a narrower access would multiply
    the memory transactions of a kernel whose whole cost is its bytes), no register spills."""
    import re

    need_ptxas()
    monkeypatch.setenv("TRITON_CACHE_DIR", fresh_cache)
    bf16 = torch.bfloat16
    rows, F, D, V = 4096, 1024, 4096, 32768
    h, g = torch.empty(rows, 2 * F, dtype=bf16), torch.empty(rows, F, dtype=bf16)
    x, w = torch.empty(rows, D, dtype=bf16), torch.empty(D, dtype=torch.float32)
    q, cos = torch.empty(2, 16, 2048, 128, dtype=bf16), torch.empty(2048, 64)

    def launches():
        launch.swiglu(h)
        launch.swiglu_backward(h, g)
        launch.cross_entropy_rows(torch.empty(64, V, dtype=bf16), torch.zeros(64, dtype=torch.long), True)
        launch.rms_norm_forward(x, w, 1e-6, bf16)
        launch.rms_norm_backward(x, x, w, torch.empty(rows))
        launch.rotary(q, cos, cos)

    names = ("swiglu", "swiglu backward", "cross-entropy", "rms norm", "rms norm backward", "rotary")
    for name, kernel in zip(names, compile_as_launched(90, launches, monkeypatch), strict=True):
        ptx = kernel.asm["ptx"]
        loads, stores = re.findall(r"ld\.global[\w.]*", ptx), re.findall(r"st\.global[\w.]*", ptx)
        assert any(".v4.b32" in op for op in loads) and any(".v4.b32" in op for op in stores), (name, loads, stores)
        usage = resource_usage(kernel)
        assert usage["LOCAL"] == 0 and usage["STACK"] == 0, (name, usage)
