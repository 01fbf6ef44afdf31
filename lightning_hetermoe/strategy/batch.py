"""The global batch of a step, and each rank's share of it.

Every rank loads its own ``b`` samples (rank ``r`` of ``W`` takes positions ``r, r+W, ...``
of the epoch's order, see :mod:`lightning_hetermoe.model.sampling`), exactly as under DDP.
Modes that split the batch by something other than rank count (zebra's attention ranks,
EP with speed-proportional shares) all-gather those pieces back into the global batch, in
global order, and cut it into the shares the plan gives. Token batches are small next to
activations, so every rank loading and gathering them costs little, and the global batch
stays the same set of samples in every mode and on every world size.

A batch is a tensor, or a tuple/list/dict of tensors whose first dimension is the batch
(the model contract).

**Ragged batches.** A collate that cuts or pads each batch to its own longest row gives
ranks batches of different sequence lengths, which no all-gather takes (NCCL needs equal
sizes, gloo resets the connection). So the ranks first gather their batches' shapes over
the host group (one small collective, :func:`gather_shapes`), and every rank decides from
the same shapes: equal, the batch goes as it is; differing in the sequence dimension
(dimension 1) only, every tensor of that length is right-padded to the longest, labels with
the ignore index (-100: PyTorch's ``cross_entropy`` default and Hugging Face's), inputs and
masks with 0; anything else is refused (:class:`~lightning_hetermoe.configs.ConfigError`)
on every rank alike, before any device collective. Attention is causal, so right padding
changes no real position's output; the MoE layers are told which tokens are padding
(``MoELayer.real_tokens``: it routes nowhere and counts in no auxiliary loss), and each
piece's mean loss counts by its real tokens (:meth:`GlobalBatch.fraction`), so the step
equals one process on the unpadded rows. Where no global batch is gathered (``ep`` with
equal shares) nothing is padded: each rank's mean loss counts by its own tokens, summed
over the ranks in one host all-reduce (:func:`local_tokens`).

**Uneven rows.** In evaluation a short last batch may hold different numbers of rows on
different ranks (Lightning's predict sampler deals rows without padding). The same shapes
tell every rank each one's row count (:attr:`GlobalBatch.counts`): the sequence dimension
is padded first, as above, then each rank's rows to the most any rank holds for the
all-gather, and those padding rows are dropped after it (:func:`global_order`). Training
refuses differing row counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass, replace
from typing import Any, Callable

import torch
from torch import Tensor

import lightning_hetermoe.comm as comm
from ..configs import ConfigError

IGNORE_INDEX = -100  # what PyTorch's cross_entropy and Hugging Face's models ignore by default
LABEL_NAMES = ("labels", "label", "targets", "target")
# a batch's shapes as one fixed-size int64 row per rank: every rank sends the same size,
# whatever its batch holds (a batch beyond these bounds is refused, on every rank alike)
MAX_TENSORS, MAX_DIMS = 16, 6
_SLOT = 2 + MAX_DIMS  # per tensor: its dimension count, its dtype, its sizes
_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
           torch.bfloat16, torch.float32, torch.float64)


def map_tensors(obj: Any, fn: Callable[[Tensor], Tensor], *, strict: bool = False) -> Any:
    """``fn`` applied to every tensor in tuples (named or not), lists, dicts and dataclasses.

    Other leaves pass through unchanged, or raise with ``strict`` (a batch is tensors only:
    a non-tensor leaf could not be gathered or split, see the model contract)."""
    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(map_tensors(o, fn, strict=strict) for o in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_tensors(o, fn, strict=strict) for o in obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn, strict=strict) for k, v in obj.items()}
    if is_dataclass(obj) and not isinstance(obj, type):
        return replace(obj, **{f.name: map_tensors(getattr(obj, f.name), fn, strict=strict)
                               for f in fields(obj) if f.init})
    if strict:
        raise TypeError(f"a batch must be a tensor or a tuple/list/dict of tensors, got {type(obj).__name__}")
    return obj


def tensors(obj: Any, *, strict: bool = False) -> list[Tensor]:
    """Every tensor of ``obj``, in the order :func:`map_tensors` visits them."""
    found: list[Tensor] = []
    map_tensors(obj, lambda t: found.append(t) or t, strict=strict)
    return found


def map_batch(batch: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    return map_tensors(batch, fn, strict=True)


def batch_size(batch: Any) -> int:
    sizes = {int(t.shape[0]) for t in tensors(batch, strict=True)}
    if len(sizes) != 1:
        raise ValueError(f"the tensors of a batch disagree on the batch size: {sorted(sizes)}")
    return sizes.pop()


def sequence_length(batch: Any) -> int:
    """Tokens per sequence: the second dimension of the batch's first tensor (``[batch, seq]``)."""
    first = tensors(batch, strict=True)
    if not first or first[0].dim() < 2:
        raise ValueError("the batch's first tensor must be [batch, seq_len, ...] to plan by sequence length")
    return int(first[0].shape[1])


