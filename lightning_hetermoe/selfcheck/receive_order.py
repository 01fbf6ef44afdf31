"""A receive into a freshly allocated buffer behind a long queued kernel (CUDA)."""

from __future__ import annotations

import torch

from .report import Context, Failed


def check_receive_order(ctx: Context) -> str:
    """A receive posted into a freshly allocated buffer behind a long queued kernel: the
    buffer is likely the block a queued kernel still reads; the communication stream must
    wait for it (``comm.issuing``), or the kernel reads what arrived."""
    import torch.distributed as dist

    from .. import comm

    started_here = not dist.is_initialized()
    if started_here:
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=ctx.device)
    try:
        comm.configure(ctx.device)
        n = 1 << 24
        old = torch.ones(n, device=ctx.device)
        torch.cuda._sleep(200_000_000)  # ~0.1 s of spinning ahead of the read, on the compute stream
        total = old.sum()  # queued: reads the block after the spin
        del old  # the block goes back to the allocator while the read is still queued
        buffer = torch.empty(n, device=ctx.device)
        sent = torch.full((n,), 2.0, device=ctx.device)
        with comm.issuing(after=[sent]):
            pending = comm.all_to_all(comm.world(), buffer, sent, [n], [n], what="selfcheck.receive", async_op=True)
        pending.wait()
        got, arrived = float(total), float(buffer[0])
    finally:
        comm.forget()
        if started_here:
            dist.destroy_process_group()
    detail = f"a kernel queued behind 0.1 s read {got:,.0f} of {n:,} ones; the receive brought {arrived:g}s"
    if got != n or arrived != 2.0:
        raise Failed(detail)
    return detail
