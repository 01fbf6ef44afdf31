"""The process groups of expert parallelism: ``world / ep_size`` EP groups of consecutive
ranks, and the replica groups of the ranks that hold the same experts in each."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

import lightning_hetermoe.comm as comm
from ....comm import Group


@dataclass
class ExpertParallelGroups:
    ep_size: int
    ep_group: Group  # this rank's EP group: rows (device), split counts (host)
    replica_group: Group  # the ranks holding the same experts in the other EP groups
    ep_rank: int
    world_size: int

    @classmethod
    def build(cls, ep_size: int) -> "ExpertParallelGroups":
        world, rank = dist.get_world_size(), dist.get_rank()
        if ep_size < 1 or world % ep_size:
            raise ValueError(f"expert_parallel_size={ep_size} is invalid: must divide the world size {world}")
        ep_group = replica_group = None
        # Every rank must create every group, in the same order.
        for d in range(world // ep_size):
            # One EP group (ep_size == world) has the world's members: its all-to-alls and
            # DDP's all-reduces are issued by the same thread in program order (the forward's,
            # then autograd's), so they share the world's communicator.
            g = comm.new_group(f"ep{d}", range(d * ep_size, (d + 1) * ep_size), host=True, reuse=True)
            ep_group = g if g.member else ep_group
        for i in range(ep_size):
            g = comm.new_group(f"ep_replicas{i}", range(i, world, ep_size))
            replica_group = g if g.member else replica_group
        return cls(ep_size, ep_group, replica_group, rank % ep_size, world)
