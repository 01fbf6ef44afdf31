"""Typed configs. Each dataclass maps one-to-one onto a Hydra config group under ``conf/``.

Validation lives in ``__post_init__`` so that a bad value is rejected the moment a config
is built (from Python or from YAML through :func:`from_cfg`), before any process starts.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, TypeVar

ROUTERS = ("topk", "switch", "gshard", "noisy_topk", "sigmoid_group")
ACTIVATIONS = ("gelu", "swiglu")
EXPERT_BACKENDS = ("auto", "triton", "grouped_mm", "torch")
ROUTER_DTYPES = ("float32", "input")
OPTIMIZERS = ("adamw", "adam", "sgd")
FUSED = (True, False, "auto")
ARCHITECTURES = ("pack", "hf_mixtral")
CORPORA = ("pydoc_topics", "tokenized")


class ConfigError(ValueError):
    """A bad configuration value, caught before any process starts. The message names the
    Hydra path of the field and what would be valid; recipes print it as one line."""


def _require(cond: bool, field_name: str, value: Any, valid: str) -> None:
    if not cond:
        raise ConfigError(f"{field_name}={value!r} is invalid: {valid}")


@dataclass
class MoEConfig:
    """One MoE feed-forward block: router, experts, capacity and auxiliary losses."""

    num_experts: int = 8
    top_k: int = 2
    d_ff: int = 256
    router: str = "topk"
    # 0 means dropless; > 0 caps each expert at ceil(cf * tokens * top_k / num_experts).
    capacity_factor: float = 0.0
    activation: str = "swiglu"
    bias: bool = False
    # Switch-style multiplicative jitter on the router input while training.
    jitter_eps: float = 0.01
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.001
    # auto: the backend measured fastest on this kind of device (kernels/measured.json), else
    # Triton on CUDA sm80+ and the per-expert torch loop elsewhere (CPU, V100, T4);
    # triton: the Triton kernels (no tensor cores before sm80); grouped_mm: torch._grouped_mm;
    # torch: one matmul per expert. See lightning_hetermoe.moe.experts.
    expert_backend: str = "auto"
    # Recompute the expert hidden activation in backward instead of storing it.
    recompute_activation: bool = False
    # topk router: rescale the kept top-k probabilities to sum to 1 (Mixtral); False keeps
    # the raw softmax probabilities (OLMoE, Qwen-MoE with norm_topk_prob=False).
    normalize_topk: bool = True
    # Width of a dense expert every token passes through, scaled by a sigmoid gate
    # (Qwen2-MoE); 0 = none. It runs where the layer runs, never through the dispatcher.
    shared_expert_d_ff: int = 0
    # The shared expert's per-token sigmoid gate (Qwen2-MoE); false: ungated (DeepSeek-V3).
    shared_expert_gate: bool = True
    # Aux-loss-free balancing (DeepSeek-V3): a per-expert bias on the scores experts are
    # chosen by (never on the combine weights), moved once per optimizer step by
    # bias_update_rate toward even global load. Works with every router.
    expert_bias: bool = False
    bias_update_rate: float = 1e-3
    # sigmoid_group router (DeepSeek-V3): experts in n_group groups, choices limited to the
    # topk_group best groups (a group scores the sum of its two best experts), combine
    # weights times routed_scaling_factor.
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # The dtype the gate's logits are computed in: float32 (the gate GEMM in fp32, autocast
    # off: near ties between experts are not decided by rounding), or input (a plain linear
    # in the hidden states' dtype, autocast applying as to any linear: what Mixtral, Qwen-MoE
    # and OLMoE do, so a converted model of theirs routes as the original). Everything after
    # the logits (softmax, top-k, weights, aux losses) runs in fp32 either way.
    router_dtype: str = "float32"

    def __post_init__(self) -> None:
        _require(self.num_experts >= 1, "model.moe.num_experts", self.num_experts, "must be >= 1")
        _require(
            1 <= self.top_k <= self.num_experts,
            "model.moe.top_k",
            self.top_k,
            f"must be in [1, num_experts={self.num_experts}]",
        )
        _require(self.d_ff >= 1, "model.moe.d_ff", self.d_ff, "must be >= 1")
        _require(self.router in ROUTERS, "model.moe.router", self.router, f"must be one of {ROUTERS}")
        if self.router == "switch":
            _require(self.top_k == 1, "model.moe.top_k", self.top_k, "the switch router is top-1: set top_k=1")
        if self.router == "gshard":
            _require(self.top_k == 2, "model.moe.top_k", self.top_k, "the gshard router is top-2: set top_k=2")
        _require(
            self.capacity_factor >= 0,
            "model.moe.capacity_factor",
            self.capacity_factor,
            "must be >= 0 (0 = dropless)",
        )
        _require(
            self.activation in ACTIVATIONS, "model.moe.activation", self.activation, f"must be one of {ACTIVATIONS}"
        )
        _require(self.jitter_eps >= 0, "model.moe.jitter_eps", self.jitter_eps, "must be >= 0")
        _require(self.aux_loss_coef >= 0, "model.moe.aux_loss_coef", self.aux_loss_coef, "must be >= 0")
        _require(self.z_loss_coef >= 0, "model.moe.z_loss_coef", self.z_loss_coef, "must be >= 0")
        _require(
            self.expert_backend in EXPERT_BACKENDS,
            "model.moe.expert_backend",
            self.expert_backend,
            f"must be one of {EXPERT_BACKENDS}",
        )
        _require(isinstance(self.normalize_topk, bool), "model.moe.normalize_topk", self.normalize_topk,
                 "must be true or false")
        _require(isinstance(self.bias_update_rate, (int, float)) and not isinstance(self.bias_update_rate, bool)
                 and self.bias_update_rate >= 0, "model.moe.bias_update_rate", self.bias_update_rate,
                 "must be a number >= 0")
        _require(isinstance(self.n_group, int) and self.n_group >= 1 and self.num_experts % self.n_group == 0,
                 "model.moe.n_group", self.n_group, f"must be an integer >= 1 dividing num_experts={self.num_experts}")
        _require(isinstance(self.topk_group, int) and 1 <= self.topk_group <= self.n_group, "model.moe.topk_group",
                 self.topk_group, f"must be an integer in [1, n_group={self.n_group}]")
        _require(self.router != "sigmoid_group" or self.top_k <= self.topk_group * self.num_experts // self.n_group,
                 "model.moe.top_k", self.top_k, f"must be <= topk_group * num_experts / n_group = "
                 f"{self.topk_group * self.num_experts // self.n_group} (the experts of the chosen groups)")
        scaling = self.routed_scaling_factor
        _require(isinstance(scaling, (int, float)) and not isinstance(scaling, bool) and scaling > 0,
                 "model.moe.routed_scaling_factor", scaling, "must be a number > 0")
        if self.router != "sigmoid_group":  # other routers would ignore them without a word
            for name, default in (("n_group", 1), ("topk_group", 1), ("routed_scaling_factor", 1.0)):
                _require(getattr(self, name) == default, f"model.moe.{name}", getattr(self, name),
                         f"only the sigmoid_group router reads it: set router=sigmoid_group or {name}={default}")
        _require(self.router_dtype in ROUTER_DTYPES, "model.moe.router_dtype", self.router_dtype,
                 f"must be one of {ROUTER_DTYPES}")
        _require(isinstance(self.expert_bias, bool), "model.moe.expert_bias", self.expert_bias,
                 "must be true or false")
        _require(isinstance(self.shared_expert_gate, bool), "model.moe.shared_expert_gate", self.shared_expert_gate,
                 "must be true or false")
        if not self.normalize_topk:
            _require(self.router in ("topk", "sigmoid_group"), "model.moe.normalize_topk", self.normalize_topk,
                     f"only the topk and sigmoid_group routers have an un-normalised variant (router={self.router!r} fixes its weights)")
        _require(isinstance(self.shared_expert_d_ff, int) and not isinstance(self.shared_expert_d_ff, bool)
                 and self.shared_expert_d_ff >= 0, "model.moe.shared_expert_d_ff", self.shared_expert_d_ff,
                 "must be an integer >= 0 (0 = no shared expert)")


@dataclass
class ModelConfig:
    """A Mixtral-style decoder: RMSNorm, causal attention, an MoE FFN in its ``n_layers``
    MoE layers, after ``dense_layers`` decoder layers whose FFN is a dense MLP (DeepSeek's
    ``first_k_dense_replace``)."""

    name: str = "tiny"
    vocab_size: int = 256
    d_model: int = 64
    # Decoder layers with an MoE FFN (the layers whose experts a plan places).
    n_layers: int = 2
    # Decoder layers before them whose FFN is one dense MLP of dense_d_ff (DeepSeek-V2-Lite's
    # first layer): run and priced where attention runs, in addition to n_layers.
    dense_layers: int = 0
    dense_d_ff: int = 0
    n_heads: int = 4
    max_seq_len: int = 128
    # Key/value heads for grouped-query attention; None = n_heads (multi-head attention).
    n_kv_heads: int | None = None
    # Width of each attention head; None = d_model / n_heads. Set where a model's heads are
    # wider than that (Qwen3-30B-A3B: 32 heads of 128 over d_model 2048): the queries and the
    # output projection are n_heads x head_dim wide.
    head_dim: int | None = None
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    # Recompute each decoder block's forward in its backward instead of storing its
    # activations (what long sequences need); every parallel mode supports it.
    activation_checkpointing: bool = False
    # The LM head's cross-entropy runs this many tokens at a time (the pack's model): its fp32
    # logits never exist for more at once (model/loss.py); the memory model plans with it.
    loss_chunk_tokens: int = 4096
    # pack: this pack's MoETransformer; hf_mixtral: a transformers MixtralForCausalLM of this
    # shape, converted (to_hetermoe) and trained as HFMoELanguageModel (the `hf` extra)
    architecture: str = "pack"
    moe: MoEConfig = field(default_factory=MoEConfig)

    def __post_init__(self) -> None:
        if isinstance(self.moe, dict):
            self.moe = MoEConfig(**self.moe)
        _require(self.architecture in ARCHITECTURES, "model.architecture", self.architecture,
                 f"must be one of {ARCHITECTURES}")
        _require(self.vocab_size >= 2, "model.vocab_size", self.vocab_size, "must be >= 2")
        _require(self.n_layers >= 1, "model.n_layers", self.n_layers, "must be >= 1")
        _require(isinstance(self.dense_layers, int) and not isinstance(self.dense_layers, bool)
                 and self.dense_layers >= 0, "model.dense_layers", self.dense_layers,
                 "must be an integer >= 0 (decoder layers with a dense MLP, before the n_layers MoE layers)")
        _require(isinstance(self.dense_d_ff, int) and not isinstance(self.dense_d_ff, bool)
                 and (self.dense_d_ff >= 1 if self.dense_layers else self.dense_d_ff >= 0), "model.dense_d_ff",
                 self.dense_d_ff, "must be an integer >= 1 where model.dense_layers > 0 (the dense MLP's hidden "
                 "width), >= 0 otherwise")
        _require(self.n_heads >= 1, "model.n_heads", self.n_heads, "must be >= 1")
        _require(isinstance(self.head_dim, int) and not isinstance(self.head_dim, bool) and self.head_dim >= 2
                 and self.head_dim % 2 == 0 if self.head_dim is not None else True, "model.head_dim", self.head_dim,
                 "must be null (= d_model / n_heads) or an even integer >= 2 (rotary embeddings pair its dimensions)")
        _require(
            self.d_model >= 1 and (self.head_dim is not None or self.d_model % self.n_heads == 0),
            "model.d_model",
            self.d_model,
            f"must be a positive multiple of n_heads={self.n_heads} (or give model.head_dim)",
        )
        _require(self.max_seq_len >= 1, "model.max_seq_len", self.max_seq_len, "must be >= 1")
        _require(isinstance(self.loss_chunk_tokens, int) and not isinstance(self.loss_chunk_tokens, bool)
                 and self.loss_chunk_tokens >= 1, "model.loss_chunk_tokens", self.loss_chunk_tokens,
                 "must be an integer >= 1 (tokens per chunk of the loss)")
        _require(
            self.n_kv_heads is None or (isinstance(self.n_kv_heads, int) and not isinstance(self.n_kv_heads, bool)
                                        and 1 <= self.n_kv_heads <= self.n_heads
                                        and self.n_heads % self.n_kv_heads == 0),
            "model.n_kv_heads",
            self.n_kv_heads,
            f"must be null (= n_heads) or a divisor of n_heads={self.n_heads}",
        )
        _require(isinstance(self.rope_theta, (int, float)) and not isinstance(self.rope_theta, bool)
                 and self.rope_theta > 0, "model.rope_theta", self.rope_theta, "must be a number > 0")
        _require(isinstance(self.norm_eps, (int, float)) and not isinstance(self.norm_eps, bool)
                 and self.norm_eps > 0, "model.norm_eps", self.norm_eps, "must be a number > 0")

    @property
    def head_size(self) -> int:
        """Each attention head's width: ``head_dim``, or ``d_model / n_heads`` where it is null."""
        return self.d_model // self.n_heads if self.head_dim is None else self.head_dim

    @property
    def attention_width(self) -> int:
        """The queries' and the attention output's width, ``n_heads x head_size``."""
        return self.n_heads * self.head_size

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads


