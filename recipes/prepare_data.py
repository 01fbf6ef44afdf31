"""Tokenise text files into a corpus on disk for ``data=tokenized``.

    python recipes/prepare_data.py                                   # the pydoc topics, a 4096-token BPE
    python recipes/prepare_data.py input=corpus/ out=data/mine vocab_size=32000
    python recipes/prepare_data.py input='shards/*.jsonl' tokenizer=/models/olmoe out=data/olmoe
    python recipes/train.py data=tokenized data.path=data/mine       # then train on it, packed

Writes ``tokens.bin`` (the token ids, uint16 or uint32), ``index.npy`` (each document's
start), ``meta.json`` and ``tokenizer.json`` into ``out``, once all four are written (beside
it, in a hidden ``.<name>.partial-*`` directory): a run that fails or is stopped leaves a
corpus already there as it was.
"""

import shutil
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from lightning_hetermoe.configs import ConfigError, PrepareConfig, from_cfg
from lightning_hetermoe.corpus.prepare import prepare_corpus
from lightning_hetermoe.staging import remove_empty, replace_directory


@hydra.main(version_base="1.3", config_path="../conf", config_name="prepare_data")
def main(cfg: DictConfig) -> None:
    # Hydra writes this run's config into out before anything is prepared (conf/prepare_data.yaml
    # names a subdirectory apart): it becomes out's .hydra/ once the corpus is in, and a run
    # that fails leaves out's config, like its corpus, as it was
    run = HydraConfig.get()
    written = Path(run.runtime.output_dir) / run.output_subdir if run.output_subdir else None
    done = False
    try:
        prepare_corpus(from_cfg(PrepareConfig, {k: v for k, v in cfg.items() if k != "hydra"}))
        done = True
    except ConfigError as err:
        raise SystemExit(f"[prepare] config error: {err}") from None
    finally:
        if written is not None and written.name != ".hydra":
            if done:
                left = replace_directory(written, written.parent / ".hydra")
                if left is not None:  # the new config is in place all the same
                    print(f"[prepare] could not remove {left[0]}, the config of an earlier run "
                          f"({left[1].strerror or left[1]}): remove it by hand")
            else:
                shutil.rmtree(written, ignore_errors=True)
                remove_empty([written.parent])  # made by Hydra for this run, and left empty


if __name__ == "__main__":
    main()
