"""The routing warm-up: what the freshly initialised routers do with a few sampled global
batches, read before anything is planned (routing is never even).

The planner searches at the sampled batches' pooled expert shares, and every prediction is
the mean of the step at each batch's own routing (:func:`split_routing`). Each rank forwards
its deal of the batches and the counts are summed over the ranks (:func:`warmup_routing`).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from lightning.pytorch.trainer.states import TrainerFn

from .batch import tensors

# A step's time follows its own batch's routing, and a small global batch routes unevenly
# from one batch to the next: on the tiny model a dozen sequences put 3.2-5.1x the mean on
# the hottest expert, batch by batch at the same weights, and the step at the pooled shares
# was 4-8% short of what the steps took. So the warm-up samples several batches, until
# they hold WARMUP_TOKENS (a batch that large routes alike from batch to batch: one is
# enough), and splits them (:func:`split_routing`).
WARMUP_TOKENS = 65536
WARMUP_BATCHES = 16  # the most batches the warm-up runs (each a forward of a global batch)
# A forward has a fixed cost beside its tokens' (about 3 ms on the CPU for the tiny model, a
# kernel launch per operation on a GPU): a rank's chunks of several batches that together
# hold at most this many tokens go through the model in one forward. Where each chunk took
# its own, the 16 forwards of a tiny model were 60% of its ranks' set-up; merged, the
# warm-up of 64-token chunks ran 3.3x faster, of 256-token chunks 1.55x (bench/warmup_deal.py,
# 2 ranks), and in one process 1,024-token chunks gained nothing from merging further. A
# dropless router routes each token on its own, so the counts are the same; a layer with a
# capacity, which drops by the forward's tokens, keeps one forward a chunk, as does a chunk
# past this (it is sized to what one rank's memory holds).
MERGE_TOKENS = 2048


def stage_loader(trainer: Any) -> Any:
    """The current stage's dataloader (the first of several)."""
    loop = {TrainerFn.FITTING: trainer.fit_loop, TrainerFn.VALIDATING: trainer.validate_loop,
            TrainerFn.TESTING: trainer.test_loop, TrainerFn.PREDICTING: trainer.predict_loop}[trainer.state.fn]
    loader = loop._data_source.dataloader()
    if isinstance(loader, (list, tuple)):
        loader = loader[0]
    if isinstance(loader, dict):
        loader = next(iter(loader.values()))
    return loader


def warmup_routing(module: Any, trainer: Any, chunk: int, sequences: int, precision: Any = None,
                   rank: int = 0, world: int = 1) -> list[list[list[float]]] | None:
    """Each sampled batch's routing, per layer each expert's share (``[batch][layer][expert]``),
    through the model as initialised: what the routers do at the start, which the planner
    and the predictions take instead of even routing. Each batch is a global batch
    (``sequences`` samples: few tokens exaggerate the hottest expert, one rank's share more
    so), drawn as a shuffling loader would (a fixed seed, the run's RNG untouched); as many
    batches as hold :data:`WARMUP_TOKENS` (at most :data:`WARMUP_BATCHES`, at least one,
    as the dataset allows). The batches are cut into chunks of ``chunk`` samples (the memory
    of one rank's share) dealt over the ``world`` ranks, chunk ``i`` to rank ``i mod world``,
    and their counts summed (one all-reduce): each rank forwards about one rank's share of
    each batch, however many ranks there are, where one rank forwarding them all would take
    ``world`` forwards a batch. A rank's small chunks share forwards (:data:`MERGE_TOKENS`).
    A collective where ``world > 1``: every rank calls it, with its weights already rank
    0's (the strategy broadcasts them first). Forward only, in eval mode, under the run's
    autocast (``precision``, the precision plugin: its ``forward_context``), and on the
    torch expert loop: only the routing is read, and the Triton kernels would compile (or
    tune) for row counts no step launches. ``None`` (on every rank) when the model cannot
    be run on the batch's first tensor alone on some rank."""
    from ..model_contract import moe_layers

    layers = [layer for _, layer in moe_layers(module)]
    if not layers:
        return None  # alike on every rank: each built the same model
    sizes = [layer.num_experts for layer in layers]
    # user experts (the model contract) may have no backend to switch
    backends = [getattr(layer.experts, "backend", None) for layer in layers]
    was_training = module.training
    context = precision.forward_context() if precision is not None else contextlib.nullcontext()
    counter, counts = None, None
    try:
        counter = _Counter(layers, module.device)
        loader = stage_loader(trainer)
        dataset = loader.dataset
        batches = warmup_batches(len(dataset), sequences, int(tensors(dataset[0])[0].shape[0]))
        step = max(chunk, 1)
        chunks = [(b, start) for b, indices in enumerate(batches) for start in range(0, len(indices), step)]
        inputs = [(b, tensors(loader.collate_fn([dataset[i] for i in batches[b][start:start + step]]))[0])
                  for b, start in chunks[rank::world]]
        # a layer with a capacity drops by the forward's tokens: one forward a chunk there
        dropless = all(getattr(layer.cfg, "capacity_factor", 1) <= 0 for layer in layers) and not _compiled(module)
        module.eval()
        for layer, backend in zip(layers, backends, strict=True):
            if backend is not None:
                layer.experts.backend = "torch"
        with torch.no_grad(), torch.random.fork_rng(devices=[module.device] if module.device.type == "cuda" else []), \
                context:
            for merge in (True, False) if dropless else (False,):
                try:
                    counts = counter.run(module, _forwards(inputs, merge), len(batches))
                    break
                except _OneBatchAForward:
                    continue
    except Exception:
        counts = None  # a forward that needs more than the tokens: plan with even routing
    finally:
        if counter is not None:
            counter.remove()
        module.train(was_training)
        for layer, backend in zip(layers, backends, strict=True):
            if backend is not None:
                layer.experts.backend = backend
    return _summed_shares(counts, sizes, world)


