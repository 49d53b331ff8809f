"""Claim: a BERT-style encoder reused for left-to-right generation generates far worse than a GPT
of the same size: it was trained to fill masks with context on both sides."""

from configs import gpt_tiny
from transformer.data.grammar import make_grammar

# --scale of the one-GPU run (an estimate, not measured: one H200, 4000 steps (x4); 2 runs of ~1.5
# min (compile, steps, generation): ~3 min).
GPU_SCALE = 4


def _random_word_valid() -> float:
  """gen.valid of a model that picks each next word uniformly, ignoring the last one: the share
  of (word, next state) pairs that gpt_tiny's grammar allows."""
  d = gpt_tiny.get_config().data
  grammar = make_grammar(int(d.grammar_seed), int(d.grammar_words), int(d.grammar_successors))
  return float((grammar.transitions[: grammar.period] > 0).mean())


def get_sweep(scale: int = 1) -> dict:
  steps = 1000 * scale
  rules = [
    dict(kind='greater', metric='gen.valid', a='gpt', b='bert', rel_margin=0.25,
         text='the causal model generates far better'),
  ]  # fmt: skip
  return dict(
    name='bidirectional_vs_causal',
    claim='A bidirectional (MLM) encoder reused for left-to-right generation generates far worse '
    'than a causal LM of equal size (the training/inference mismatch).',
    description='Both 2 layers, d_model 64, 4 heads, pre-LN, the same data (grammar task, 64-token '
    'rows, batch 16) and steps; `bert` trains with 15% masking (BidirectionalLM). Generation: '
    'greedy, 24 tokens after the first half of 64 held-out documents; BERT predicts the next '
    'token at a [MASK] appended to the prefix. gen.valid: the share of generated word transitions '
    'that the true grammar allows. eval.loss is MLM loss for bert and next-token loss for gpt: '
    'not comparable.',
    base='configs/gpt_tiny.py',
    overrides={
      'data.max_length': 64,
      'data.batch_size': 16,
      'train.steps': steps,
      'train.log_every': 10,
      'train.eval_every': steps,
      'train.checkpoint_every': steps,
    },
    variants={'gpt': {}, 'bert': {'model.family': 'bidirectional_lm'}},
    measure='generation',
    metrics=['gen.valid', 'eval.loss', 'eval.accuracy'],
    nulls=[
      dict(
        name='random words',
        reason='a model that learned nothing of the grammar, causal or bidirectional, picks its '
        'next word without regard to the last one: uniformly, it writes an allowed transition '
        f'with probability {_random_word_valid():.4f} (the share of word-to-state pairs the '
        'grammar allows, computed from it)',
        values={v: {'gen.valid': _random_word_valid()} for v in ('gpt', 'bert')},
      ),
    ],  # fmt: skip
    rules=rules,
  )
