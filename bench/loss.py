"""The LM head's loss: whole logits beside a chunk of tokens at a time (``model/loss.py``).

    python bench/loss.py                                  # D1's head (d 1024, 32K vocabulary), 4096 tokens, CPU
    python bench/loss.py --model qwen3_30b_a3b --tokens 2048
    python bench/loss.py --device cuda --dtype bf16 --tokens 16384 --json loss.json   # on a GPU

One micro-batch's head and cross-entropy, forward and backward, on random hidden states and
targets at the model's width and vocabulary (``conf/model/<model>``), two ways, side by
side in this process on ``--device``: ``F.cross_entropy(F.linear(h, W).float(), t)`` (the
pack's loss until 2026-11-28, and what most training code runs) and
``linear_cross_entropy`` at the model's ``loss_chunk_tokens``; on CUDA, where each chunk's
rows run on one Triton kernel (``kernels/cross_entropy.py``), a third row runs the chunked
loss on torch's ops instead (``chunked, torch's ops``: what the kernel saves). For each: the median seconds
over ``--repeats`` (CUDA synchronised), the largest tensor any operation allocated, the
bytes every aten call read and wrote apart from the GEMMs' (the elementwise traffic a GPU
streams at its bandwidth; the GEMMs are the same FLOPs both ways; a gather, a scatter or
the NLL counted at the entries they touch), and the loss and both
gradients against the first's. Then the ratios. The last line is JSON.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from clip_norm import ROOT, Traffic, emit
from lightning_hetermoe.configs import ModelConfig, from_cfg
from lightning_hetermoe.model.loss import linear_cross_entropy

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
GEMMS = ("aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.linear.default", "aten.matmul.default")


def _gather(args, out):  # reads one input element per index
    return args[2].numel() * (args[0].element_size() + args[2].element_size() + out.element_size())


def _scatter(args, out):  # reads and writes one element of self per index
    return args[2].numel() * (args[3].element_size() + 2 * args[0].element_size() + args[2].element_size())


def _nll(args, out):  # reads the targets' entries
    return args[1].numel() * (args[0].element_size() + args[1].element_size())


def _nll_backward(args, out):  # writes the whole gradient (zeros), then one entry per target
    grad = out if isinstance(out, torch.Tensor) else out[0]
    return grad.numel() * grad.element_size() + args[2].numel() * args[2].element_size()


# Operations that touch some entries of a large tensor: what they touch, not the tensor
# (``Traffic`` counts every argument whole, right for the elementwise ones).
def _rows(args, out):  # the cross-entropy kernel: reads the logits twice, writes them once for the gradient
    return args[0].numel() * args[0].element_size() * (3 if args[2] else 2)


INDEXED = {"aten.gather.default": _gather, "aten.scatter_add_.default": _scatter, "aten.scatter_add.default": _scatter,
           "aten.nll_loss_forward.default": _nll, "aten.nll_loss_backward.default": _nll_backward,
           "lightning_hetermoe.cross_entropy_rows.default": _rows}


class ElementwiseTraffic(Traffic):
    """:class:`clip_norm.Traffic` less the GEMMs' own reads and writes, with indexed
    operations counted at the entries they touch."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name not in GEMMS and name not in INDEXED:
            return super().__torch_dispatch__(func, types, args, kwargs)
        out = func(*args, **(kwargs or {}))
        if name in INDEXED:
            self.bytes += INDEXED[name](args, out)
        if not name.endswith("_.default"):  # a fresh result (the head's logits among them)
            self.largest = max([self.largest] + [t.numel() * t.element_size()
                                                 for t in (out if isinstance(out, (list, tuple)) else [out])
                                                 if isinstance(t, torch.Tensor)])
        return out


def whole(h, w, t, chunk):
    return F.cross_entropy(F.linear(h, w).float(), t, ignore_index=-100)


def chunked(h, w, t, chunk):
    return linear_cross_entropy(h, w, t, -100, chunk)


def chunked_on_ops(h, w, t, chunk):
    from lightning_hetermoe.kernels import cross_entropy

    with cross_entropy.fused(False):
        return linear_cross_entropy(h, w, t, -100, chunk)