@dataclass
class OptimConfig:
    """``adamw`` (decoupled weight decay), ``adam`` (weight decay as L2 in the gradient) or
    ``sgd`` (optionally with momentum and Nesterov)."""

    name: str = "adamw"
    lr: float = 3e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    momentum: float = 0.0  # sgd only
    nesterov: bool = False  # sgd only; needs momentum > 0
    warmup_steps: int = 10
    # torch's fused step: one kernel over the parameters and no temporaries (the default
    # multi-tensor Adam step allocates 4 bytes per parameter at once on a GPU and moves 84
    # bytes per fp32 parameter against the fused step's 32). auto: fused where every
    # parameter is on a GPU or the CPU and the run can clip for it (model.lm.resolve_fused)
    fused: bool | str = "auto"

    def __post_init__(self) -> None:
        _require(self.name in OPTIMIZERS, "optim.name", self.name, f"must be one of {OPTIMIZERS}")
        _require(self.lr > 0, "optim.lr", self.lr, "must be > 0")
        _require(self.weight_decay >= 0, "optim.weight_decay", self.weight_decay, "must be >= 0")
        _require(0 <= self.momentum < 1, "optim.momentum", self.momentum, "must be in [0, 1)")
        _require(self.warmup_steps >= 0, "optim.warmup_steps", self.warmup_steps, "must be >= 0")
        _require(self.fused in FUSED, "optim.fused", self.fused, "must be true, false or auto")
        _require(not self.nesterov or (self.name == "sgd" and self.momentum > 0), "optim.nesterov", self.nesterov,
                 "Nesterov needs name=sgd and momentum > 0")
        _require(len(tuple(self.betas)) == 2 and all(0 <= b < 1 for b in self.betas), "optim.betas", self.betas,
                 "must be two numbers in [0, 1)")
        self.betas = tuple(self.betas)  # YAML gives a list


