"""The model: a Mixtral-style decoder and the data it trains on."""

from .corpus import TokenizedDataModule
from .data import ByteCorpusDataModule, build_datamodule, load_corpus
from .sampling import GlobalOrderDataModule
from .lm import IGNORE_INDEX, MoELanguageModel
from .transformer import MoETransformer

__all__ = ["IGNORE_INDEX", "ByteCorpusDataModule", "GlobalOrderDataModule", "MoELanguageModel", "MoETransformer",
           "TokenizedDataModule", "build_datamodule", "load_corpus"]
