"""Data for sparrow: built-in generated tasks, text/TSV files and TFDS, tokenizers and batching.

Usage: `task = data.build(config.data, family=..., workdir=..., seed=...)`.
"""

from transformer.data.grammar import Grammar, make_grammar
from transformer.data.number_words import numbers_to_words, words_to_numbers
from transformer.data.prepare import ready as prepare_corpus
from transformer.data.tasks import Task, build, default_config, prompt_prefix, running_text
from transformer.data.tokenizers import (
  BOS_ID,
  EOS_ID,
  MASK_ID,
  NUM_SPECIAL,
  PAD_ID,
  UNK_ID,
  ByteTokenizer,
  CharTokenizer,
  SentencePieceTokenizer,
  Tokenizer,
  load_tokenizer,
  train_sentencepiece,
)

__all__ = [
  'BOS_ID',
  'EOS_ID',
  'MASK_ID',
  'NUM_SPECIAL',
  'PAD_ID',
  'UNK_ID',
  'ByteTokenizer',
  'CharTokenizer',
  'Grammar',
  'SentencePieceTokenizer',
  'Task',
  'Tokenizer',
  'build',
  'default_config',
  'load_tokenizer',
  'make_grammar',
  'numbers_to_words',
  'prepare_corpus',
  'prompt_prefix',
  'running_text',
  'train_sentencepiece',
  'words_to_numbers',
]