@dataclass
class DataConfig:
    """Language-modelling data: byte windows of text that ships with Python (``pydoc_topics``,
    no download), or a tokenised corpus on disk (``tokenized``: a directory that
    ``recipes/prepare_data.py`` wrote, packed into rows of ``seq_len`` tokens)."""

    corpus: str = "pydoc_topics"
    # corpus=tokenized: the prepared directory (tokens.bin, index.npy, meta.json)
    path: str | None = None
    seq_len: int = 64
    batch_size: int = 8
    # pydoc_topics: the last fraction of the bytes; tokenized: whole documents (a seeded
    # choice) until they hold this fraction of the tokens
    val_fraction: float = 0.05
    # Samples per epoch. pydoc_topics: fixed windows at seeded random offsets; tokenized:
    # null = every packed row of the training documents, N = at most N rows, evenly spaced.
    train_windows: int | None = 4096
    # validation samples (tokenized: at most this many packed rows, evenly spaced)
    val_windows: int = 64
    shuffle: bool = True
    seed: int = 1234
    num_workers: int = 0
    # corpus=tokenized: batches carry per-row document (segment) ids, so attention stays
    # inside a document and no loss is taken on a document's first token; false: plain
    # (input, target) rows across documents (nanoGPT-style, for models without segment ids)
    document_mask: bool = True

    def __post_init__(self) -> None:
        _require(self.corpus in CORPORA, "data.corpus", self.corpus, f"must be one of {CORPORA}")
        _require(self.seq_len >= 2, "data.seq_len", self.seq_len, "must be >= 2")
        _require(self.batch_size >= 1, "data.batch_size", self.batch_size, "must be >= 1")
        _require(0 < self.val_fraction < 1, "data.val_fraction", self.val_fraction, "must be in (0, 1)")
        if self.corpus == "tokenized":
            _require(isinstance(self.path, str) and self.path != "", "data.path", self.path,
                     "data.corpus=tokenized needs the directory recipes/prepare_data.py wrote")
            _require(self.train_windows is None or self.train_windows >= 1, "data.train_windows", self.train_windows,
                     "must be null (every packed row) or >= 1")
        else:
            _require(self.path is None, "data.path", self.path,
                     f"is read only with data.corpus=tokenized (corpus={self.corpus!r} ships with Python)")
            _require(self.train_windows is not None and self.train_windows >= 1, "data.train_windows",
                     self.train_windows, "must be >= 1")
        _require(self.val_windows >= 1, "data.val_windows", self.val_windows, "must be >= 1")
        _require(isinstance(self.num_workers, int) and self.num_workers >= 0, "data.num_workers", self.num_workers,
                 "must be an integer >= 0")
        _require(isinstance(self.document_mask, bool), "data.document_mask", self.document_mask, "must be true or false")


