"""The attention block's elementwise work: RMSNorm and the rotary embedding, on their Triton
kernels beside torch's ops, forward and backward.

    python bench/norm_rotary.py --device cuda --json norm_rotary.json    # on a GPU (D1's widths)
    python bench/norm_rotary.py --tokens 512                             # the CPU: torch's ops twice

One micro-batch at a model's widths (``conf/model/<model>``, D1 by default): the pack's
``RMSNorm`` over ``[tokens, d_model]`` (its input fp32, the residual stream's dtype under
mixed precision; the weight fp32) and ``apply_rotary`` over queries ``[batch, heads, seq,
head_dim]`` in ``--dtype``, laid out as the attention lays them. Each runs forward and
backward under ``kernels.rms_norm.fused`` / ``kernels.rotary.fused`` on and off, interleaved
rep by rep, the median of CUDA-synchronised seconds; then the ratios (torch's ops over the
kernel: > 1, the kernel is faster) and the largest difference of the results. Where the
kernels do not run (the CPU), both columns run torch's ops: the ratios are ~1 and say so.
The last line is JSON.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from omegaconf import OmegaConf

from clip_norm import ROOT, emit
from lightning_hetermoe.configs import ModelConfig, from_cfg
from lightning_hetermoe.kernels import rms_norm, rotary
from lightning_hetermoe.model.transformer import RMSNorm, apply_rotary, rotary_tables

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="d1")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens in the micro-batch")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="the queries' dtype")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--json", help="also write the last line's JSON here")
    args = ap.parse_args(argv)
    cfg = from_cfg(ModelConfig, OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "model" / f"{args.model}.yaml")))
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    seq = min(args.seq_len, args.tokens)
    batch = max(1, args.tokens // seq)
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(batch * seq, cfg.d_model, generator=g).to(device)
    q = torch.randn(batch, seq, cfg.n_heads, cfg.head_size, generator=g).to(device, dtype)
    norm = RMSNorm(cfg.d_model).to(device)
    cos, sin = rotary_tables(seq, cfg.head_size, device)
    up_x, up_q = torch.randn_like(x), torch.randn(batch, cfg.n_heads, seq, cfg.head_size, device=device)

    def run_norm():
        xx = x.clone().requires_grad_()
        y = norm(xx)
        y.backward(up_x.to(y.dtype))
        return y.detach(), xx.grad

    def run_rotary():
        qq = q.clone().requires_grad_()
        y = apply_rotary(qq.transpose(1, 2), cos, sin)
        y.backward(up_q.to(y.dtype))
        return y.detach(), qq.grad

    cases = {"rms_norm": (run_norm, rms_norm), "rotary": (run_rotary, rotary)}
    print(f"{args.model}: d {cfg.d_model}, {cfg.n_heads} heads of {cfg.head_size}, {batch} x {seq} tokens, queries "
          f"{args.dtype}, on {device}; kernels {'run' if device.type == 'cuda' else 'do not run here'}", flush=True)
    rows = {}
    for name, (run, module) in cases.items():
        times = {"kernel": [], "torch_ops": []}
        results = {}
        for rep in range(args.repeats + 1):
            for side, on in (("kernel", True), ("torch_ops", False)):
                with module.fused(on):
                    sync()
                    t0 = time.perf_counter()
                    out = run()
                    sync()
                if rep:  # the first is a warm-up (and compiles)
                    times[side].append(time.perf_counter() - t0)
                results[side] = out
        diff = max(float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))
                   for a, b in zip(results["kernel"], results["torch_ops"]))
        s = {k: statistics.median(v) for k, v in times.items()}
        rows[name] = {"kernel_ms": s["kernel"] * 1e3, "torch_ops_ms": s["torch_ops"] * 1e3,
                      "torch_ops_over_kernel": s["torch_ops"] / s["kernel"], "max_rel_diff": diff}
        r = rows[name]
        print(f"{name:9} kernel {r['kernel_ms']:8.3f} ms   torch's ops {r['torch_ops_ms']:8.3f} ms   "
              f"{r['torch_ops_over_kernel']:.2f}x   results {diff:.1e} apart", flush=True)
    out = {"model": args.model, "tokens": batch * seq, "dtype": args.dtype, "device": str(device),
           "kernels_ran": device.type == "cuda", "rows": rows, "work_done_at": time.time()}
    emit(out, args.json)
    return out


if __name__ == "__main__":
    from lightning_hetermoe.process_exit import run_and_exit

    run_and_exit(main)  # no finalization: its collections walk every object torch and Lightning made