class _OneBatchAForward(Exception):
    """Merged chunks whose tokens cannot be told apart by batch: one forward a chunk instead."""


class _Counter:
    """Each batch's choices per expert, counted by hooks on the MoE layers (and their
    routers) as forwards go through the model. The counts stay on the device until the sum:
    one read to the host at the end, not one per layer and forward."""

    def __init__(self, layers: list[Any], device: Any) -> None:
        self.sizes = [layer.num_experts for layer in layers]
        self.offsets = [sum(self.sizes[:l]) for l in range(len(layers))]
        self.device = device
        self.routed: dict[int, Any] = {}  # layer -> its router's (indices, keep) in this forward
        self.fired: set[int] = set()
        self.counts: Any = None
        self.owner: Any = None  # the batch of each sample of this forward (a tensor), or its one batch (int)
        self.handles = [layer.register_forward_hook(self._layer_hook(l)) for l, layer in enumerate(layers)]
        # a layer's own router, where it has one (without: one forward a chunk, by its count)
        self.handles += [layer.router.register_forward_hook(self._router_hook(l)) for l, layer in enumerate(layers)
                         if isinstance(getattr(layer, "router", None), torch.nn.Module)]

    def run(self, module: Any, forwards: list[list[tuple[int, Any]]], n_batches: int) -> Any:
        """``[batch, every layer's experts]`` counts over ``forwards`` (each a list of
        ``(batch, input)``); ``None`` where a forward skipped a layer (its routing is not
        all there)."""
        self.counts = torch.zeros(n_batches, sum(self.sizes), dtype=torch.float64, device=self.device)
        for group in forwards:
            self.fired.clear()
            self.routed.clear()
            owners = [b for b, _ in group]
            self.owner = owners[0] if len(set(owners)) == 1 else torch.tensor(
                [b for b, t in group for _ in range(t.shape[0])], device=self.device)
            module((torch.cat([t for _, t in group]) if len(group) > 1 else group[0][1]).to(self.device))
            if len(self.fired) != len(self.sizes):
                return None
        return self.counts

    def _router_hook(self, l: int):
        def record(mod, args, output):
            # kept only for a forward of several batches, and only its choices: a chunk's own
            # forward is counted by the layer, and the logits of every layer held to the end of
            # the forward would be a real model's memory
            if isinstance(self.owner, torch.Tensor):
                self.routed[l] = (output.indices, output.keep)
        return record

    def _layer_hook(self, l: int):
        def record(mod, args, output):
            self.fired.add(l)
            lo, hi = self.offsets[l], self.offsets[l] + self.sizes[l]
            if not isinstance(self.owner, torch.Tensor):  # the layer's own count: after its capacity, without padding
                self.counts[self.owner, lo:hi] += mod.aux_of(output).tokens_per_expert.detach()
                return
            # several batches in one forward (dropless layers: the router's choices are the kept
            # ones): each token's choices to its sample's batch, the tokens in batch-major order
            # as the layer flattens them (as the strategy's padding masks take them)
            indices, keep = self.routed.pop(l, (None, None))
            per_sample = 0 if indices is None else indices.shape[0] // self.owner.numel()
            if not per_sample or indices.shape[0] != per_sample * self.owner.numel() or \
                    mod.real_tokens(indices.shape[0]) is not None:
                # a layer routing otherwise, a model keeping no row a sample, or padding a
                # strategy marks (the layer's own count leaves it out)
                raise _OneBatchAForward()
            batch = self.owner.repeat_interleave(per_sample).unsqueeze(-1)
            flat = (batch * self.counts.shape[1] + lo + indices).reshape(-1)
            self.counts.view(-1).scatter_add_(0, flat, keep.reshape(-1).to(self.counts.dtype))
        return record

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _compiled(module: Any) -> bool:
    # a compiled model would compile again for a merged forward's shape, and once more for
    # the steps' (dynamic shapes): one forward a chunk, as the steps' batches come
    return any(type(m).__name__ == "OptimizedModule" for m in module.modules())