# -- every rank's shapes, over the host ---------------------------------------------------------
Shapes = list[tuple[tuple[int, ...], int]]  # one rank's batch: each tensor's shape and dtype code


def _describe(batch: Any) -> Tensor:
    found = tensors(batch, strict=True)
    if len(found) > MAX_TENSORS or any(t.dim() > MAX_DIMS for t in found):
        row = [-1]
    else:
        row = [len(found)]
        for t in found:
            code = _DTYPES.index(t.dtype) if t.dtype in _DTYPES else len(_DTYPES)
            row += [t.dim(), code, *t.shape, *[0] * (MAX_DIMS - t.dim())]
    return torch.tensor(row + [0] * (1 + MAX_TENSORS * _SLOT - len(row)), dtype=torch.int64, device="cpu")


def _decode(row: list[int]) -> Shapes | None:
    if row[0] < 0:
        return None
    slots = (row[1 + i * _SLOT: 1 + (i + 1) * _SLOT] for i in range(row[0]))
    return [(tuple(slot[2: 2 + slot[0]]), slot[1]) for slot in slots]


def gather_shapes(batch: Any) -> list[Shapes | None]:
    """Every rank's batch shapes, in rank order (``None``: a batch too large to describe):
    one small host collective, CPU int64 on the world's gloo group. Shapes are host
    metadata: reading them syncs nothing."""
    world = comm.world()
    mine = _describe(batch)
    rows = [torch.empty_like(mine) for _ in range(world.size)]
    comm.host_all_gather(world, rows, mine, what="batch.shapes")
    return [_decode(r.tolist()) for r in rows]


def local_tokens(batch: Any) -> int:
    """This rank's tokens: batch size times the sequence length of its first tensor (its batch
    size alone where that tensor has no sequence dimension)."""
    first = tensors(batch, strict=True)[0]
    return int(first.shape[0]) * (int(first.shape[1]) if first.dim() > 1 else 1)


# -- what can be padded -------------------------------------------------------------------------
FIX = ("Collate every rank's batch to one shape (pad to a fixed length), or use mode='ep' (with "
       "batch_split='equal'), which trains each rank's batch as it comes.")


