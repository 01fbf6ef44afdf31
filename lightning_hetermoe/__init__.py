"""lightning-hetermoe: HeterMoE zebra parallelism as a PyTorch Lightning strategy."""
