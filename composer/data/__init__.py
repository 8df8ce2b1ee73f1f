"""Data: tokenizers, document sources (the built-in corpus, local files, hub
datasets), packing into windows, fine-tuning examples, and the rank-sharded loader.

Imports: config.
"""
from composer.data.loader import DataLoader, check_source
from composer.data.sources import BUILTIN_DATASET, IGNORE_INDEX, builtin_paragraphs, load_documents
from composer.data.tokenizer import ByteTokenizer, HFTokenizer, build_tokenizer, set_chat_template

__all__ = ["BUILTIN_DATASET", "ByteTokenizer", "DataLoader", "HFTokenizer", "IGNORE_INDEX",
           "build_tokenizer", "builtin_paragraphs", "check_source", "load_documents",
           "set_chat_template"]