def _shape_text(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _refuse(shapes: list[Shapes | None], problem: str, fix: str = FIX) -> None:
    listed = "; ".join(f"rank {r}: " + (", ".join(_shape_text(t) for t, _ in s) if s is not None else "(too large)")
                       for r, s in enumerate(shapes))
    raise ConfigError(f"ragged batches: {problem}. The ranks' batches: {listed}. {fix}")


def tensor_names(batch: Any) -> list[str] | None:
    """Each tensor's name, in :func:`tensors` order, where the batch says which tensor is what:
    a dict, namedtuple or dataclass of tensors, or a pair ``(inputs, targets)`` as the
    pack's models take it; ``None`` otherwise (one tensor, more than two unnamed, nested)."""
    if isinstance(batch, dict):
        items = list(batch.items())
    elif isinstance(batch, tuple) and hasattr(batch, "_fields"):
        items = list(zip(batch._fields, batch))
    elif is_dataclass(batch) and not isinstance(batch, type):
        items = [(f.name, getattr(batch, f.name)) for f in fields(batch) if f.init]
    elif isinstance(batch, (tuple, list)) and len(batch) == 2:
        items = [("inputs", batch[0]), ("targets", batch[1])]
    else:
        return None
    if not all(isinstance(v, Tensor) for _, v in items):
        return None
    return [str(k) for k, _ in items]


def _unnamed(batch: Any) -> str:
    if isinstance(batch, Tensor):
        return "batch of one tensor (the inputs and, shifted, the labels alike)"
    if isinstance(batch, (tuple, list)):
        return f"{type(batch).__name__} of {len(batch)} unnamed tensors"
    return f"nested {type(batch).__name__} batch"


@dataclass(frozen=True)
class Padding:
    """How every rank's batch becomes one shape: each tensor's pad value (``None``: it keeps
    its shape) and each rank's own sequence length."""

    values: tuple[int | None, ...]
    lengths: tuple[int, ...]

    @property
    def longest(self) -> int:
        return max(self.lengths)


def plan_padding(batch: Any, shapes: list[Shapes | None], ignore_index: int = IGNORE_INDEX, *,
                 uneven_rows: bool = False) -> Padding | None:
    """``None`` where every rank's batch has one shape (but for its row count, where
    ``uneven_rows`` lets that differ); else how to pad them, or a :class:`ConfigError`. Every
    rank decides from the same ``shapes`` (and batches of one structure), so every rank pads,
    or refuses, alike."""
    if any(s is None for s in shapes):
        _refuse(shapes, f"a batch of more than {MAX_TENSORS} tensors, or with tensors of more than {MAX_DIMS} "
                        "dimensions, is more than the ranks describe to each other", "Give the batch fewer tensors.")
    if all(s == shapes[0] for s in shapes):
        return None
    if len({tuple((len(t), d) for t, d in s) for s in shapes}) != 1:
        _refuse(shapes, "the ranks' batches hold different tensors (their number, dimensions or dtypes differ)")
    sizes = [{t[0] for t, _ in s} for s in shapes]
    split = [r for r, b in enumerate(sizes) if len(b) != 1]
    if split:
        _refuse(shapes, f"the tensors of rank {split[0]}'s batch disagree on the batch size (dimension 0)",
                "Give every tensor of a batch its rows as its first dimension (the model contract).")
    if not uneven_rows and len({min(b) for b in sizes}) != 1:
        _refuse(shapes, "the batch sizes (dimension 0) differ: the global batch is gathered in global sample order, "
                        "which needs as many sequences from every rank",
                "Give every rank the same batch size (drop_last=True, or the pack's GlobalOrderSampler, which cuts "
                "an epoch to whole rounds of ranks), or use mode='ep' with batch_split='equal'.")
    if uneven_rows and all(_per_row(s) == _per_row(shapes[0]) for s in shapes):
        return None  # only the row counts differ: gathered by counts, nothing to pad
    names = tensor_names(batch)
    padded = _padded_tensors(shapes, names)
    lengths = tuple(s[0][0][1] for s in shapes)
    if min(lengths) < 1:
        _refuse(shapes, f"rank {lengths.index(min(lengths))}'s batch has no tokens")
    if names is None:
        _refuse(shapes, f"the strategy cannot tell the inputs from the labels in a {_unnamed(batch)}, so it cannot "
                        f"pad the shorter batches with their padding left out of the loss",
                "Give the batch as (inputs, targets), or as a dict (namedtuple, dataclass) whose per-token labels "
                f"are named {' / '.join(repr(n) for n in LABEL_NAMES)}; or " + FIX[0].lower() + FIX[1:])
    labels = [k for k in padded if names[k] in LABEL_NAMES]
    if not labels:
        _refuse(shapes, f"no padded tensor holds per-token labels (named {' / '.join(repr(n) for n in LABEL_NAMES)}; "
                        f"the batch has {names}): padding the inputs alone would be trained on (a Hugging Face model "
                        f"without 'labels' takes its labels from its inputs)",
                "Add the labels to the batch under 'labels'; or " + FIX[0].lower() + FIX[1:])
    unfit = [names[k] for k in labels if not _holds(shapes[0][k][1], ignore_index)]
    if unfit:
        _refuse(shapes, f"the labels {unfit} are not integer class ids that can hold the ignore index {ignore_index}, "
                        f"so padding them would not leave the padding out of the loss")
    values = tuple((ignore_index if names[k] in LABEL_NAMES else 0) if k in padded else None
                   for k in range(len(shapes[0])))
    return Padding(values, lengths)


def _per_row(shapes: Shapes) -> list[tuple[tuple[int, ...], int]]:
    """A rank's shapes without the batch dimension."""
    return [(t[1:], d) for t, d in shapes]


def _holds(code: int, value: int) -> bool:
    """A tensor of dtype ``_DTYPES[code]`` is integer class ids and can hold ``value``."""
    if code >= len(_DTYPES) or _DTYPES[code].is_floating_point or _DTYPES[code] == torch.bool:
        return False
    info = torch.iinfo(_DTYPES[code])
    return info.min <= value <= info.max


def _padded_tensors(shapes: list[Shapes], names: list[str] | None) -> list[int]:
    """The tensors whose sequence dimension differs between ranks; refuses any other difference
    (beyond the batch dimension, which :func:`plan_padding` checked)."""
    first = [s[0][0] for s in shapes]
    if len(first[0]) < 2:
        _refuse(shapes, "the batch's first tensor has no sequence dimension ([batch, seq_len, ...]) to pad along")
    out = []
    for k in range(len(shapes[0])):
        per_rank = [s[k][0] for s in shapes]
        label = f"tensor {k}" + (f" ({names[k]!r})" if names is not None else "")
        for d in range(len(per_rank[0])):
            if d > 1 and len({p[d] for p in per_rank}) > 1:
                _refuse(shapes, f"{label} differs in dimension {d} "
                                f"({', '.join(f'rank {r}: {p[d]}' for r, p in enumerate(per_rank))}); only "
                                "dimension 1, the sequence, may differ between ranks")
        if len(per_rank[0]) < 2 or len({p[1] for p in per_rank}) == 1:
            continue
        if any(p[1] != f[1] for p, f in zip(per_rank, first)):
            _refuse(shapes, f"{label} differs in dimension 1 but is not as long as the batch's first tensor on "
                            f"every rank, so its dimension 1 is not the sequence")
        out.append(k)
    return out


def pad_sequence_dim(t: Tensor, length: int, value: int) -> Tensor:
    """``t`` (``[batch, seq, ...]``) right-padded to ``length`` with ``value``, on its device."""
    if t.shape[1] == length:
        return t
    out = t.new_full((t.shape[0], length) + tuple(t.shape[2:]), value)
    out[:, : t.shape[1]] = t
    return out


def apply_padding(batch: Any, padding: Padding) -> Any:
    values = iter(padding.values)

    def pad(t: Tensor) -> Tensor:
        value = next(values)
        return t if value is None else pad_sequence_dim(t, padding.longest, value)

    return map_batch(batch, pad)


# -- the global batch ---------------------------------------------------------------------------
@dataclass
class GlobalBatch:
    """All ranks' rows in global order (:func:`global_order`). ``lengths``: each row's own
    sequence length where the rows were padded to one (``None``: no padding, every token
    real); ``counts``: the rows each rank loaded, in rank order; ``rank_lengths``: each
    rank's own sequence length, where padded."""

    batch: Any
    lengths: list[int] | None = None
    counts: list[int] = field(default_factory=list)
    rank_lengths: tuple[int, ...] | None = None

    @property
    def size(self) -> int:
        return batch_size(self.batch)

    @property
    def padded(self) -> bool:
        return self.lengths is not None

    def tokens(self, start: int, count: int) -> int:
        """Real tokens of rows ``[start, start + count)`` (padded batches only)."""
        return sum(self.lengths[start: start + count])

    def fraction(self, start: int, count: int, scale: int = 1) -> float:
        """What rows ``[start, start + count)`` weigh in the global batch's mean loss, times
        ``scale``: their share of its sequences, or of its real tokens where rows were padded
        (a piece's mean is over its real tokens). Integers divided once: the same float as
        ``count * scale / total``."""
        if self.lengths is None:
            return count * scale / self.size
        return self.tokens(start, count) * scale / sum(self.lengths)

    def mask(self, start: int, count: int, device: torch.device) -> Tensor | None:
        """``[count, seq]`` bool on ``device``, ``True`` at real tokens (``None``: nothing padded);
        made on the host from host lengths and copied over without a sync."""
        if self.lengths is None:
            return None
        lengths = torch.tensor(self.lengths[start: start + count], dtype=torch.long, device="cpu")
        positions = torch.arange(sequence_length(self.batch), dtype=torch.long, device="cpu")
        return comm.to_device(positions.unsqueeze(0) < lengths.unsqueeze(1), device)


def global_order(counts: list[int]) -> list[tuple[int, int]]:
    """``(rank, i)`` of each sample of the global batch, in global order, where rank ``r``
    loaded ``counts[r]`` rows: rank ``r``'s ``i``-th sample is global sample ``i * W + r``
    when every rank loaded as many; in a short last batch the ranks holding an ``i``-th
    sample close up, in rank order (as a sampler that deals ``r, r + W, ...`` left them)."""
    return [(r, i) for i in range(max(counts, default=0)) for r, n in enumerate(counts) if i < n]


def gather_global_batch(batch: Any, ignore_index: int = IGNORE_INDEX, *, uneven_rows: bool = False) -> GlobalBatch:
    """All ranks' batches as one, in global sample order (see :func:`global_order`), padded to
    one sequence length where the ranks' differ. The batch is on the device (Lightning moved
    it there) or on the host (every rank's: gathered over the host side). ``uneven_rows``:
    the ranks may hold different numbers of rows (evaluation: a short last batch that
    Lightning's predict sampler deals without padding); refused otherwise (training). One host gather of the shapes tells every rank both the sequence
    lengths and the row counts (:attr:`GlobalBatch.counts`)."""
    world = comm.world()
    shapes = gather_shapes(batch)
    padding = plan_padding(batch, shapes, ignore_index, uneven_rows=uneven_rows)
    counts = [s[0][0][0] if s else 0 for s in shapes]  # every rank described (plan_padding refuses otherwise)
    if padding is not None:
        batch = apply_padding(batch, padding)
    uneven = len(set(counts)) > 1
    most = max(counts)
    order = global_order(counts)
    # where each sample of the global order sits among the padded rows ([most, W] row-major)
    on_host = all(t.device.type == "cpu" for t in tensors(batch, strict=True))
    # a batch kept on the host off a CPU run (zebra: HeterMoEStrategy.batch_to_device) goes
    # over the host side: it waits for no rank's device work
    host_side = on_host and comm.compute_device().type != "cpu"
    keep = None
    if uneven:
        keep = torch.tensor([i * world.size + r for r, i in order], dtype=torch.long, device="cpu")
        keep = keep if on_host else comm.to_device(keep)

    def gather(t: Tensor) -> Tensor:
        if uneven:  # all_gather needs one shape: pad to the longest rank's rows, drop them after
            t = torch.cat([t, t.new_zeros((most - t.shape[0],) + tuple(t.shape[1:]))])
        parts = [torch.empty_like(t) for _ in range(world.size)]
        if host_side:
            comm.host_all_gather(world, parts, t.contiguous(), what="batch.gather.host")
        else:
            comm.all_gather(world, parts, t.contiguous(), what="batch.gather")
        stacked = torch.stack(parts, 1)  # [b, W, ...]
        flat = stacked.reshape((-1,) + tuple(t.shape[1:]))
        return flat.index_select(0, keep) if uneven else flat

    full = map_batch(batch, gather)
    if padding is None:
        return GlobalBatch(full, counts=counts)
    # each row's real length, in the global order (a rank's rows all have its length)
    return GlobalBatch(full, [padding.lengths[r] for r, _ in order], counts, padding.lengths)


def ignore_index_of(module: Any) -> int:
    """The label the module's loss ignores: its ``ignore_index`` attribute, else -100."""
    value = getattr(module, "ignore_index", IGNORE_INDEX)
    return value if isinstance(value, int) and not isinstance(value, bool) else IGNORE_INDEX


def flat_mask(mask: Tensor | None, num_tokens: int) -> Tensor | None:
    """``mask`` (``[rows, seq]``) as an MoE layer's ``real_tokens`` answer for a call over
    ``num_tokens`` tokens."""
    if mask is None:
        return None
    if mask.numel() != num_tokens:
        raise RuntimeError(f"an MoE layer ran on {num_tokens} tokens while the strategy's padded batch holds "
                           f"{mask.numel()} ({list(mask.shape)}): with ragged batches every MoE layer must see the "
                           f"step's batch, [batch, seq, ...] (see the model contract)")
    return mask.reshape(-1)


def take(batch: Any, start: int, count: int) -> Any:
    return map_batch(batch, lambda t: t.narrow(0, start, count))


def split_sizes(batch_len: int, sizes: list[int]) -> list[tuple[int, int]]:
    """``(start, count)`` of consecutive shares; ``sizes`` must add up to ``batch_len``."""
    if sum(sizes) != batch_len:
        raise ValueError(f"shares {sizes} do not add up to the batch of {batch_len}")
    out, start = [], 0
    for n in sizes:
        out.append((start, n))
        start += n
    return out
