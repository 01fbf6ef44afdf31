"""Sharded checkpoints on torch.distributed.checkpoint (DCP), in flat pieces.

Each rank writes the pieces it holds (:class:`~.pieces.Pieces`), in parallel, into its own
file of one checkpoint directory; a piece that several ranks hold alike (a replicated dense
weight, an expert held by replicas) is written once (DCP's de-duplication, which spreads
them over the ranks). Every tensor is stored as its flattened whole (``[numel]``) cut into
1-D chunks, so a load with any other cut is DCP's resharding: each rank reads only the
saved chunks that overlap the pieces it wants, straight into its own storage.

Only tensors go through DCP; the rest of a checkpoint (Lightning's loop state, shapes, the
optimizers' hyper-parameters) is a small object file written by one rank.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ..configs import ConfigError
from .pieces import Pieces

State = dict[str, "Pieces | Tensor"]


class CheckpointFormatError(ConfigError):
    """A checkpoint does not hold what the model or optimizer asks of it. A
    :class:`~lightning_hetermoe.configs.ConfigError` (so a ``ValueError``): the path is the
    user's to change, and a recipe says so on one line, as for any other bad value."""


def _chunk(offset: int, n: int) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size([offset]), sizes=torch.Size([n]))


def _part(pieces: Pieces, offset: int) -> Tensor:
    for o, flat in pieces.parts:
        if o == offset:
            return flat
    raise KeyError(f"no piece at offset {offset}")


class PiecesSavePlanner(DefaultSavePlanner):
    """Write items for the pieces this rank holds; de-duplication and the global metadata
    are DCP's own."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def create_local_plan(self) -> SavePlan:
        items = []
        for fqn, obj in self.state_dict.items():
            if isinstance(obj, Pieces):
                for offset, flat in obj.parts:
                    items.append(WriteItem(index=MetadataIndex(fqn, torch.Size([offset])), type=WriteItemType.SHARD,
                                           tensor_data=TensorWriteData(chunk=_chunk(offset, flat.numel()),
                                                                       properties=TensorProperties.create_from_tensor(flat),
                                                                       size=torch.Size([obj.numel]))))
            elif isinstance(obj, Tensor):
                zeros = torch.Size([0] * obj.dim())
                items.append(WriteItem(index=MetadataIndex(fqn, zeros), type=WriteItemType.TENSOR,
                                       tensor_data=TensorWriteData(
                                           chunk=ChunkStorageMetadata(offsets=zeros, sizes=obj.size()),
                                           properties=TensorProperties.create_from_tensor(obj), size=obj.size())))
            else:
                raise TypeError(f"{fqn}: only tensors and Pieces go through DCP, not {type(obj).__name__}")
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict[index.fqn]
        return _part(obj, index.offset[0]) if isinstance(obj, Pieces) else obj


class PiecesLoadPlanner(DefaultLoadPlanner):
    """Read items for the pieces this rank wants, from whichever saved chunks overlap them.
    ``strict``: every wanted tensor must be in the checkpoint."""

    def __init__(self, strict: bool = True) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False, allow_partial_load=not strict)
        self.strict = strict

    def set_up_planner(self, state_dict: Any, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        # DCP's own set-up walks the state dict and turns what it does not know into None
        self.state_dict = self.original_state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        items = []
        missing = []
        for fqn, obj in self.state_dict.items():
            md = self.metadata.state_dict_metadata.get(fqn)
            if not isinstance(md, TensorStorageMetadata):
                missing.append(fqn)
                continue
            if isinstance(obj, Pieces):
                if tuple(md.size) != (obj.numel,):
                    raise CheckpointFormatError(f"{fqn}: the checkpoint holds {int(md.size.numel())} elements, the "
                                                f"model's tensor of shape {list(obj.shape)} has {obj.numel}")
                chunks = [_chunk(o, f.numel()) for o, f in obj.parts]
            else:
                if tuple(md.size) != tuple(obj.shape):
                    raise CheckpointFormatError(f"{fqn}: the checkpoint holds shape {list(md.size)}, the model's "
                                                f"tensor has {list(obj.shape)}")
                chunks = [ChunkStorageMetadata(offsets=torch.Size([0] * obj.dim()), sizes=obj.size())]
            items += create_read_items_for_chunk_list(fqn, md, chunks)
        if missing and self.strict:
            shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
            raise CheckpointFormatError(f"the checkpoint has no {shown}")
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> Tensor:
        obj = self.state_dict[index.fqn]
        return _part(obj, index.offset[0]) if isinstance(obj, Pieces) else obj


def save(state: State, path: str | os.PathLike, process_group: Any = None) -> None:
    """Every rank writes its pieces of ``state`` into the directory ``path`` (a collective
    over ``process_group``; ``None`` without a process group: one process writes all)."""
    use_dist = dist.is_available() and dist.is_initialized()
    writer = dcp.FileSystemWriter(str(path), single_file_per_rank=True, thread_count=1)
    dcp.save(state, storage_writer=writer, planner=PiecesSavePlanner(), process_group=process_group,
             no_dist=not use_dist)


def load(state: State, path: str | os.PathLike, process_group: Any = None, strict: bool = True,
         local: bool = False) -> None:
    """Fill the pieces of ``state`` in place from the checkpoint at ``path``; ``local``:
    this process alone reads (the offline tools), even inside a distributed job, where a
    read that joined the process group would wait on ranks that never call it."""
    use_dist = dist.is_available() and dist.is_initialized() and not local
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(path)), planner=PiecesLoadPlanner(strict),
             process_group=process_group, no_dist=not use_dist)


def read_metadata(path: str | os.PathLike) -> Metadata:
    return dcp.FileSystemReader(str(path)).read_metadata()


def missing_files(path: str | os.PathLike) -> list[str]:
    """The piece files the checkpoint's ``.metadata`` names that are not in its directory: a
    rank that wrote its part elsewhere (a disk of its node's own), a copy that left some
    behind. Each would surface as a bare file-not-found deep in a read."""
    named = {getattr(info, "relative_path", None) for info in (read_metadata(path).storage_data or {}).values()}
    return sorted(f for f in named - {None} if not os.path.isfile(os.path.join(path, f)))

