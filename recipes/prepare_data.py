"""Tokenise text files into a corpus on disk for ``data=tokenized``.

    python recipes/prepare_data.py                                   # the pydoc topics, a 4096-token BPE
    python recipes/prepare_data.py input=corpus/ out=data/mine vocab_size=32000
    python recipes/prepare_data.py input='shards/*.jsonl' tokenizer=/models/olmoe out=data/olmoe
    python recipes/train.py data=tokenized data.path=data/mine       # then train on it, packed

Writes ``tokens.bin`` (the token ids, uint16 or uint32), ``index.npy`` (each document's
start), ``meta.json`` and ``tokenizer.json`` into ``out``.
"""

import hydra
from omegaconf import DictConfig

from lightning_hetermoe.configs import ConfigError, PrepareConfig, from_cfg
from lightning_hetermoe.corpus.prepare import prepare_corpus


@hydra.main(version_base="1.3", config_path="../conf", config_name="prepare_data")
def main(cfg: DictConfig) -> None:
    try:
        prepare_corpus(from_cfg(PrepareConfig, {k: v for k, v in cfg.items() if k != "hydra"}))
    except ConfigError as err:
        raise SystemExit(f"[prepare] config error: {err}") from None


if __name__ == "__main__":
    main()
