"""Plan a model on a GPU mix and predict a training step per schedule. No GPU needed.

    python recipes/plan.py model=d1 cluster=o1 data.seq_len=32768

Prints the plan and writes ``plan.json``, ``summary.json`` and ``gantt_<schedule>.png``
into the Hydra run directory. Routing is even unless ``plan.expert_load`` names the
``expert_load.json`` a training run of the same model shape wrote (its load monitor's):
the search places experts and every schedule is priced at its shares. The plan prices
the optimizer of ``optim``: its state in memory (``optim=sgd optim.momentum=0.9``: 4 bytes a
parameter where AdamW keeps 8) and its step's traffic in every step's tail (28 bytes a
parameter there where AdamW's fused step streams 36, 88 for AdamW with ``optim.fused=false``),
and ``plan.weight_averages`` copies of the weights (1 for a run with Lightning's
``EMAWeightAveraging`` kept on the GPU).
"""

from __future__ import annotations

import json
import os

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from lightning_hetermoe.cluster import ClusterConfig
from lightning_hetermoe.cluster.devices import PRECISIONS
from lightning_hetermoe.configs import ConfigError, ModelConfig, OptimConfig, from_cfg
from lightning_hetermoe.plan import as_cluster, make_plan
from lightning_hetermoe.plan.progress import watched
from lightning_hetermoe.profile import CostModel, Profile, make_timer
from lightning_hetermoe.profile.cost_model import optimizer_step_traffic, tf32_allowed
from lightning_hetermoe.routing_record import read_routing
from lightning_hetermoe.cluster.devices import check_bf16
from lightning_hetermoe.simulate import draw_gantt, draw_gantt_compare, simulate_plan

PROGRESS_S = 10.0  # a plan running longer says how far it got this often


@hydra.main(config_path="../conf", config_name="plan", version_base="1.3")
def main(cfg: DictConfig) -> dict:
    try:
        return plan_and_predict(cfg, HydraConfig.get().runtime.output_dir)
    except ConfigError as err:
        # A bad value is the user's to fix: one line naming the field, no stack trace.
        raise SystemExit(f"[plan] config error: {err}") from None
    except NoPlan as refused:
        # In a sweep over mixes a mix the model does not fit is a row of the sweep's table
        # (its summary.json says why), not the end of the sweep; a single run exits 1.
        if HydraConfig.get().mode != RunMode.MULTIRUN:
            raise SystemExit(f"[plan] {refused}") from None
        print(f"[plan] {refused}", flush=True)
        return refused.summary


class NoPlan(Exception):
    """The planner refused: nothing fits (its message names why and what would)."""

    def __init__(self, message: str, summary: dict) -> None:
        super().__init__(message)
        self.summary = summary


