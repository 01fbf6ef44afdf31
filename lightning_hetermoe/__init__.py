"""lightning-hetermoe: HeterMoE zebra parallelism as a PyTorch Lightning strategy.

Importing this package registers ``Trainer(strategy="hetermoe")`` (and ``"hetermoe_spawn"``):
at once where Lightning is loaded, else as Lightning finishes loading (``registration``).
The names below load on first use, so a script that only plans (cluster, profile, plan,
simulate) starts in a fraction of a second, without Lightning or torch.
Data flows cluster -> profile -> plan -> strategy -> callbacks; kernels sit under the MoE layer.
"""

from .lazy_names import lazy_names
from .registration import register_with_lightning

# each public name -> the module that defines it (imported when the name is first read)
_HOME = {
    "ByteCorpusDataModule": ".model",
    "TokenizedDataModule": ".model",
    "build_datamodule": ".model",
    "ClusterConfig": ".cluster",
    "CostModel": ".profile",
    "DataConfig": ".configs",
    "DeviceSpec": ".cluster",
    "ExpertLoadMonitor": ".callbacks",
    "ExpertRebalancer": ".callbacks",
    "GradNormMonitor": ".callbacks",
    "HFMoELanguageModel": ".convert",
    "HeterMoEStrategy": ".strategy",
    "LinkConfig": ".cluster",
    "ModelConfig": ".configs",
    "MoEConfig": ".configs",
    "MoELanguageModel": ".model",
    "MoEAux": ".moe",
    "MoELayer": ".moe",
    "MoETransformer": ".model",
    "ModuleExperts": ".moe",
    "OptimConfig": ".configs",
    "Plan": ".plan",
    "Profile": ".profile",
    "Router": ".moe",
    "RouterOutput": ".moe",
    "RoutingRecord": ".routing_record",
    "RunSummary": ".callbacks",
    "apply_emulation": ".emulate",
    "from_cfg": ".configs",
    "from_hf": ".convert",
    "gate_losses": ".moe",
    "get_device": ".cluster",
    "load_checkpoint": ".ckpt",
    "make_plan": ".plan",
    "profile_cluster": ".measure",
    "register_device": ".cluster",
    "resolve_cluster": ".cluster",
    "simulate_plan": ".simulate",
    "to_hetermoe": ".convert",
    "to_hf": ".convert",
}

__all__ = list(_HOME)
__getattr__, __dir__ = lazy_names(__name__, _HOME)

register_with_lightning()