def _forwards(inputs: list[tuple[int, Any]], merge: bool) -> list[list[tuple[int, Any]]]:
    """This rank's chunks (``(batch, first tensor)``, in order) as forwards: consecutive
    chunks of one shape past the batch dimension, together at most :data:`MERGE_TOKENS`
    tokens (``merge``), else one a chunk."""
    out: list[list[tuple[int, Any]]] = []
    for b, t in inputs:
        last = out[-1] if out and merge else None
        if last is not None and last[0][1].shape[1:] == t.shape[1:] and \
                sum(x.shape[:2].numel() for _, x in last) + t.shape[:2].numel() <= MERGE_TOKENS:
            last.append((b, t))
        else:
            out.append([(b, t)])
    return out


def _summed_shares(counts: Any, sizes: list[int], world: int) -> list[list[list[float]]] | None:
    """The ranks' warm-up counts (``[batch, every layer's experts]``, ``None`` where this
    rank could not run its chunks) summed over the world, as each batch's per-layer shares;
    ``None`` on every rank where any rank has none. Outside the run's autocast: the sum
    travels as float64 (integer counts, exact)."""
    if world > 1:
        from .. import comm

        shapes = comm.gather_objects(comm.world(), None if counts is None else tuple(counts.shape),
                                     what="strategy.warmup.shape")
        if None in shapes or len(set(shapes)) > 1:
            return None
        comm.all_reduce(comm.world(), counts, what="strategy.warmup")
    if counts is None:
        return None
    return [[(c / c.sum().clamp(min=1)).tolist() for c in row.split(sizes)] for row in counts.cpu()]


def warmup_batches(n_samples: int, sequences: int, seq_len: int) -> list[list[int]]:
    """The samples of each warm-up batch (see :func:`warmup_routing`): a fixed permutation of
    the dataset cut into batches of ``sequences``, as many as hold :data:`WARMUP_TOKENS`
    (``seq_len`` tokens each), between one and :data:`WARMUP_BATCHES`."""
    per = max(1, min(sequences, n_samples))
    want = min(WARMUP_BATCHES, max(1, -(-WARMUP_TOKENS // max(per * seq_len, 1))), max(1, n_samples // per))
    order = torch.randperm(n_samples, generator=torch.Generator().manual_seed(0)).tolist()
    return [order[b * per:(b + 1) * per] for b in range(want)]


def split_routing(batches: list[list[list[float]]] | None
                  ) -> tuple[list[list[float]] | None, list[list[list[float]]] | None]:
    """The warm-up's batches as ``(planned_on, predicted_on)``: the planner places experts
    at the pooled shares of the first half; every prediction is the mean of the step over
    the other half, each batch at its own routing. A placement fitted to some batches
    balances exactly those batches better than the next ones (on the tiny model the
    step at the batches it was fitted to was 5% short of the steps' own), so it is priced
    on batches it has not seen, as training's are. One batch does both."""
    if not batches:
        return None, None
    if len(batches) == 1:
        return pooled_share(batches), batches
    half = len(batches) // 2
    return pooled_share(batches[:half]), batches[half:]


def pooled_share(batches: list[list[list[float]]] | None) -> list[list[float]] | None:
    """The batches' routing pooled (batches of one size: the mean of their shares)."""
    if not batches:
        return None
    return [[sum(b[l][e] for b in batches) / len(batches) for e in range(len(batches[0][l]))]
            for l in range(len(batches[0]))]
