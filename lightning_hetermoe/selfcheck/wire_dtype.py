"""The dtype of every exchange: under mixed precision, one-rank EP and zebra training send
every row and answer in the 16-bit type the experts compute in, the width the cost model
prices them at (gradient syncs stay fp32 by design: README, "Wire dtype")."""

from __future__ import annotations

from collections import Counter
from typing import Any, Sequence

import torch

from .report import Context, Failed, joined
from .runs import data, loopback_plan, mixed_precision, one_run, through_the_exchange, tiny_model

# The data collectives whose rows the receiver computes in the autocast dtype, per mode.
DATA_COLLECTIVES = {"ep": ("ep.rows",), "zebra": ("zebra.rows", "zebra.answers")}


def judge_wire(calls: Sequence[Any], mode: str, want: torch.dtype, priced_bytes: int) -> str:
    """Pass when every data collective of ``mode`` among ``calls`` (``comm.Call`` rows)
    carried ``want`` and ``want`` is as wide as the price; one at least must have run."""
    data_calls = [c for c in calls if c.what in DATA_COLLECTIVES[mode]]
    seen = Counter((c.what, c.dtype.replace("torch.", "")) for c in data_calls)
    detail = f"{mode}: " + (", ".join(f"{what} {n}x {dtype}" for (what, dtype), n in sorted(seen.items()))
                            or "no data collective")
    problems = [f"{c.what} sent {c.dtype}, not {want}" for c in data_calls if c.dtype != str(want)]
    if not data_calls:
        problems.append(f"no {' or '.join(DATA_COLLECTIVES[mode])} collective was issued")
    if want.itemsize != priced_bytes:
        problems.append(f"the cost model prices rows at {priced_bytes} B, {want} is {want.itemsize} B")
    if problems:
        raise Failed(joined(sorted(set(problems))) + "; " + detail)
    return detail


def check_wire_dtype(ctx: Context) -> str:
    import lightning_hetermoe.comm as comm
    from ..profile import CostModel

    precision = mixed_precision(ctx)
    want = torch.bfloat16 if precision == "bf16-mixed" else torch.float16
    priced = CostModel(precision=precision).dtype_bytes
    details = []
    for mode in DATA_COLLECTIVES:
        plan = loopback_plan(ctx) if mode == "zebra" else None
        with comm.record() as calls:
            exchange = [through_the_exchange()] if mode == "ep" else []
            with one_run(ctx, f"wire-{mode}", mode, plan, max_steps=2, precision=precision,
                         callbacks=exchange) as (_, trainer):
                trainer.fit(tiny_model(), datamodule=data())
        details.append(judge_wire(calls, mode, want, priced))
    return f"{precision}, priced at {priced} B a value; " + "; ".join(details)