# A byte-level BPE's alphabet is the 256 bytes, plus its end-of-document token.
MIN_BPE_VOCAB = 257


@dataclass
class PrepareConfig:
    """``recipes/prepare_data.py`` (``conf/prepare_data.yaml``): text files to a tokenised
    corpus on disk."""

    # A directory (every file under it), a glob, or one file; .jsonl files hold one document
    # per line (its `text_field`), any other file is one document. null: the CPython docs that
    # ship with Python, one document per pydoc topic.
    input: str | None = None
    out: str = "data/pydoc_bpe"
    # null: train a byte-level BPE here on the input; else a tokenizer.json file or a Hugging
    # Face tokenizer directory on disk (never downloaded)
    tokenizer: str | None = None
    vocab_size: int = 4096  # the trained BPE's (tokenizer=null only)
    # BPE merges need a pair seen this often (tokenizer=null only)
    min_frequency: int = 2
    # the trained BPE learns from at most this much text (the first documents)
    tokenizer_train_bytes: int = 200_000_000
    # the token appended to every document: null = <|endoftext|> for a trained BPE, the
    # tokenizer's own end-of-sequence token otherwise
    eos_token: str | None = None
    text_field: str = "text"
    # a progress line at most this often (seconds)
    progress_every_s: float = 5.0

    def __post_init__(self) -> None:
        _require(isinstance(self.out, str) and self.out != "", "out", self.out, "must be a directory path")
        _require(self.input is None or (isinstance(self.input, str) and self.input != ""), "input", self.input,
                 "must be a directory, a glob or a file (null: the embedded pydoc corpus)")
        if self.tokenizer is None:
            _require(isinstance(self.vocab_size, int) and self.vocab_size >= MIN_BPE_VOCAB, "vocab_size",
                     self.vocab_size, f"a byte-level BPE needs at least {MIN_BPE_VOCAB} (256 bytes + the "
                     f"end-of-document token)")
            _require(self.vocab_size <= 2**32, "vocab_size", self.vocab_size, "must be <= 2**32")
        _require(isinstance(self.min_frequency, int) and self.min_frequency >= 1, "min_frequency",
                 self.min_frequency, "must be an integer >= 1")
        _require(self.tokenizer_train_bytes >= 1, "tokenizer_train_bytes", self.tokenizer_train_bytes, "must be >= 1")
        _require(self.progress_every_s > 0, "progress_every_s", self.progress_every_s, "must be > 0")


