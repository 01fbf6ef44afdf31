"""What the strategy needs of a user's model, read from the module itself.

The model contract (also in the README):

* The model holds one or more :class:`~lightning_hetermoe.moe.MoELayer` modules. Each sits
  directly inside a *block* module (a decoder layer) that the model calls once per forward,
  in order; the block's first positional argument is the hidden state (the residual
  stream), and what a block returns feeds only later blocks and the loss. The MoE layer's
  losses may leave through the block's return value or beside it (zebra cuts them where
  the layer makes them); dense layers may sit between blocks.
* Planning and emulation read the shape of the model from it: ``d_model``, the experts
  (count, ``top_k``, ``d_ff``, activation) from the MoE layers, the number of layers from
  how many there are, the vocabulary from the largest ``nn.Embedding``, and the attention
  heads from an ``int`` attribute ``n_heads`` (or ``num_heads``, ``num_attention_heads``)
  of some module inside each block (or its ``config``), the key/value heads and each head's
  width from ``n_kv_heads`` (``num_key_value_heads``) and ``head_dim`` beside it, and the
  dense decoder layers from the other members of the module list that holds the blocks. A
  LightningModule with a ``model_cfg`` (:class:`~lightning_hetermoe.configs.ModelConfig`)
  gives all of it directly.
* The zebra and distep modes drive the LightningModule's ``training_step`` (and
  ``validation_step``/``test_step``/``predict_step``) once per micro-batch, with automatic
  optimization; a batch is a tensor or a tuple/list/dict of tensors whose first dimension
  is the batch. Ranks' batches may differ in sequence length (dimension 1) where the
  strategy can tell labels from inputs to pad them (:mod:`.strategy.batch`).

:func:`describe_model` turns a module into a :class:`ModelConfig`; :func:`find_blocks`
returns the blocks; both raise :class:`ModelContractError` with a sentence that says what is
missing.
"""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from .configs import ModelConfig
from .moe import MoELayer, ModuleExperts

HEAD_ATTRIBUTES = ("n_heads", "num_heads", "num_attention_heads")
KV_HEAD_ATTRIBUTES = ("n_kv_heads", "num_key_value_heads", "num_kv_heads")


class ModelContractError(ValueError):
    """The model does not give the strategy what it needs (see this module's docstring)."""


def moe_layers(module: nn.Module) -> list[tuple[str, MoELayer]]:
    return [(n, m) for n, m in module.named_modules() if isinstance(m, MoELayer)]


def find_blocks(module: nn.Module) -> list[tuple[str, nn.Module, MoELayer]]:
    """``(name, block, moe_layer)`` for every MoE layer, in model order; the block is the
    module that holds the MoE layer as a direct child."""
    names = {id(m): n for n, m in module.named_modules()}
    out = []
    for parent in module.modules():
        for child in parent.children():
            if isinstance(child, MoELayer):
                out.append((names[id(parent)], parent, child))
    if not out:
        raise ModelContractError(
            f"{type(module).__name__} holds no lightning_hetermoe.MoELayer: the strategy looks for MoELayer modules "
            f"(each the direct child of a decoder block) to place experts and cut the schedule")
    if len({id(b) for _, b, _ in out}) != len(out):
        raise ModelContractError("a block holds more than one MoELayer: the executor cuts the schedule at blocks, "
                                 "so each block may hold one MoE layer")
    return out


def _positive_int(owner: object, attrs: tuple[str, ...]) -> int | None:
    for attr in attrs:
        n = getattr(owner, attr, None)
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            return n
    return None


def _heads(block_name: str, block: nn.Module) -> tuple[int, int | None, int | None]:
    """``(heads, kv_heads, head_dim)`` of the block's attention, the last two ``None`` where
    the module that gives the head count does not say (as wide as the heads, and
    ``d_model / heads``). A latent attention's (DeepSeek's, with a ``kv_lora_rank``) is
    priced as plain attention of its heads."""
    # Hugging Face attention modules keep the counts only in their config object.
    for m in block.modules():
        for owner in (m, getattr(m, "config", None)):
            n = _positive_int(owner, HEAD_ATTRIBUTES)
            if n is not None:
                latent = getattr(owner, "kv_lora_rank", None) is not None
                kv = None if latent else _positive_int(owner, KV_HEAD_ATTRIBUTES)
                return n, kv if kv is not None and n % kv == 0 else None, \
                    None if latent else _positive_int(owner, ("head_dim",))
    raise ModelContractError(
        f"block {block_name or type(block).__name__} ({type(block).__name__}) has no attention head count: planning "
        f"and emulation read an int attribute {' / '.join(HEAD_ATTRIBUTES)} of a module inside each MoE block "
        f"(e.g. self.n_heads on the attention module, or config.num_attention_heads on a Hugging Face one), "
        f"or a model_cfg on the LightningModule")