def plan_and_predict(cfg: DictConfig, out: str) -> dict:
    model = from_cfg(ModelConfig, cfg.model)
    cluster = from_cfg(ClusterConfig, cfg.cluster)
    profile = Profile.from_json(hydra.utils.to_absolute_path(cfg.plan.profile)) if cfg.plan.profile else None
    seq_len, tokens = int(cfg.data.seq_len), int(cfg.data.global_batch_tokens)
    if not 1 <= seq_len <= model.max_seq_len:
        raise ConfigError(f"data.seq_len={seq_len} is invalid: must be in [1, model.max_seq_len={model.max_seq_len}]")
    if tokens < seq_len:
        raise ConfigError(f"data.global_batch_tokens={tokens} is invalid: must be at least one sequence, data.seq_len="
                          f"{seq_len}")
    precision = str(cfg.get("precision", "16-mixed"))
    if precision not in PRECISIONS:
        raise ConfigError(f"precision={precision!r} is invalid: must be one of {PRECISIONS}")
    check_bf16(precision, cluster.specs(), allow_emulated=False)
    optim = from_cfg(OptimConfig, cfg.optim)
    cost = CostModel(precision=precision, tf32=tf32_allowed(precision),
                     optimizer_bytes_per_param=optimizer_step_traffic(optim))
    routing = read_routing(hydra.utils.to_absolute_path(cfg.plan.expert_load), model, "plan.expert_load") \
        if cfg.plan.get("expert_load") else None
    load = routing.mean_share if routing is not None else None
    if routing is not None:
        print(f"routing from {cfg.plan.expert_load}: {routing.steps} steps of model {routing.model!r}, the hottest "
              f"expert {routing.hottest_over_mean():.2f}x the mean (its layer's)")
    # what each parameter costs beside its weight: the optimizer's state and the weight averages
    pricing = dict(optimizer=optim, weight_averages=cfg.plan.get("weight_averages", 0))
    # hundreds to thousands of GPUs take seconds to tens of seconds to plan: say what is under
    # way, and every PROGRESS_S seconds how far it got
    print(f"planning {model.name} on {cluster.name} ({cluster.world_size} GPUs), {tokens // seq_len} sequences of "
          f"{seq_len} tokens per step", flush=True)
    summary = {"model": model.name, "cluster": cluster.name, "seq_len": seq_len, "precision": precision,
               "devices": list(cluster.devices)}
    try:
        with watched(every_s=PROGRESS_S):
            plan = plan_for(cluster, model, seq_len, tokens, profile, cost, load, pricing, cfg)
    except ValueError as err:
        summary["error"] = f"no plan for {model.name} on {cluster.name}: {err}"
        with open(os.path.join(out, "summary.json"), "w") as f:
            json.dump({**summary, "schedules": {}}, f, indent=1)
        raise NoPlan(summary["error"], summary) from None
    print(plan)
    plan.to_json(os.path.join(out, "plan.json"))
    view = as_cluster(cluster)
    timer = make_timer(model, seq_len, profile, cost)
    record = None if routing is None else {"path": str(cfg.plan.expert_load),
                                           "hottest_over_mean": routing.hottest_over_mean()}
    summary.update({"plan": "plan.json", "bound_tokens_per_s": plan.bound_tokens_per_s, "schedules": {},
                    "fastest_predicted": plan.fastest_predicted(), "expert_load": record})
    drawn = {}
    for sched in plan.predicted:
        try:
            res = simulate_plan(plan, view.devices, model, view.topology, timer, schedule=sched, expert_load=load,
                                **pricing)
        except ValueError as err:
            summary["schedules"][sched] = {"error": str(err)}
            continue
        summary["schedules"][sched] = res.summary()
        if sched in cfg.plan.gantt and res.timeline is not None:
            path = draw_gantt(
                res,
                os.path.join(out, f"gantt_{sched}.png"),
                title=f"{sched}: {model.name} on {cluster.name}, seq {seq_len}, {res.tokens_per_s:,.0f} tokens/s",
            )
            summary["schedules"][sched]["gantt"] = os.path.basename(path)
            drawn[sched] = res
    if len(drawn) > 1:
        draw_gantt_compare(drawn, os.path.join(out, "gantt_compare.png"),
                           title=f"{model.name} on {cluster.name}, seq {seq_len}: the same step under each schedule")
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"\nwrote plan.json, summary.json and Gantt charts to {out}")
    return summary


def plan_for(cluster: ClusterConfig, model: ModelConfig, seq_len: int, tokens: int, profile: Profile | None,
             cost: CostModel, load, pricing: dict, cfg: DictConfig):
    """The planner's plan for the recipe's ``plan`` group (``ValueError`` where none fits)."""
    return make_plan(
        cluster,
        model,
        seq_len=seq_len,
        global_batch_tokens=tokens,
        profile=profile,
        asym_ea=cfg.plan.asym_ea,
        num_microbatches=cfg.plan.num_microbatches,
        max_microbatches=cfg.plan.max_microbatches,
        max_waves=cfg.plan.max_waves,
        num_attention_ranks=cfg.plan.num_attention_ranks,
        num_zp_groups=cfg.plan.num_zp_groups,
        require_expert_ranks=cfg.plan.require_expert_ranks,
        shrink_to_fit=2 if cfg.plan.shrink_batch_to_fit else 0,
        cost_model=cost,
        expert_load=load,
        place_at_load=bool(cfg.plan.get("place_at_load", True)),
        **pricing,
    )


if __name__ == "__main__":
    main()
