"""Claim (Table 3 row A): a single head is worse than several at a fixed d_model, and heads
specialise: some attend sharply, some nearly uniformly. On two tasks: the numbers translation
task and the grammar LM."""

from configs import gpt_tiny
from research.spec import PAPER_SCHEDULE, task_losses

# About 3 GPU minutes on one H200: 6 runs of 1600 (numbers) and 2000 (grammar) steps.
GPU_SCALE = 4

_HEADS = (1, 4, 8)


def _grammar_lm() -> dict:
  """configs/gpt_tiny.py's model, data and optimiser sections: a causal LM on the grammar task."""
  config = gpt_tiny.get_config()
  return {
    'model': config.model.to_dict(),
    'data': config.data.to_dict(),
    'optim': config.optim.to_dict(),
    'train.label_smoothing': config.train.label_smoothing,
  }


def _nulls() -> list[dict]:
  """An untrained model: near-uniform output on both tasks, and every head near-uniform."""
  numbers = task_losses('configs/default.py')['uniform']
  grammar = task_losses('configs/default.py', _grammar_lm())['unigram']
  values = {f'numbers_h{n}': {'eval.loss': numbers} for n in _HEADS}
  values |= {f'grammar_h{n}': {'eval.loss': grammar, 'entropy.layer_spread': 0.0} for n in _HEADS}
  return [
    dict(
      name='untrained',
      reason='a model that learned nothing scores no better than a uniform prediction, ln V = '
      f'{numbers:.3f} nats, on numbers (tests/research/test_nulls.py) and at best the unigram '
      f'loss {grammar:.3f} on the grammar, whatever its heads (computed from the tasks); at '
      'init the query-key logits are near 0, so every head attends about uniformly and the '
      'within-layer entropy spread is about 0 (an analytic value)',
      values=values,
    ),
  ]


def get_sweep(scale: int = 1) -> dict:
  numbers_steps, grammar_steps = 400 * scale, 500 * scale
  rules = [
    dict(kind='less', metric='eval.loss', a='numbers_h4', b='numbers_h1',
         text='numbers: one head is worse than four'),
    dict(kind='less', metric='eval.loss', a='grammar_h4', b='grammar_h1',
         text='grammar LM: one head is worse than four'),
    dict(kind='at_least', metric='entropy.layer_spread', variants=['grammar_h4', 'grammar_h8'],
         value=0.3, interval=True,
         text='grammar LM: within a layer, sharp and nearly uniform heads side by side'),
  ]  # fmt: skip
  return dict(
    name='heads',
    claim='At a fixed d_model, one head trains worse than several, and the heads of a trained '
    'model differ within a layer: some are sharp and some nearly uniform.',
    description='Two tasks, d_model 64 (d_k = 64 / h), h = 1, 4, 8. `numbers`: EncoderDecoder '
    f'2+2 layers on the numbers task, {numbers_steps} steps of the rsqrt schedule. `grammar`: '
    f'the CausalLM of configs/gpt_tiny.py (2 layers) on the grammar task, {grammar_steps} steps '
    'of batch 32 x 128 tokens. Head entropy is measured on 16 held-out examples for every '
    'attention module and normalised by the log of the number of visible keys (0 = one key, '
    '1 = uniform). entropy.layer_spread is the largest minus the smallest head of one attention '
    'module, averaged over modules (0 with one head), so that differences between kinds of '
    'attention (causal self, cross) do not count as head specialisation; entropy.spread is the '
    'same over the whole model. The specialisation rule is read on the grammar LM: on the '
    'numbers task every cross-attention head becomes a sharp aligner (the first version of this '
    'sweep), a property of that task; its spreads are shown for comparison. head_entropy.png in '
    'each run shows every head, grouped by layer.',
    base='configs/default.py',
    overrides={
      'train.log_every': 10,
      'train.eval_decode_examples': 0,
    },
    axes={
      'task': {
        'numbers': {
          **PAPER_SCHEDULE,  # the rsqrt schedule these results were run with
          'model.d_model': 64,
          'model.d_ff': 256,
          'train.steps': numbers_steps,
          'train.eval_every': numbers_steps,
          'train.checkpoint_every': numbers_steps,
          'train.eval_decode_examples': 64,
        },
        'grammar': {
          **_grammar_lm(),
          'train.steps': grammar_steps,
          'train.eval_every': grammar_steps,
          'train.checkpoint_every': grammar_steps,
        },
      },
      'heads': {f'h{n}': {'model.num_heads': n} for n in _HEADS},
    },
    metrics=[
      'eval.loss',
      'entropy.layer_spread',
      'entropy.spread',
      'entropy.min',
      'entropy.max',
    ],
    measure='head_entropy',
    nulls=_nulls(),
    rules=rules,
  )