def describe_model(module: nn.Module) -> ModelConfig:
    """The model's shape as a :class:`ModelConfig` (for the planner, simulator and emulator)."""
    blocks = find_blocks(module)
    cfg = getattr(module, "model_cfg", None)
    if isinstance(cfg, ModelConfig):
        if cfg.n_layers != len(blocks) or cfg.moe.num_experts != blocks[0][2].num_experts:
            raise ModelContractError(
                f"model_cfg says {cfg.n_layers} layers of {cfg.moe.num_experts} experts, the module holds "
                f"{len(blocks)} MoE layers of {blocks[0][2].num_experts}")
        return cfg
    name, block, moe = blocks[0]
    d_model = moe.router.weight.shape[1]
    heads, kv_heads, head_dim = _heads(name, block)
    if head_dim is not None and (head_dim * heads == d_model or head_dim % 2):
        head_dim = None  # the default's width, or one rotary embeddings cannot pair: priced as d_model / heads
    if head_dim is None and d_model % heads:
        raise ModelContractError(f"d_model={d_model} is not a multiple of {heads} attention heads in {name}")
    embeddings = [m for m in module.modules() if isinstance(m, nn.Embedding)]
    vocab = max((m.num_embeddings for m in embeddings), default=2)
    planned = _planned_moe(moe)
    dense_layers, dense_d_ff = _dense_layers(module, blocks, planned.activation)
    return ModelConfig(name=type(module).__name__.lower(), vocab_size=max(vocab, 2), d_model=d_model,
                       n_layers=len(blocks), n_heads=heads, n_kv_heads=kv_heads, head_dim=head_dim,
                       max_seq_len=1 << 20, dense_layers=dense_layers,
                       dense_d_ff=dense_d_ff, activation_checkpointing=recomputes_blocks(module), moe=planned)


def _params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _dense_layers(module: nn.Module, blocks: list[tuple[str, nn.Module, MoELayer]], activation: str
                  ) -> tuple[int, int]:
    """``(count, d_ff)`` of the decoder layers without an MoE layer (DeepSeek-V3's first
    ``first_k_dense_replace``, Qwen-MoE's ``mlp_only_layers``): the other children of the
    module list that holds the blocks. Their MLP's width is what their parameters hold
    beyond an MoE block's own (attention and norms, the same in both), over the MLP's
    matrices."""
    named = dict(module.named_modules())
    block_ids = {id(b) for _, b, _ in blocks}
    lists = {name.rpartition(".")[0] for name, _, _ in blocks}
    dense = [child for name in lists if isinstance(named.get(name), nn.ModuleList)
             for child in named[name] if id(child) not in block_ids]
    if not dense:
        return 0, 0
    _, block, moe = blocks[0]
    mats = 3 if activation == "swiglu" else 2
    d_model = moe.router.weight.shape[1]
    mlp = _params(dense[0]) - (_params(block) - _params(moe))
    if mlp < mats * d_model:
        raise ModelContractError(
            f"{type(dense[0]).__name__} sits among the MoE blocks without an MoE layer, but holds {mlp} parameters "
            f"beyond an MoE block's attention and norms: too few for a dense MLP of d_model={d_model} (planning "
            f"prices it as one; give the LightningModule a model_cfg with dense_layers and dense_d_ff)")
    return len(dense), round(mlp / (mats * d_model))


def checkpoints_activations(module: nn.Module) -> bool:
    """Whether the model recomputes its blocks in their backward: its ``model_cfg`` says so
    (the pack's model), or Hugging Face's mark on its modules (:func:`recomputes_blocks`)."""
    cfg = getattr(module, "model_cfg", None)
    if isinstance(cfg, ModelConfig):
        return cfg.activation_checkpointing
    return recomputes_blocks(module)


def recomputes_blocks(module: nn.Module) -> bool:
    """Whether the model recomputes its blocks' forward in their backward, as far as it can
    be read from outside: Hugging Face's activation checkpointing marks the modules it
    wraps ``gradient_checkpointing = True``. (``torch.utils.checkpoint`` inside a block of
    your own leaves no mark: give the LightningModule a ``model_cfg`` that says so.)"""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in module.modules())


def _planned_moe(layer: MoELayer):
    """The layer's config as planning sees it. User experts are priced as the GELU MLP with
    as many parameters (two matmuls of ``d_model x d_ff``): what their FLOPs and bytes are
    closest to, without running them."""
    if not isinstance(layer.experts, ModuleExperts):
        return replace(layer.cfg)
    d_model = layer.router.weight.shape[1]
    d_ff = max(1, round(layer.experts.params_per_expert / (2 * d_model)))
    return replace(layer.cfg, d_ff=d_ff, activation="gelu", bias=False)
