"""The topology-aware plan against the topology-blind one, and EP in a group per server
against one group over both, emulated on two nodes.

    python bench/topology.py              # about 5 minutes on 2 cores
    python bench/topology.py --steps 10 --parts ep

``conf/cluster/emu_n2_a40_v100.yaml``: two emulated servers, 2x A40 on PCIe 4 and 2x V100
on NVLink 2, 25 Gbit/s Ethernet between them, 4 CPU processes, every task timed as D1 at 8K
tokens. Three runs of the main job under zebra:

1. *aware*: the strategy plans on the cluster of nodes (its clock prices every transfer by
   the links it crosses);
2. the same devices as one flat server on PCIe 4 links, one step, only to get the plan a
   topology-blind planner makes;
3. *blind*: that plan run on the two nodes.

Both measured runs report their step time and the simulator's prediction on the nodes;
the ratio blind / aware measured is set against the ratio predicted. Then (``--parts ep``)
two runs under ``strategy.mode=ep``: one EP group of all four ranks (its all-to-alls cross
the network every layer) and two groups of two, one per server
(``strategy.expert_parallel_size=2``: only the experts' gradient sum crosses it), their
ratio measured against predicted. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from runs import run_job

CLUSTER = "emu_n2_a40_v100"
FLAT = ["cluster=emu_a40_v100_d1_8k", "cluster.name=flat_a40_v100", "cluster.devices=[a40,a40,v100,v100]",
        "cluster.link.bandwidth_gbps=252.0", "cluster.link.latency_us=5.0", "cluster.time_scale=3.0"]
RUN = ["strategy.mode=zebra", "logger=none"]


PARTS = ("zebra", "ep")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {PARTS}")
    args = ap.parse_args(argv)
    parts = args.parts.split(",")
    if not parts or any(p not in PARTS for p in parts):
        ap.error(f"--parts={args.parts!r} is invalid: a comma-separated choice of {PARTS}")
    if args.steps < 2:
        ap.error(f"--steps={args.steps} is invalid: must be >= 2 (the first step is not timed)")
    out = {}
    if "zebra" in parts:
        out.update(aware_against_blind(args.steps))
    if "ep" in parts:
        out["ep"] = ep_groups(args.steps)
    print(json.dumps(out))


def ep_groups(steps: int) -> dict:
    """EP in one group over both servers against a group per server: measured and predicted."""
    rows = {}
    for name, size in (("one group of 4", 4), ("a group per server", 2)):
        s = run_job([f"cluster={CLUSTER}", "strategy.mode=ep", f"strategy.expert_parallel_size={size}", "logger=none",
                     f"trainer.max_steps={steps}"])
        rows[size] = {"measured_s": s["step_time_s"], "predicted_s": s["predicted_step_time_s"],
                      "rel_error": s["step_time_rel_error"],
                      "rel_error_at_load": s.get("step_time_rel_error_at_measured_load"),
                      "faithful": s["emulation"]["faithful"]}
        at_load = rows[size]["rel_error_at_load"]
        print(f"ep, {name}: measured {s['step_time_s']:.3f} s/step, predicted {s['predicted_step_time_s']:.3f} s "
              f"({s['step_time_rel_error']:+.1%}" + (f"; {at_load:+.1%} at the steps' routing" if at_load is not None
                                                     else "") + f"), faithful: {s['emulation']['faithful']}")
    measured = rows[4]["measured_s"] / rows[2]["measured_s"]
    predicted = rows[4]["predicted_s"] / rows[2]["predicted_s"]
    print(f"ep one group / a group per server: measured {measured:.3f}x, predicted {predicted:.3f}x "
          f"({measured / predicted - 1:+.1%} off the prediction)")
    return {"rows": {str(k): v for k, v in rows.items()}, "measured_ratio": measured, "predicted_ratio": predicted}


def aware_against_blind(steps: int) -> dict:
    aware = run_job([f"cluster={CLUSTER}", *RUN, f"trainer.max_steps={steps}"])
    flat = run_job([*FLAT, *RUN, "trainer.max_steps=1"])
    with tempfile.TemporaryDirectory() as tmp:
        plan = Path(tmp) / "blind_plan.json"
        plan.write_text(json.dumps(flat["plan_json"]))
        blind = run_job([f"cluster={CLUSTER}", *RUN, f"trainer.max_steps={steps}", f"strategy.plan={plan}"])
    rows = []
    node_of = aware["plan_json"].get("nodes") or [0] * aware["world_size"]
    for name, s in (("aware", aware), ("blind", blind)):
        p = s["plan_json"]
        nodes = [sorted({node_of[r] for r in g["attention_ranks"] + g["expert_ranks"]}) for g in p["zp_groups"]]
        rows.append({"plan": name, "zp_groups": [g["attention_ranks"] + g["expert_ranks"] for g in p["zp_groups"]],
                     "groups_nodes": nodes, "R": p["num_microbatches"], "measured_s": s["step_time_s"],
                     "predicted_s": s["predicted_step_time_s"], "overrun_fraction": s["emulation"]["overrun_fraction"]})
        print(f"{name:<6} groups {rows[-1]['zp_groups']} on nodes {nodes}, R={p['num_microbatches']}: measured "
              f"{s['step_time_s']:.3f} s/step, predicted {s['predicted_step_time_s']:.3f} s "
              f"({s['step_time_rel_error']:+.1%}); {s['emulation']['overrun_fraction']:.1%} of tasks overran")
    measured = blind["step_time_s"] / aware["step_time_s"]
    predicted = blind["predicted_step_time_s"] / aware["predicted_step_time_s"]
    print(f"blind / aware: measured {measured:.3f}x, predicted {predicted:.3f}x "
          f"({measured / predicted - 1:+.1%} off the prediction)")
    return {"rows": rows, "measured_ratio": measured, "predicted_ratio": predicted}


if __name__ == "__main__":
    main()
