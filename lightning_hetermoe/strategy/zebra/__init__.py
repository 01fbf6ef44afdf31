"""The zebra executor: plan to processes, micro-batch fibers, the bipartite exchange."""
