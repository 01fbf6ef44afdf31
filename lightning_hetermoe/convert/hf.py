"""Hugging Face sparse MoE blocks <-> this project's :class:`~lightning_hetermoe.moe.MoELayer`.

:func:`to_hetermoe` puts an :class:`HFMoEBlock` (an ``MoELayer``) where each Mixtral,
Qwen2-MoE, Qwen3-MoE, OLMoE or DeepSeek-V3 sparse MoE block stood, with the same weights,
so that the strategy places and routes its experts (DeepSeek-V3's first
``first_k_dense_replace`` layers are dense MLPs and stay as they are); :func:`to_hf` puts
Hugging Face blocks back with the trained weights, for export. Only tensors are
converted: nothing here imports ``transformers``, so the package works without it and
with any version whose block layout :func:`moe_tensors_from_hf` recognises.

Weight layouts (``F.linear`` weights are ``[out, in]``; ours are ``[in, out]``)::

    HF                                         ours
    gate.weight                  [E, d]        router.weight        [E, d]
    experts.gate_up_proj         [E, 2f, d]    experts.w_up         [E, d, 2f]  gate columns, then up
    experts.down_proj            [E, d, f]     experts.w_down       [E, f, d]
      or per expert (older transformers): experts.{e}.w1/w3/w2.weight (Mixtral) or
      experts.{e}.gate_proj/up_proj/down_proj.weight
    shared_expert.gate_proj/up_proj.weight     shared_expert.w_up   [d, 2fs]
    shared_expert.down_proj.weight             shared_expert.w_down [fs, d]
    shared_expert_gate.weight    [1, d]        shared_expert.gate   [1, d]
    DeepSeek-V3: gate.e_score_correction_bias [E]  router.expert_bias [E]
                 shared_experts.gate_proj/up_proj/down_proj (ungated)  shared_expert.w_up/w_down
"""

from __future__ import annotations

import re
import threading
import weakref
from dataclasses import fields
from typing import Any

import torch
from torch import Tensor, nn

from ..configs import MoEConfig
from ..moe import MoEAux, MoELayer

SPARSE_BLOCKS = ("MixtralSparseMoeBlock", "Qwen2MoeSparseMoeBlock", "Qwen3MoeSparseMoeBlock", "OlmoeSparseMoeBlock",
                 "DeepseekV3MoE")
# DeepSeek-V3 balances by its correction bias plus a small sequence-wise loss (its paper's
# alpha = 1e-4); the config carries no coefficient, so this is the converted default.
DEEPSEEK_AUX_LOSS_COEF = 1e-4

# How each family computes its gate's logits (transformers 5.x): Mixtral, Qwen2/3-MoE and OLMoE
# a plain F.linear in the hidden states' dtype (bf16 in a bf16 model; softmax in fp32 after),
# DeepSeek-V3 casts hidden states and gate weight to fp32 first. A converted model routes as
# the original by default (moe.router_dtype); the caller may still choose the other.
HF_ROUTER_DTYPE = {"topk": "input", "sigmoid_group": "float32"}

# Fixed by the Hugging Face block itself; the rest of MoEConfig the caller may choose.
DERIVED_FIELDS = ("num_experts", "top_k", "d_ff", "router", "activation", "bias", "normalize_topk",
                  "shared_expert_d_ff", "shared_expert_gate", "n_group", "topk_group", "routed_scaling_factor")
PER_EXPERT_NAMES = (("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj"))  # (gate, up, down)