CONTENDERS = {"whole logits (F.cross_entropy)": whole, "chunked (linear_cross_entropy)": chunked}
ON_CUDA = {"chunked, torch's ops": chunked_on_ops}  # where the kernel runs: the ops beside it


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="d1")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens in the micro-batch")
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES), help="autocast dtype (fp32: none)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--json", help="also write the last line's JSON here")
    args = ap.parse_args()
    cfg = from_cfg(ModelConfig, OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "model" / f"{args.model}.yaml")))
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    g = torch.Generator(device="cpu").manual_seed(0)
    h0 = torch.randn(args.tokens, cfg.d_model, generator=g).to(device)
    w0 = (torch.randn(cfg.vocab_size, cfg.d_model, generator=g) / cfg.d_model ** 0.5).to(device)
    t = torch.randint(0, cfg.vocab_size, (args.tokens,), generator=g).to(device)
    dtype = DTYPES[args.dtype]
    print(f"{args.model}: d {cfg.d_model}, vocabulary {cfg.vocab_size}, {args.tokens} tokens, chunks of "
          f"{cfg.loss_chunk_tokens}, {args.dtype} on {device}", flush=True)

    def run(fn):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = fn(h, w, t, cfg.loss_chunk_tokens)
        loss.backward()
        return loss.detach(), h.grad, w.grad

    rows, first = {}, None
    contenders = {**CONTENDERS, **(ON_CUDA if device.type == "cuda" else {})}
    for name, fn in contenders.items():
        run(fn)  # warm-up
        times = []
        for _ in range(args.repeats):
            sync()
            t0 = time.perf_counter()
            run(fn)
            sync()
            times.append(time.perf_counter() - t0)
        with ElementwiseTraffic() as traffic:
            got = run(fn)
        first = first or got

        def rel(a, b):
            return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))
        rows[name] = {"s": statistics.median(times), "largest_alloc_bytes": traffic.largest,
                      "elementwise_bytes_per_logit": traffic.bytes / (args.tokens * cfg.vocab_size),
                      "loss": float(got[0]), "loss_rel_diff_from_first": rel(got[0], first[0]),
                      "grad_h_rel_diff_from_first": rel(got[1], first[1]),
                      "grad_w_rel_diff_from_first": rel(got[2], first[2])}
        r = rows[name]
        print(f"{name:32} {r['s'] * 1e3:9.1f} ms   largest allocation {r['largest_alloc_bytes'] / 2**20:8.1f} MiB   "
              f"{r['elementwise_bytes_per_logit']:5.1f} B per logit besides the GEMMs   gradients "
              f"{max(r['grad_h_rel_diff_from_first'], r['grad_w_rel_diff_from_first']):.1e} from the first's",
              flush=True)
    a, b = list(rows.values())[:2]
    ratios = {"time_whole_over_chunked": a["s"] / b["s"],
              "largest_alloc_whole_over_chunked": a["largest_alloc_bytes"] / b["largest_alloc_bytes"],
              "elementwise_bytes_whole_over_chunked": a["elementwise_bytes_per_logit"] / b["elementwise_bytes_per_logit"]}
    print(f"  whole logits: {ratios['time_whole_over_chunked']:.2f}x the chunked loss's time, "
          f"{ratios['largest_alloc_whole_over_chunked']:.1f}x its largest allocation, "
          f"{ratios['elementwise_bytes_whole_over_chunked']:.2f}x its elementwise bytes")
    if "chunked, torch's ops" in rows:
        c = rows["chunked, torch's ops"]
        ratios["time_ops_over_kernel"] = c["s"] / b["s"]
        ratios["elementwise_bytes_ops_over_kernel"] = c["elementwise_bytes_per_logit"] / b["elementwise_bytes_per_logit"]
        print(f"  chunked on torch's ops: {ratios['time_ops_over_kernel']:.2f}x the kernel's time, "
              f"{ratios['elementwise_bytes_ops_over_kernel']:.2f}x its elementwise bytes")
    emit({"model": args.model, "tokens": args.tokens, "dtype": args.dtype, "device": str(device),
          "loss_chunk_tokens": cfg.loss_chunk_tokens, "rows": rows, "ratios": ratios, "work_done_at": time.time()},
         args.json)


if __name__ == "__main__":
    from lightning_hetermoe.process_exit import run_and_exit

    run_and_exit(main)  # no finalization: its collections walk every object torch and Lightning made
