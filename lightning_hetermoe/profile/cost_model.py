"""Analytic cost model: task durations from a :class:`DeviceSpec` when nothing is measured.

Every kernel is a roofline ``max(flops / sustained_flops, bytes / sustained_bandwidth)``
where *sustained* is peak times the device's efficiency factor. Three kernel classes:

* **GEMMs** (QKV/O projections, router, expert MLPs, LM head): ``2·m·k·n`` FLOPs at
  ``fp16_tflops · gemm_efficiency``; operands and result move once through memory.
* **Attention core** (``softmax(QKᵀ)V``): ``4·S²·d`` FLOPs per sequence of length ``S``.
  FlashAttention-class kernels (``flash_attention=True``) skip the masked upper triangle
  of causal attention (half the FLOPs) and run at ``attn_efficiency`` of peak. Devices
  without them (V100, T4) run the memory-efficient tiled kernel, which has no block
  skipping in the versions the paper used (full ``S²``) and a lower efficiency. Memory
  stays O(S) in both, so long sequences fit. ``n_heads`` only fixes the head dimension;
  the kernel's FLOPs do not depend on the split.
* **Elementwise** work (norms, rotary, residuals, activation, softmax of the LM head) is
  bandwidth-bound: bytes over ``mem_bw_gbps · bw_efficiency``.

Calibration (the derivation of the efficiency factors in ``devices.py``). The paper
reports, per device pair, throughput ratios on the expert MLP and on attention+router:

* Experts are large GEMMs, so the ratio is ``peak·gemm_eff`` of one over the other.
  V100/A40 ≈ 0.8: with A40 at 0.68 (its 300 W cap holds clocks well below boost),
  V100 lands at 0.60 once the bandwidth-bound SwiGLU elementwise pass is counted.
  L40S/T4 ≈ 7: with L40S at 0.70, T4 lands at 0.46 (the 70 W T4 never holds boost
  clocks, and its 320 GB/s makes the elementwise pass relatively expensive).
* Attention per token costs ``8d²`` projection FLOPs (flat in S) plus ``2·S·d`` core
  FLOPs (flash, causal) or ``4·S·d`` (non-flash); the core dominates at long S, so the
  ratio rises from the GEMM ratio (~1.25× A40/V100) toward
  ``2·peak_new·attn_eff_new / (peak_old·attn_eff_old)``. With FlashAttention-2 at 0.55 of
  peak on A40/L40S, A40/V100 ≈ 3.7× at 64K gives V100 ``attn_eff ≈ 0.34`` and L40S/T4 ≈
  13.6× at 64K gives T4 ``attn_eff ≈ 0.42``. The 4K point (L40S/T4 ≈ 9.9×) is then a
  prediction, not a fit (we get ≈ 8.6×, inside the ±20% band). tests/test_cost_model.py
  checks all five ratios within ±20% on the paper's D-series layer shape (d=1024, 16 heads).

Backward: a GEMM's backward is two GEMMs of the same size (2× forward). With activation
checkpointing the forward is recomputed before the backward, so a backward task costs
``(2 + 1)×`` its forward (``recompute`` factor 1).

Precision (Lightning's string): ``16-mixed`` and ``bf16-mixed`` run GEMMs and the fused
attention core on tensor cores (``fp16_tflops``) and move 2 bytes per value (the paper
trained in fp16, and the calibration above is in fp16). ``32-true`` moves 4 bytes per value
and runs GEMMs at the TF32 tensor-core peak where the device has TF32 and ``tf32`` allows
it (torch's ``float32_matmul_precision``), else at the CUDA cores' fp32 peak, and so does
the attention core (PyTorch's memory-efficient kernel takes fp32 and skips masked blocks
like FlashAttention: the kernel's shape stays, its peak changes). The efficiency factors
are the fp16 ones for every precision, so compute-bound work scales by the ratio of the
peaks and bandwidth-bound work by the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..cluster.spec import LinkConfig
from ..cluster.devices import DeviceSpec, precision_dtype_bytes
from ..configs import OptimConfig

# What one clipped optimizer step streams per fp32 parameter, as bench/optimizer_step.py
# counts it (every tensor an aten call reads, and every one it may write): the clip's
# global norm reads each gradient once; torch's fused step takes the clip's coefficient as
# its gradient divisor and reads and writes the weight, the gradient and the optimizer's
# state in one kernel; torch's multi-tensor step (its default on a GPU) needs the
# gradients scaled first, then makes several passes, one more with weight decay (Adam's
# L2 term two). Keyed by the ``optim`` config's name, ``sgd`` with momentum apart.
CLIP_NORM_BYTES = 4.0
CLIP_SCALE_BYTES = 8.0
FUSED_STEP_BYTES = {"adamw": 32.0, "adam": 32.0, "sgd_momentum": 24.0, "sgd": 16.0}
MULTI_TENSOR_STEP_BYTES = {  # (without weight decay, with it)
    "adamw": (76.0, 84.0), "adam": (76.0, 88.0), "sgd_momentum": (32.0, 44.0), "sgd": (12.0, 24.0)}


def optimizer_step_traffic(optim: OptimConfig | None) -> float:
    """Bytes per parameter a clipped step of ``optim`` streams (see above): fused where
    ``optim.fused`` is true or ``auto`` (which the pack's model resolves to torch's fused
    step under ``HeterMoEStrategy``, whose precision plugin clips for it), else torch's
    multi-tensor step behind the clip's scaling. ``None`` (an optimizer of the user's own):
    AdamW's multi-tensor step, torch's default, without weight decay."""
    if optim is None:
        return CLIP_NORM_BYTES + CLIP_SCALE_BYTES + MULTI_TENSOR_STEP_BYTES["adamw"][0]
    key = "sgd_momentum" if optim.name == "sgd" and optim.momentum > 0 else optim.name
    if optim.fused in (True, "auto"):
        return CLIP_NORM_BYTES + FUSED_STEP_BYTES[key]
    return CLIP_NORM_BYTES + CLIP_SCALE_BYTES + MULTI_TENSOR_STEP_BYTES[key][optim.weight_decay > 0]


def tf32_allowed(precision: str) -> bool:
    """Whether a run at ``precision`` has its fp32 matmuls on TF32 tensor cores: only
    ``32-true`` computes in fp32, and there as torch allows in this process (read the way
    the kernels read it, so the plan prices what they run; torch is imported only then)."""
    if precision != "32-true":
        return False
    from ..kernels.availability import tf32_enabled

    return tf32_enabled()


@dataclass(frozen=True)
class CostModel:
    """Durations (seconds) of the tasks the planner and simulator schedule."""

    precision: str = "16-mixed"
    # 32-true only: GEMMs on TF32 tensor cores where the device has them
    tf32: bool = False
    # Whether a block's backward recomputes its forward first (+1 forward). None: as the
    # timed model says (its ``activation_checkpointing``; a timer fills it in), so a plan
    # prices what the run will do and the memory model assumes the same. A CostModel asked
    # directly with None prices no recomputation.
    activation_checkpointing: bool | None = None
    causal: bool = True
    # Backward of a kernel relative to its forward (dgrad + wgrad).
    backward_factor: float = 2.0
    # Bytes per fp32 parameter the clipped optimizer step streams: 36 for the pack's default
    # (fused AdamW, the clip folded into the step); the run's optimizer's from
    # :func:`optimizer_step_traffic` where the planner or the run's clock knows it.
    optimizer_bytes_per_param: float = 36.0

    def __post_init__(self) -> None:
        precision_dtype_bytes(self.precision)  # a clear error for an unknown precision

    @property
    def dtype_bytes(self) -> int:
        """Bytes per value computed, and per value sent where activations and weights travel
        (token rows, gathered expert weights: in the autocast dtype under mixed precision)."""
        return precision_dtype_bytes(self.precision)

    @property
    def grad_bytes(self) -> int:
        """Bytes per value of a gradient sync (all-reduces, reduce-scatters): the weights are
        fp32 masters at every precision here, and their gradients are summed in fp32."""
        return 4

    def _peak(self, dev: DeviceSpec) -> float:
        """FLOP/s of the dense peak this precision runs at (before efficiency)."""
        return dev.peak_tflops(self.precision, self.tf32) * 1e12

    def describe(self) -> str:
        """The precision and what it runs on, for tables (``16-mixed (fp16 tensor cores)``)."""
        if self.dtype_bytes == 2:
            kind = "bf16" if self.precision.startswith("bf16") else "fp16"
            return f"{self.precision} ({kind} tensor cores)"
        return f"{self.precision} ({'TF32 tensor cores where the device has them' if self.tf32 else 'fp32 CUDA cores'})"

    # ---- kernels -------------------------------------------------------------------------
    def gemm_time(self, dev: DeviceSpec, m, k: float, n: float):
        """Roofline time of an ``[m,k] @ [k,n]`` GEMM; ``m`` a number, or an array of them
        (the same arithmetic in the same order: each element to the last bit the number's)."""
        if not isinstance(m, np.ndarray) and m <= 0:
            return 0.0
        flops = 2.0 * m * k * n
        nbytes = self.dtype_bytes * (m * k + k * n + m * n)
        if isinstance(m, np.ndarray):
            return np.where(m > 0, np.maximum(flops / (self._peak(dev) * dev.gemm_efficiency), nbytes / dev.stream_bw),
                            0.0)
        return max(flops / (self._peak(dev) * dev.gemm_efficiency), nbytes / dev.stream_bw)

    def elementwise_time(self, dev: DeviceSpec, nbytes: float) -> float:
        return nbytes / dev.stream_bw

    def attention_core_time(self, dev: DeviceSpec, *, tokens: float, seq_len: int, d_model: int,
                            kv_width: int | None = None) -> float:
        """``softmax(QKᵀ)V`` for ``tokens`` tokens cut into sequences of ``seq_len``, the
        queries ``d_model`` wide (all heads together), the keys and values ``kv_width``
        (grouped-query attention's fewer heads; ``None``: as wide as the queries)."""
        if tokens <= 0:
            return 0.0
        kv_width = d_model if kv_width is None else kv_width
        n_seq = tokens / seq_len
        flops = 4.0 * seq_len * seq_len * d_model * n_seq
        if dev.flash_attention and self.causal:
            flops *= 0.5  # causal block skipping
        # Q, K, V read and O written once (tiled kernels keep S×S on chip).
        nbytes = 2 * tokens * (d_model + kv_width) * self.dtype_bytes
        return max(flops / (self._peak(dev) * dev.attn_efficiency), nbytes / dev.stream_bw)

    def _bwd(self, fwd: float) -> float:
        return fwd * (self.backward_factor + (1.0 if self.activation_checkpointing else 0.0))

    # ---- tasks ---------------------------------------------------------------------------
    def attention_time(
        self,
        dev: DeviceSpec,
        *,
        tokens: float,
        seq_len: int,
        d_model: int,
        n_heads: int,
        num_experts: int = 8,
        backward: bool = False,
        shared_d_ff: int = 0,
        shared_activation: str = "swiglu",
        shared_gate: bool = False,
        kv_heads: int | None = None,
        head_dim: int | None = None,
    ) -> float:
        """Attention block + router of one layer for one micro-batch of ``tokens`` tokens, and
        the layer's shared expert where it has one (``shared_d_ff``: every token's dense MLP,
        run beside the router where attention runs; ``shared_gate``: scaled by a per-token
        sigmoid gate, Qwen2-MoE's). ``kv_heads``: grouped-query attention's key/value heads
        (``None``: ``n_heads``); ``head_dim``: each head's width (``None``: ``d_model /
        n_heads``; wider heads widen the queries, the core and the output projection)."""
        if seq_len < 1 or (head_dim is None and d_model % max(n_heads, 1) != 0):
            raise ValueError(
                f"attention_time: need seq_len >= 1 and d_model % n_heads == 0 (or a head_dim), got {seq_len}, "
                f"{d_model}, {n_heads}"
            )
        if tokens <= 0:
            return 0.0
        d = d_model
        hd = d // n_heads if head_dim is None else head_dim
        width, kv_width = n_heads * hd, (n_heads if kv_heads is None else kv_heads) * hd
        t = self.gemm_time(dev, tokens, d, width + 2 * kv_width)  # QKV
        t += self.gemm_time(dev, tokens, width, d)  # output projection
        if num_experts:  # none: a dense layer's (see dense_layer_time)
            t += self.gemm_time(dev, tokens, d, num_experts)  # router
        t += self.attention_core_time(dev, tokens=tokens, seq_len=seq_len, d_model=width, kv_width=kv_width)
        # Two RMSNorms, rotary, two residual adds, router softmax/top-k: ~12 passes of [t, d].
        t += self.elementwise_time(dev, 12 * tokens * d * self.dtype_bytes)
        if shared_d_ff:
            t += self._mlp_time(dev, tokens, d, shared_d_ff, shared_activation)[0]
            t += self.elementwise_time(dev, 2 * tokens * d * self.dtype_bytes)  # its output added to the layer's
            if shared_gate:
                t += self.gemm_time(dev, tokens, d, 1) + self.elementwise_time(dev, 2 * tokens * d * self.dtype_bytes)
        t += dev.launch_overhead_s
        return self._bwd(t) if backward else t

    def dense_layer_time(self, dev: DeviceSpec, *, tokens: float, seq_len: int, d_model: int, n_heads: int,
                         d_ff: int, activation: str = "swiglu", backward: bool = False, kv_heads: int | None = None,
                         head_dim: int | None = None) -> float:
        """One dense decoder layer (attention and one dense MLP every token passes through,
        no router) for one micro-batch of ``tokens`` tokens."""
        return self.attention_time(dev, tokens=tokens, seq_len=seq_len, d_model=d_model, n_heads=n_heads,
                                   num_experts=0, backward=backward, shared_d_ff=d_ff, shared_activation=activation,
                                   kv_heads=kv_heads, head_dim=head_dim)

    def _mlp_time(self, dev: DeviceSpec, tokens, d_model: int, d_ff: int, activation: str):
        """An MLP's forward on ``tokens`` tokens (a number, or an array of them), and its
        up-projection's share of it."""
        if activation == "swiglu":
            up = self.gemm_time(dev, tokens, d_model, 2 * d_ff)
            t = up + self.gemm_time(dev, tokens, d_ff, d_model)
            return t + self.elementwise_time(dev, 3 * tokens * d_ff * self.dtype_bytes), up
        if activation == "gelu":
            up = self.gemm_time(dev, tokens, d_model, d_ff)
            t = up + self.gemm_time(dev, tokens, d_ff, d_model)
            return t + self.elementwise_time(dev, 2 * tokens * d_ff * self.dtype_bytes), up
        raise ValueError(f"an MLP's activation={activation!r} is not one of ('swiglu', 'gelu')")

    def expert_time(
        self,
        dev: DeviceSpec,
        *,
        tokens: float,
        d_model: int,
        d_ff: int,
        activation: str = "swiglu",
        backward: bool = False,
        recompute_hidden: bool = False,
    ) -> float:
        """One expert MLP on ``tokens`` tokens (weights read once even for few tokens).
        ``recompute_hidden`` (``moe.recompute_activation``): its backward forms the hidden
        activation again, the up-projection once more (within a checkpointed block's
        recomputation already). ``tokens`` may be an array (every expert of a layer at a
        measured routing at once): each element as the number would give it."""
        many = isinstance(tokens, np.ndarray)
        if not many and tokens <= 0:
            return 0.0
        if activation not in ("swiglu", "gelu"):
            raise ValueError(f"expert_time: activation={activation!r} is not one of ('swiglu', 'gelu')")
        t, up = self._mlp_time(dev, tokens, d_model, d_ff, activation)
        t = t + dev.launch_overhead_s
        if backward:
            again = up if recompute_hidden and not self.activation_checkpointing else 0.0
            t = self._bwd(t) + again
        return np.where(tokens > 0, t, 0.0) if many else t

    def head_time(self, dev: DeviceSpec, *, tokens: float, d_model: int, vocab_size: int,
                  forward_only: bool = False) -> float:
        """Final norm + LM head + cross-entropy, forward and backward (not checkpointed);
        ``forward_only`` for evaluation."""
        if tokens <= 0:
            return 0.0
        fwd = self.gemm_time(dev, tokens, d_model, vocab_size)
        # Logits in fp32 for a stable loss: written, read by softmax, gradient written.
        ew = self.elementwise_time(dev, (2 if forward_only else 3) * tokens * vocab_size * 4)
        gemms = fwd if forward_only else fwd * (1.0 + self.backward_factor)
        return gemms + ew + dev.launch_overhead_s

    def optimizer_time(self, dev: DeviceSpec, n_params: float) -> float:
        return self.elementwise_time(dev, n_params * self.optimizer_bytes_per_param)

    # ---- communication -------------------------------------------------------------------
    @staticmethod
    def comm_time(nbytes: float, link: LinkConfig) -> float:
        """Point-to-point/all-to-all leg: latency + bytes over the per-rank link bandwidth."""
        if nbytes <= 0:
            return 0.0
        return link.latency_us * 1e-6 + nbytes * 8.0 / (link.bandwidth_gbps * 1e9)

    @staticmethod
    def allreduce_time(nbytes: float, n_ranks: int, link: LinkConfig) -> float:
        """Ring all-reduce: each rank moves ``2(n-1)/n`` of the buffer in ``2(n-1)`` steps."""
        if n_ranks <= 1 or nbytes <= 0:
            return 0.0
        steps = 2 * (n_ranks - 1)
        return steps * link.latency_us * 1e-6 + (steps / n_ranks) * nbytes * 8.0 / (link.bandwidth_gbps * 1e9)