class HFMoEBlock(MoELayer):
    """An :class:`MoELayer` in the place of a Hugging Face sparse MoE block: the direct
    child of the decoder layer, where the strategy looks for it.

    The decoder layer takes back the hidden states alone, so each call leaves its
    :class:`MoEAux` in ``last_aux`` for the loss to collect (:func:`moe_aux`). ``last_aux``
    is kept per thread: a forward's aux is collected by the thread that ran it, so forwards
    of several micro-batches may interleave (each on its own thread, as the zebra executor
    runs them) without taking each other's losses.
    ``hf_class`` and ``hf_config`` rebuild the original block for :func:`to_hf`.
    """

    def __init__(self, d_model: int, cfg: MoEConfig, hf_class: type, hf_config: Any, input_jitter: float = 0.0
                 ) -> None:
        super().__init__(d_model, cfg)
        self.hf_class, self.hf_config = hf_class, hf_config
        self.input_jitter = input_jitter

    @property
    def last_aux(self) -> MoEAux | None:
        return _thread_aux().get(self)

    @last_aux.setter
    def last_aux(self, aux: MoEAux | None) -> None:
        if aux is None:
            _thread_aux().pop(self, None)
        else:
            _thread_aux()[self] = aux

    def forward(self, hidden_states: Tensor) -> Tensor:  # type: ignore[override]
        if self.training and self.input_jitter > 0:
            # Mixtral's router_jitter_noise scales the experts' input too, not only the router's.
            noise = torch.empty_like(hidden_states).uniform_(1.0 - self.input_jitter, 1.0 + self.input_jitter)
            hidden_states = hidden_states * noise
        y, self.last_aux = super().forward(hidden_states)
        return y

    def aux_of(self, output: Any) -> MoEAux | None:
        """The aux of the forward that just ran: kept beside the hidden states it returned."""
        return self.last_aux


_local = threading.local()


def _thread_aux() -> "weakref.WeakKeyDictionary[HFMoEBlock, MoEAux]":
    # module-level, not on the block: a block stays deep-copyable and picklable
    table = getattr(_local, "aux", None)
    if table is None:
        table = _local.aux = weakref.WeakKeyDictionary()
    return table


def moe_aux(model: nn.Module) -> list[MoEAux]:
    """The auxiliary losses of every :class:`HFMoEBlock` from the last forward, in model
    order; each is handed out once, so a stale one is never counted twice."""
    out = []
    for name, m in model.named_modules():
        if isinstance(m, HFMoEBlock):
            if m.last_aux is None:
                raise RuntimeError(f"MoE layer {name} did not run since its losses were last collected: "
                                   f"collect them once after each forward")
            out.append(m.last_aux)
            m.last_aux = None
    return out


# -- tensors ----------------------------------------------------------------------------------

