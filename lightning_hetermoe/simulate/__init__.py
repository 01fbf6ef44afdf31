"""Discrete-event simulation of one training step under a plan and a schedule."""

from .engine import Task, Timeline, run_dag
from .gantt import draw_gantt, draw_gantt_compare
from .schedules import (
    SCHEDULES,
    ep_setup,
    make_lanes,
    plan_setup,
    simulate_ep,
    simulate_ep_ideal,
)
from .predict import PREDICTED, predict_step, simulate_plan
from .step import Lane, StepResult, StepSetup, build_tasks, simulate_step

__all__ = [
    "SCHEDULES",
    "PREDICTED",
    "predict_step",
    "Task",
    "Timeline",
    "run_dag",
    "Lane",
    "StepSetup",
    "StepResult",
    "build_tasks",
    "simulate_step",
    "simulate_plan",
    "simulate_ep",
    "simulate_ep_ideal",
    "ep_setup",
    "plan_setup",
    "make_lanes",
    "draw_gantt",
    "draw_gantt_compare",
]
