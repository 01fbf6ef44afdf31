"""Simulate the HeterMoE paper's evaluation and set our numbers beside theirs.

    python recipes/paper.py [clusters=[o1] models=[d1] seq_lens=[16384]]

For every cluster x model x sequence length, plans the model as the paper trained it (fp16,
activation checkpointing: priced in every backward and in memory) with zebra + Asym-EA, and
predicts tokens/s for zebra, DistEP, EP, EP with speed-proportional batches and
EP(Ideal). Writes ``paper_table.csv`` (cluster,model,seq_len,schedule,tokens_per_s) and
``paper_table.md`` (our ratios next to the paper's) into the Hydra run directory.
"""

from __future__ import annotations

import csv
import math
import os
from dataclasses import replace

_HERE = os.path.dirname(os.path.abspath(__file__))

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from lightning_hetermoe.cluster import ClusterConfig
from lightning_hetermoe.configs import ModelConfig, from_cfg
from lightning_hetermoe.plan import as_cluster, make_plan
from lightning_hetermoe.profile import CostModel, make_timer
from lightning_hetermoe.simulate import SCHEDULES, simulate_plan

CONF = os.path.join(os.path.dirname(_HERE), "conf")
PRECISION = "16-mixed"  # the paper trained in fp16: every prediction here prices fp16 tensor cores
COST = CostModel(precision=PRECISION)
PAPER = {
    "zebra_vs_ep_16k": 1.67,
    "zebra_vs_ep_32k": 1.89,
    "zebra_vs_ep_max": 2.3,
    "zebra_vs_ep_ideal": 1.18,
    "zebra_vs_ep_ideal_max": 1.4,
    "distep_of_zebra": 0.55,
    "mixed_of_homogeneous": 0.95,
    "asym_ea_gain_4k": "1.14-1.20",
}


def paper_model(model: ModelConfig) -> ModelConfig:
    """``model`` as the paper trained it: with activation checkpointing (priced in every
    backward, and in memory: each block keeps its input, each expert round its rows)."""
    return replace(model, activation_checkpointing=True)


def load(group: str, name: str) -> dict:
    return OmegaConf.to_container(OmegaConf.load(os.path.join(CONF, group, f"{name}.yaml")), resolve=True)


def run_job(job: tuple) -> dict:
    """Plan one (cluster, model, seq_len). ``kind`` is "main" (free search) or "ablation" (as in
    the paper: FlashAttention-capable GPUs attend, the others serve experts, one ZP group, so
    without Asym-EA nothing leaves the expert ranks unless memory forces it)."""
    cluster_name, model_name, seq_len, tokens, asym, max_mb, max_waves, util, kind = job
    cluster = from_cfg(ClusterConfig, load("cluster", cluster_name))
    model = paper_model(from_cfg(ModelConfig, load("model", model_name)))
    out = {"cluster": cluster_name, "model": model_name, "seq_len": seq_len, "asym_ea": asym, "kind": kind}
    view = as_cluster(cluster)
    n_new = sum(1 for d in view.devices if d.flash_attention)
    fixed = n_new if kind == "ablation" and 0 < n_new < len(view.devices) else None
    groups = 1 if kind == "ablation" else None
    try:  # the largest batch (halving from the configured one) whose activations fit
        # ep_groups="world": the paper's EP baseline, one group over every GPU
        plan = make_plan(cluster, model, seq_len=seq_len, global_batch_tokens=tokens, shrink_to_fit=2, asym_ea=asym,
                         cost_model=COST, ep_groups="world",
                         max_microbatches=max_mb, max_waves=max_waves, num_attention_ranks=fixed,
                         num_zp_groups=groups)
    except ValueError as err:
        out["error"] = str(err)
        return out
    out["global_batch_tokens"] = plan.global_batch_tokens
    nan = float("nan")
    out["tokens_per_s"] = {
        s: (nan if p["tokens_per_s"] is None else p["tokens_per_s"]) for s, p in plan.predicted.items()
    }
    out["R"] = plan.num_microbatches
    out["waves"] = plan.waves
    out["offloaded"] = sum(plan.offloaded())
    if kind == "main":
        out.update(gap(plan, view, model, seq_len))
    if util:
        res = simulate_plan(plan, view.devices, model, view.topology,
                            make_timer(model, seq_len, cost=COST), keep_timeline=False)
        out["utilization"] = res.summary()["utilization_by_device"]
    return out