def moe_tensors_from_hf(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """An HF sparse MoE block's ``state_dict`` (or its gradients, under the same names) as
    an :class:`MoELayer`'s. Every tensor must be consumed: an unknown one is an error, not a
    weight silently lost."""
    sd = dict(sd)
    out = {"router.weight": sd.pop("gate.weight")}
    if "gate.e_score_correction_bias" in sd:
        out["router.expert_bias"] = sd.pop("gate.e_score_correction_bias")
    if "experts.gate_up_proj" in sd:
        out["experts.w_up"] = sd.pop("experts.gate_up_proj").transpose(1, 2)
        out["experts.w_down"] = sd.pop("experts.down_proj").transpose(1, 2)
    else:
        gate, up, down = _per_expert_names(sd)
        n = len({k.split(".")[1] for k in sd if re.match(r"experts\.\d+\.", k)})
        ups, downs = [], []
        for e in range(n):
            g, u = sd.pop(f"experts.{e}.{gate}.weight"), sd.pop(f"experts.{e}.{up}.weight")
            ups.append(torch.cat([g.t(), u.t()], dim=1))
            downs.append(sd.pop(f"experts.{e}.{down}.weight").t())
        out["experts.w_up"], out["experts.w_down"] = torch.stack(ups), torch.stack(downs)
    for hf in ("shared_expert", "shared_experts"):  # Qwen2-MoE's (gated), DeepSeek-V3's (not)
        if f"{hf}.gate_proj.weight" in sd:
            g, u = sd.pop(f"{hf}.gate_proj.weight"), sd.pop(f"{hf}.up_proj.weight")
            down, gate_w = sd.pop(f"{hf}.down_proj.weight"), sd.pop("shared_expert_gate.weight", None)
            if g.shape[0] == 0:  # DeepSeek-V3 with n_shared_experts=0: a zero-width MLP that adds nothing
                continue
            out["shared_expert.w_up"] = torch.cat([g.t(), u.t()], dim=1)
            out["shared_expert.w_down"] = down.t()
            if gate_w is not None:
                out["shared_expert.gate"] = gate_w
    if sd:
        raise ValueError(f"Hugging Face MoE block tensors this converter does not know: {sorted(sd)}")
    return out


def moe_tensors_to_hf(ours: dict[str, Tensor], hf_names: list[str]) -> dict[str, Tensor]:
    """Inverse of :func:`moe_tensors_from_hf`, laid out as the block whose tensor names are
    ``hf_names``."""
    w_up, w_down = ours["experts.w_up"], ours["experts.w_down"]
    f = w_down.shape[1]
    out = {"gate.weight": ours["router.weight"]}
    if "router.expert_bias" in ours:
        if "gate.e_score_correction_bias" not in hf_names:
            raise ValueError("the layer chooses its experts with an expert_bias (moe.expert_bias=true) that this "
                             "Hugging Face block has no place for: exported without it, the model would route "
                             "differently")
        out["gate.e_score_correction_bias"] = ours["router.expert_bias"]
    if "experts.gate_up_proj" in hf_names:
        out["experts.gate_up_proj"] = w_up.transpose(1, 2)
        out["experts.down_proj"] = w_down.transpose(1, 2)
    else:
        gate, up, down = _per_expert_names(dict.fromkeys(hf_names))
        for e in range(w_up.shape[0]):
            out[f"experts.{e}.{gate}.weight"] = w_up[e, :, :f].t()
            out[f"experts.{e}.{up}.weight"] = w_up[e, :, f:].t()
            out[f"experts.{e}.{down}.weight"] = w_down[e].t()
    if "shared_expert.w_up" in ours:
        fs = ours["shared_expert.w_down"].shape[0]
        hf = "shared_experts" if "shared_experts.gate_proj.weight" in hf_names else "shared_expert"
        out[f"{hf}.gate_proj.weight"] = ours["shared_expert.w_up"][:, :fs].t()
        out[f"{hf}.up_proj.weight"] = ours["shared_expert.w_up"][:, fs:].t()
        out[f"{hf}.down_proj.weight"] = ours["shared_expert.w_down"].t()
        if "shared_expert.gate" in ours:
            out["shared_expert_gate.weight"] = ours["shared_expert.gate"]
    elif "shared_experts.gate_proj.weight" in hf_names:  # the zero-width one moe_tensors_from_hf dropped
        d = w_up.shape[1]
        for name, shape in (("gate_proj", (0, d)), ("up_proj", (0, d)), ("down_proj", (d, 0))):
            out[f"shared_experts.{name}.weight"] = w_up.new_empty(shape)
    if set(out) != set(hf_names):
        raise ValueError(f"cannot lay out the MoE layer as this Hugging Face block: it has {sorted(hf_names)}, "
                         f"the layer gives {sorted(out)}")
    return out


def _per_expert_names(sd: dict) -> tuple[str, str, str]:
    for names in PER_EXPERT_NAMES:
        if f"experts.0.{names[0]}.weight" in sd:
            return names
    raise ValueError(f"unknown Hugging Face expert layout: expected experts.gate_up_proj/down_proj or per-expert "
                     f"{' or '.join('/'.join(n) for n in PER_EXPERT_NAMES)} weights, found {sorted(sd)}")


def fresh_copy(t: Tensor) -> Tensor:
    # Own contiguous storage: the expert kernels want it, and the old block may live on.
    return t.detach().clone(memory_format=torch.contiguous_format)


# -- modules ----------------------------------------------------------------------------------

def sparse_blocks(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """``(parent, attribute, block)`` for every Hugging Face sparse MoE block, in model order."""
    return [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
            if type(child).__name__ in SPARSE_BLOCKS]


def moe_config_for(block: nn.Module, config: Any, **options: Any) -> MoEConfig:
    """The :class:`MoEConfig` that computes what ``block`` computes (``options``: the other
    MoEConfig fields, e.g. ``capacity_factor`` or ``aux_loss_coef``)."""
    derived = sorted(set(options) & set(DERIVED_FIELDS))
    if derived:
        raise ValueError(f"{derived} are read from the Hugging Face block and cannot be overridden")
    unknown = sorted(set(options) - {f.name for f in fields(MoEConfig)})
    if unknown:
        raise ValueError(f"unknown MoEConfig field(s) {unknown}")
    experts = block.experts
    if getattr(experts, "is_transposed", False) or not getattr(experts, "is_concatenated", True):
        raise ValueError(f"{type(experts).__name__} stores transposed or interleaved gate/up weights; this converter "
                         f"reads the concatenated [E, 2*d_ff, d] layout")
    act = getattr(config, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"hidden_act={act!r}: the converted experts are SwiGLU (silu); other activations are not "
                         f"supported")
    sd = block.state_dict()
    ours = moe_tensors_from_hf(sd)
    shared = ours.get("shared_expert.w_down")
    router = getattr(block, "gate", None)
    # The block's own flag: newer transformers keep it on the router, older on the block.
    normalize = getattr(router, "norm_topk_prob", getattr(block, "norm_topk_prob", True))
    routing: dict[str, Any] = dict(router="topk")
    if "router.expert_bias" in ours:  # DeepSeek-V3: sigmoid scores, group-limited, its correction bias
        if options.pop("expert_bias", True) is not True:
            raise ValueError("expert_bias=False: DeepSeek-V3 chooses its experts with its e_score_correction_bias, "
                             "which the converted layer keeps; set bias_update_rate=0 to hold it fixed instead")
        options.setdefault("aux_loss_coef", DEEPSEEK_AUX_LOSS_COEF)
        routing = dict(router="sigmoid_group", expert_bias=True, n_group=config.n_group, topk_group=config.topk_group,
                       routed_scaling_factor=float(config.routed_scaling_factor))
    options.setdefault("router_dtype", HF_ROUTER_DTYPE[routing["router"]])
    return MoEConfig(num_experts=ours["router.weight"].shape[0], top_k=config.num_experts_per_tok,
                     d_ff=ours["experts.w_down"].shape[1], activation="swiglu", bias=False,
                     normalize_topk=bool(normalize), shared_expert_d_ff=0 if shared is None else shared.shape[0],
                     shared_expert_gate="shared_expert.gate" in ours, **routing, **options)


def to_hetermoe(model: nn.Module, **options: Any) -> nn.Module:
    """Replace every Mixtral/Qwen2-MoE/Qwen3-MoE/OLMoE/DeepSeek-V3 sparse MoE block of ``model`` by an
    :class:`HFMoEBlock` holding the same weights, in place; returns ``model``.

    ``options`` are further :class:`MoEConfig` fields (``capacity_factor``,
    ``expert_backend``, ``z_loss_coef``, ...); ``router_dtype`` defaults to the family's
    own (``HF_ROUTER_DTYPE``: logits in the hidden dtype, fp32 for DeepSeek-V3).
    ``aux_loss_coef`` defaults to the model's ``router_aux_loss_coef * top_k / layers``:
    Hugging Face pools every layer's tokens into one loss that is ``top_k`` times ours for
    one layer, and we sum one loss per layer (see
    :mod:`lightning_hetermoe.moe.balance`), so the two agree when the layers route alike.
    The torch RNG is left untouched.
    """
    config = _text_config(model)
    found = sparse_blocks(model)
    if not found:
        raise ValueError(f"{type(model).__name__} holds no sparse MoE block of a supported class {SPARSE_BLOCKS}")
    if "aux_loss_coef" not in options and getattr(config, "router_aux_loss_coef", None) is not None:
        options["aux_loss_coef"] = config.router_aux_loss_coef * config.num_experts_per_tok / len(found)
    with torch.random.fork_rng(devices=[]):  # the layers' init seeds: drawn here, the caller's RNG untouched
        for parent, name, block in found:
            _convert_block(parent, name, block, config, options)
    return model


def _convert_block(parent: nn.Module, name: str, block: nn.Module, config: Any, options: dict[str, Any]) -> None:
    cfg = moe_config_for(block, config, **dict(options))
    weight = block.gate.weight
    with torch.device("meta"):  # the weights come from the block: no init, no RNG draws
        layer = HFMoEBlock(weight.shape[1], cfg, type(block), config,
                           input_jitter=float(getattr(block, "jitter_noise", 0.0) or 0.0))
    tensors = {k: fresh_copy(v) for k, v in moe_tensors_from_hf(block.state_dict()).items()}
    if "router.expert_bias" in tensors:  # fp32 whatever the model's dtype, as Router keeps it
        tensors["router.expert_bias"] = tensors["router.expert_bias"].float()
    elif cfg.expert_bias:  # balancing by a bias asked of a family without one: it starts even
        tensors["router.expert_bias"] = torch.zeros(cfg.num_experts, dtype=torch.float32, device=weight.device)
    layer.load_state_dict(tensors, strict=True, assign=True)
    layer.experts.expert_ids = torch.arange(cfg.num_experts, device=weight.device)
    if not weight.is_meta:  # a block built on the meta device converts to a layer on it (filled at set-up)
        check_filled(layer, "the converted MoE layer")
    layer.train(block.training)
    setattr(parent, name, layer)


def to_hf(model: nn.Module) -> nn.Module:
    """Put the original Hugging Face block class back wherever :func:`to_hetermoe` put an
    :class:`HFMoEBlock`, with the layer's current weights, in place; returns ``model``."""
    found = [(parent, f"{path}.{name}".lstrip("."), name, child) for path, parent in model.named_modules()
             for name, child in parent.named_children() if isinstance(child, HFMoEBlock)]
    if not found:
        raise ValueError(f"{type(model).__name__} holds no HFMoEBlock (made by to_hetermoe) to convert back")
    for parent, path, name, layer in found:
        if layer.experts.num_local_experts != layer.num_experts:
            raise ValueError(f"{path} holds {layer.experts.num_local_experts} of {layer.num_experts} experts: export "
                             f"after training, when every rank holds all experts again")
        with torch.device("meta"):
            block = layer.hf_class(layer.hf_config)
        hf_names = list(block.state_dict())
        tensors = moe_tensors_to_hf(layer.state_dict(), hf_names)
        block.load_state_dict({k: fresh_copy(v) for k, v in tensors.items()}, strict=True, assign=True)
        check_filled(block, layer.hf_class.__name__)
        block.train(layer.training)
        setattr(parent, name, block)
    return model


def export_info(module: nn.Module) -> dict[str, Any] | None:
    """Where a converted Hugging Face model sits in ``module`` (its name prefix) and its
    config: what an offline export back to Hugging Face needs (``None``: no such model)."""
    for name, m in module.named_modules():
        config = getattr(m, "config", None)
        if hasattr(config, "to_dict") and any(isinstance(c, HFMoEBlock) for c in m.modules()):
            return {"prefix": f"{name}." if name else "", "config": config.to_dict()}
    return None


def check_filled(module: nn.Module, what: str) -> None:
    """Built on the meta device and filled from a state dict: no tensor may be left empty."""
    left = [n for n, t in list(module.named_parameters()) + list(module.named_buffers()) if t.is_meta]
    if left:
        raise ValueError(f"{what} has tensors the conversion did not fill: {left}")


def _text_config(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"{type(model).__name__} has no .config: pass a transformers PreTrainedModel")
    return config.get_text_config() if hasattr(config, "get_text_config") else config
