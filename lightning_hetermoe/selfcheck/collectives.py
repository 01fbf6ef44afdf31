"""One-rank EP, zebra and data-centric training on a real process group: every collective
carries its tensors where its traffic kind says, in sequences NCCL would accept (data-centric's
gathers and reduce-scatters are the single-tensor collectives torch renamed in 2.12)."""

from __future__ import annotations

import os
from collections import Counter
from typing import Any, Callable, Sequence

from .report import Context, Failed, joined
from .runs import data, loopback_plan, one_run, through_the_exchange, tiny_model


def _traffic_problems(calls: Sequence[Any], compute: str) -> list[str]:
    import lightning_hetermoe.comm as comm

    out = []
    for c in calls:
        if c.traffic == comm.DEVICE and c.device != compute:
            out.append(f"{c.what} (device traffic) carried a tensor on {c.device}, the compute device is {compute}")
        if c.traffic == comm.HOST and c.device not in ("", "cpu"):
            out.append(f"{c.what} (host traffic) carried a tensor on {c.device}, not the CPU")
    return out


def _count_by_what(calls: Sequence[Any]) -> str:
    counts = Counter(c.what for c in calls)
    return ", ".join(f"{what} {n}" for what, n in sorted(counts.items()))


def check_collectives(mode: str) -> Callable[[Context], str]:
    # what each mode must issue (a name, or the family of a name and its ".<layer>" parts)
    expected = {"ep": {"ep.rows"}, "zebra": {"zebra.rows", "zebra.answers"},
                "datacentric": {"datacentric.gather", "datacentric.grads"}}[mode]

    def check(ctx: Context) -> str:
        from lightning.pytorch.callbacks import ModelCheckpoint

        import lightning_hetermoe.comm as comm

        plan = loopback_plan(ctx) if mode == "zebra" else None
        ckpt = ModelCheckpoint(dirpath=os.path.join(ctx.workdir, f"ckpt-{mode}"), every_n_train_steps=1,
                               save_top_k=-1)
        with comm.record() as calls:
            exchange = [through_the_exchange()] if mode == "ep" else []
            with one_run(ctx, f"collectives-{mode}", mode, plan, max_steps=2, limit_val_batches=1,
                          enable_checkpointing=True, callbacks=[ckpt, *exchange]) as (strategy, trainer):
                trainer.fit(tiny_model(), datamodule=data())
                compute = str(strategy.root_device)
                schedule = strategy.schedule
        problems = _traffic_problems(calls, compute) + comm.check_sequences([calls])
        missing = {e for e in expected if not any(c.what == e or c.what.startswith(e + ".") for c in calls)}
        if missing:  # without them the check above would be vacuous
            problems.append(f"no {', '.join(sorted(missing))} collective was issued")
        if schedule != mode:
            problems.append(f"the strategy ran {schedule!r}, not {mode!r}")
        if problems:
            raise Failed(joined(problems))
        return f"{len(calls)} collectives on {compute}: {_count_by_what(calls)}"

    return check