def gap(plan, view, model, seq_len: int) -> dict:
    """Zebra against the bound (every device busy on the work it is fastest at, no
    communication), and what the rest is made of, from the simulator's per-rank breakdown:
    the communication (the share of the step that links costing nothing would remove),
    idle time (mean over ranks, links free: bubbles and imbalance the schedule leaves), and
    the rest, work done slower than at the bound (devices on work they are not fastest at,
    Asym-EA's experts on attention ranks)."""
    from lightning_hetermoe.cluster import LinkConfig
    from lightning_hetermoe.cluster.topology import Topology

    timer = make_timer(model, seq_len, cost=COST)
    step = simulate_plan(plan, view.devices, model, view.topology, timer, keep_timeline=False).step_time
    free = simulate_plan(plan, view.devices, model, Topology.flat(LinkConfig(bandwidth_gbps=1e9, latency_us=0.0),
                                                                  len(view.devices)), timer, keep_timeline=False)
    of_bound = plan.global_batch_tokens / step / plan.bound_tokens_per_s
    comm = 1.0 - free.step_time / step
    idle = sum(free.idle.values()) / len(free.idle) / step
    return {"bound_tokens_per_s": plan.bound_tokens_per_s, "of_bound": of_bound,
            "gap": {"communication": comm, "idle": idle, "slower_work": max(1.0 - of_bound - comm - idle, 0.0)}}