T = TypeVar("T")


def from_cfg(cls: type[T], cfg: Any, section: str | None = None) -> T:
    """Build dataclass ``cls`` from a DictConfig/dict, naming any unknown field (under the
    Hydra ``section``, e.g. ``model``, when given)."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(cfg, cls):
        return cfg
    if isinstance(cfg, DictConfig):
        cfg = OmegaConf.to_container(cfg, resolve=True)
    if cfg is not None and not isinstance(cfg, Mapping):
        # a config group's name (model "d1", cluster "o1") or a list: what dict() would
        # turn into "dictionary update sequence element #0 has length 1"
        where = section or cls.__name__.removesuffix("Config").lower()
        named = (f" (a Hydra recipe's {where}=<name> loads conf/{where}/<name>.yaml into one)"
                 if isinstance(cfg, str) and where in ("model", "cluster") else "")
        raise ConfigError(f"{where}={cfg!r} is invalid: expected a {cls.__name__} or a dict of its fields{named}")
    cfg = dict(cfg or {})
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(cfg) - set(known))
    if unknown:
        where = f"{section}: " if section else f"{cls.__name__}: "
        raise ConfigError(f"{where}unknown field(s) {unknown}; valid fields are {sorted(known)}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in cfg.items():
        sub = hints[name]
        nested = f"{section}.{name}" if section else None
        kwargs[name] = from_cfg(sub, value, nested) if is_dataclass(sub) and isinstance(value, dict) else value
    return cls(**kwargs)


def workload_dir():
    """The named models of ``conf/model`` (d1, w2, ...): workloads the emulated clock can
    stand for. Package data (``lightning_hetermoe.conf``), found the same way from a source
    tree, an editable install and a wheel."""
    from importlib.resources import files

    return files("lightning_hetermoe.conf") / "model"


def workload_model(spec: Any) -> ModelConfig:
    """A workload's model: the name of a ``conf/model`` file (``d1``, ``w2`` ...) or its fields."""
    if isinstance(spec, ModelConfig):
        return spec
    if isinstance(spec, str):
        folder = workload_dir()
        path = folder / f"{spec}.yaml"
        if not path.is_file():
            known = sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml"))
            raise ConfigError(f"cluster.emulate_workload.model={spec!r} is invalid: must be one of {known} "
                              f"(the files of conf/model) or a mapping of model fields")
        from omegaconf import OmegaConf

        return from_cfg(ModelConfig, OmegaConf.create(path.read_text()), "cluster.emulate_workload.model")
    return from_cfg(ModelConfig, spec, "cluster.emulate_workload.model")
