"""The model: a Mixtral-style decoder and the data it trains on."""

from .data import ByteCorpusDataModule, load_corpus
from .lm import MoELanguageModel
from .transformer import MoETransformer

__all__ = ["ByteCorpusDataModule", "MoELanguageModel", "MoETransformer", "load_corpus"]