def geomean(xs: list[float]) -> float:
    xs = [x for x in xs if x and x == x and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def ratio(r: dict, a: str, b: str) -> float:
    t = r.get("tokens_per_s", {})
    x, y = t.get(a, float("nan")), t.get(b, float("nan"))
    return x / y if y and y == y and x == x else float("nan")


NAN = float("nan")


def _rmax(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]
    return max(xs) if xs else NAN


def _by_seq(rs: list[dict], s: int, a: str, b: str) -> float:
    return geomean([ratio(r, a, b) for r in rs if r["seq_len"] == s])


def markdown(results: list[dict], cfg: DictConfig) -> str:
    ok = [r for r in results if "error" not in r]
    main = [r for r in ok if r["kind"] == "main" and r["cluster"] in cfg.clusters]
    # the paper's own testbed (A40 + V100) vs the cloud mixes (L40S + T4)
    families = {
        "all clusters": main,
        "A40+V100 (O1-O3)": [r for r in main if r["cluster"].startswith("o")],
        "L40S+T4 (C1-C2)": [r for r in main if r["cluster"].startswith("c")],
    }
    lines = [
        "# HeterMoE paper evaluation, simulated",
        "",
        f"Cost model + discrete-event simulator, precision {PRECISION} as the paper trained (fp16 with "
        f"loss scaling on V100/T4 and A40/L40S alike). Global batch {cfg.global_batch_tokens:,} tokens/step "
        f"(in up to {cfg.max_waves} waves of gradient accumulation where activations bind; halved where even "
        "that does not fit). Ratios are geometric means over the clusters and models "
        "of each column; tokens/s are in paper_table.csv.",
        "",
    ]
    lines += _claims(ok, families, cfg)
    lines += _homogeneous(ok, cfg)
    lines += _utilisation(ok, cfg)
    lines += _bound_table(main, cfg)
    lines += _by_seq_table(families, cfg)
    lines += _per_model_table(main, cfg)
    lines += _footnotes(results, main, cfg)
    return "\n".join(lines) + "\n"


def _claims(ok: list[dict], families: dict[str, list[dict]], cfg: DictConfig) -> list[str]:
    """The paper's claims, one row each, a column per cluster family."""
    lines = ["| claim | paper | " + " | ".join(families) + " |", "|---|---|" + "---|" * len(families)]

    def row(label: str, paper: str, fn) -> None:
        lines.append(f"| {label} | {paper} | " + " | ".join(fn(rs) for rs in families.values()) + " |")

    row("HeterMoE / EP at 16K", f"{PAPER['zebra_vs_ep_16k']}x", lambda rs: f"{_by_seq(rs, 16384, 'zebra', 'ep'):.2f}x")
    row("HeterMoE / EP at 32K", f"{PAPER['zebra_vs_ep_32k']}x", lambda rs: f"{_by_seq(rs, 32768, 'zebra', 'ep'):.2f}x")
    row("HeterMoE / EP, best case", f"up to {PAPER['zebra_vs_ep_max']}x",
        lambda rs: f"{_rmax([ratio(r, 'zebra', 'ep') for r in rs]):.2f}x")
    row("HeterMoE / EP(Ideal), mean", f"{PAPER['zebra_vs_ep_ideal']}x",
        lambda rs: f"{geomean([ratio(r, 'zebra', 'ep_ideal') for r in rs]):.2f}x")
    row("HeterMoE / EP(Ideal), best case", f"up to {PAPER['zebra_vs_ep_ideal_max']}x",
        lambda rs: f"{_rmax([ratio(r, 'zebra', 'ep_ideal') for r in rs]):.2f}x")
    row("DistEP / HeterMoE", f"{PAPER['distep_of_zebra']:.0%}",
        lambda rs: f"{geomean([ratio(r, 'distep', 'zebra') for r in rs]):.0%}")
    row("HeterMoE, of the throughput bound (HETHUB: 97.49% of its own)", "-",
        lambda rs: f"{geomean([r['of_bound'] for r in rs if 'of_bound' in r]):.1%}")
    if cfg.asym_ablation_seq_len:
        s = int(cfg.asym_ablation_seq_len)
        abl = {(r["cluster"], r["model"], r["asym_ea"]): r for r in ok if r["kind"] == "ablation" and r["seq_len"] == s}

        def gain(rs):
            g = [abl[(r["cluster"], r["model"], True)]["tokens_per_s"]["zebra"]
                 / abl[(r["cluster"], r["model"], False)]["tokens_per_s"]["zebra"]
                 for r in rs
                 if r["seq_len"] == s and (r["cluster"], r["model"], True) in abl
                 and (r["cluster"], r["model"], False) in abl]
            return f"{geomean(g):.2f}x ({min(g, default=NAN):.2f}-{max(g, default=NAN):.2f})" if g else "n/a"

        row(f"Asym-EA gain at {s // 1024}K (paper roles)", PAPER["asym_ea_gain_4k"] + "x", gain)
    return lines


def _homogeneous(ok: list[dict], cfg: DictConfig) -> list[str]:
    """The mixed cluster against the homogeneous one (the paper's "95% of 4xA40")."""
    homo = {(r["cluster"], r["seq_len"]): r for r in ok if r["model"] in cfg.homogeneous.models and r["kind"] == "main"}
    mixed_c, ref_c = cfg.homogeneous.clusters[0], cfg.homogeneous.clusters[1]
    vs_ep, vs_best = {}, {}
    for s in cfg.seq_lens:
        if (mixed_c, s) in homo and (ref_c, s) in homo:
            mine, ref = homo[(mixed_c, s)]["tokens_per_s"], homo[(ref_c, s)]["tokens_per_s"]
            vs_ep[s] = mine["zebra"] / ref["ep"]
            vs_best[s] = mine["zebra"] / max(v for k, v in ref.items() if k != "ep_ideal" and v == v)
    if not vs_ep:
        return []
    seqs = list(vs_ep)
    return [
        "",
        f"| {mixed_c} / {ref_c} (model {', '.join(cfg.homogeneous.models)}) | paper | "
        + " | ".join(f"{s // 1024}K" for s in seqs) + " |",
        "|---|---|" + "---|" * len(seqs),
        f"| HeterMoE on the mix / EP on {ref_c} | 95% | " + " | ".join(f"{vs_ep[s]:.0%}" for s in seqs) + " |",
        f"| HeterMoE on the mix / best plan on {ref_c} (our planner: EP layout + zebra overlap) | - | "
        + " | ".join(f"{vs_best[s]:.0%}" for s in seqs) + " |",
    ]


def _utilisation(ok: list[dict], cfg: DictConfig) -> list[str]:
    """Attention and expert devices' utilisation with and without Asym-EA, mean over models."""
    u = cfg.utilization
    util = {r["asym_ea"]: r["utilization"] for r in ok if r.get("utilization") and r["kind"] == "ablation"}
    if not (True in util and False in util):
        return []

    def mean_u(flag):
        rs = [r["utilization"] for r in ok if r.get("utilization") and r["kind"] == "ablation" and r["asym_ea"] == flag]
        keys = list(rs[0])
        return "/".join(f"{sum(x[k] for x in rs) / len(rs):.0%}" for k in keys), "/".join(keys)

    (wo, keys), (wi, _) = mean_u(False), mean_u(True)
    return ["", f"Utilisation {keys} on {u.cluster} at {u.seq_len // 1024}K (paper roles, mean over models): "
                f"without Asym-EA {wo}, with {wi} (paper: 55%/89% and 83%/78%)."]


def _bound_table(main: list[dict], cfg: DictConfig) -> list[str]:
    lines = [
        "",
        "## HeterMoE against the throughput bound",
        "",
        "The bound: every device busy all the time on the work it is relatively fastest at, no "
        "communication (`lightning_hetermoe/simulate/bound.py`). The rest of the step, from the simulator's "
        "per-rank breakdown: communication (what free links would remove), idle (bubbles and imbalance left with "
        "free links, mean over ranks) and slower work (devices on work they are not fastest at). Each row is the "
        "mean over the models.",
        "",
        "| cluster | seq len | HeterMoE of bound | communication | idle | slower work |",
        "|---|---|---|---|---|---|",
    ]
    for c in cfg.clusters:
        for s in cfg.seq_lens:
            rs = [r for r in main if r["cluster"] == c and r["seq_len"] == s and "of_bound" in r]
            if rs:
                mean = lambda f: sum(f(r) for r in rs) / len(rs)  # noqa: E731
                lines.append(f"| {c} | {s} | {mean(lambda r: r['of_bound']):.1%} | "
                             f"{mean(lambda r: r['gap']['communication']):.1%} | {mean(lambda r: r['gap']['idle']):.1%} | "
                             f"{mean(lambda r: r['gap']['slower_work']):.1%} |")
    cells = [r["of_bound"] for r in main if r["cluster"] in cfg.clusters and "of_bound" in r]
    if cells:
        lines += ["", f"Over the {len(cells)} configurations: mean {sum(cells) / len(cells):.1%} of the bound, "
                      f"geometric mean {geomean(cells):.1%}, lowest {min(cells):.1%}."]
    return lines


def _by_seq_table(families: dict[str, list[dict]], cfg: DictConfig) -> list[str]:
    lines = [
        "",
        "## HeterMoE against each baseline by sequence length",
        "",
        "| clusters | seq len | / EP | / EP balanced | / EP(Ideal) | DistEP share |",
        "|---|---|---|---|---|---|",
    ]
    for fam, rs in families.items():
        for s in cfg.seq_lens:
            if any(r["seq_len"] == s for r in rs):
                lines.append(f"| {fam} | {s} | {_by_seq(rs, s, 'zebra', 'ep'):.2f}x | "
                             f"{_by_seq(rs, s, 'zebra', 'ep_balanced'):.2f}x | "
                             f"{_by_seq(rs, s, 'zebra', 'ep_ideal'):.2f}x | {_by_seq(rs, s, 'distep', 'zebra'):.0%} |")
    return lines


def _per_model_table(main: list[dict], cfg: DictConfig) -> list[str]:
    lines = [
        "",
        "## HeterMoE / EP per cluster and model",
        "",
        "| cluster | model | " + " | ".join(str(s) for s in cfg.seq_lens) + " |",
        "|---|---|" + "---|" * len(cfg.seq_lens),
    ]
    for c in cfg.clusters:
        for m in cfg.models:
            cells = []
            for s in cfg.seq_lens:
                r = [x for x in main if x["cluster"] == c and x["model"] == m and x["seq_len"] == s]
                v = ratio(r[0], "zebra", "ep") if r else NAN
                cells.append(f"{v:.2f}x" if v == v else ("EP OOM" if r else "OOM"))
            lines.append(f"| {c} | {m} | " + " | ".join(cells) + " |")
    return lines


def _footnotes(results: list[dict], main: list[dict], cfg: DictConfig) -> list[str]:
    """Batches halved to fit, and the configurations that could not run at all."""
    lines = []
    halved = [r for r in main if r.get("global_batch_tokens", 0) * 2 <= cfg.global_batch_tokens]
    if halved:
        lines += ["", "Batch reduced to fit memory: "
                  + ", ".join(f"{r['cluster']}/{r['model']}/{r['seq_len']} ({r['global_batch_tokens']:,})" for r in halved)]
    waved = [r for r in main if r.get("waves", 1) > 1]
    if waved:
        lines += ["", "Planned in waves (gradient accumulation: the activations of one wave in memory at a time): "
                  + ", ".join(f"{r['cluster']}/{r['model']}/{r['seq_len']} ({r['waves']})" for r in waved)]
    errors = [r for r in results if "error" in r and r["kind"] == "main"]
    if errors:
        lines += ["", "## Infeasible", ""] + [f"- {r['cluster']} {r['model']} {r['seq_len']}: {r['error']}" for r in errors]
    return lines


@hydra.main(config_path="../conf", config_name="paper", version_base="1.3")
def main(cfg: DictConfig) -> str:
    tokens, mb, waves = int(cfg.global_batch_tokens), int(cfg.max_microbatches), int(cfg.max_waves)
    u = cfg.utilization
    jobs = []
    for c in cfg.clusters:
        for m in cfg.models:
            for s in cfg.seq_lens:
                util = c == u.cluster and s == u.seq_len
                jobs.append((c, m, s, tokens, True, mb, waves, False, "main"))
                if s == cfg.asym_ablation_seq_len or util:
                    jobs.append((c, m, s, tokens, True, mb, waves, util, "ablation"))
                    jobs.append((c, m, s, tokens, False, mb, waves, util, "ablation"))
    for c in cfg.homogeneous.clusters:
        for m in cfg.homogeneous.models:
            for s in cfg.seq_lens:
                jobs.append((c, m, s, tokens, True, mb, waves, False, "main"))
    if int(cfg.workers) > 1:
        import multiprocessing as mp

        with mp.get_context("fork").Pool(int(cfg.workers)) as pool:
            results = pool.map(run_job, jobs, chunksize=1)
    else:
        results = [run_job(j) for j in jobs]
    out = HydraConfig.get().runtime.output_dir
    with open(os.path.join(out, "paper_table.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["cluster", "model", "seq_len", "schedule", "tokens_per_s"])
        for r in results:
            if r["kind"] != "main" or "error" in r:
                continue
            for s in SCHEDULES:
                w.writerow([r["cluster"], r["model"], r["seq_len"], s, f"{r['tokens_per_s'].get(s, float('nan')):.1f}"])
    md = markdown(results, cfg)
    with open(os.path.join(out, "paper_table.md"), "w") as f:
        f.write(md)
    print(md)
    for r in results:  # each schedule's fraction of the bound, per configuration
        if r["kind"] == "main" and "error" not in r and r.get("bound_tokens_per_s"):
            fr = ", ".join(f"{s} {v / r['bound_tokens_per_s']:.0%}" for s, v in r["tokens_per_s"].items() if v == v)
            print(f"{r['cluster']} {r['model']} {r['seq_len']}: of the bound {fr}")
    print(f"wrote paper_table.csv and paper_table.md to {out}")
    return out


if __name__ == "__main__":
    main()
