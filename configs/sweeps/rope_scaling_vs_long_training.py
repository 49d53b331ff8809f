"""Claim (seed §6.3): for long context, RoPE with extrapolation scaling beats training directly on
longer sequences. At one token budget: trained at L and evaluated at 4L with linear or YaRN
scaling (with or without a short fine-tune at 4L), against the same model trained at 4L."""

from research.spec import task_losses

_LENGTH = 32  # L: the short runs' rows; the long run's rows are 4L
_FACTOR = 4
_ROWS = 32  # rows per step at L; at 4L a step has _ROWS / 4 rows, so the same tokens

# --scale of the one-GPU run (an estimate, not measured: per seed 3 trained runs of 4x the steps
# and 4 evaluations; 3 seeds, about 5 min on one H200).
GPU_SCALE = 4


def measure(ctx, **kwargs) -> dict:
  from research import long_context

  return long_context.rope_scaling(ctx, **kwargs)


def get_sweep(scale: int = 1) -> dict:
  steps = 400 * scale
  short95 = round(0.95 * steps)  # the rest of the budget is the fine-tune at 4L
  finetuned = ('short95_ft_linear', 'short95_ft_yarn')
  scaled = ['short_linear', 'short_yarn', *finetuned]
  unigram = task_losses('configs/gpt_tiny.py', {'data.grammar_join': 24})['unigram']
  rules = [
    dict(kind='best', metric='loss@4x', expect=scaled,
         text='at 4L the best model is one trained at L and scaled'),
    dict(kind='less', metric='loss@4x', a='short95_ft_yarn', b='long',
         text='trained at L, YaRN + fine-tune clearly beats training at 4L'),
    dict(kind='less', metric='loss@4x', a='short95_ft_linear', b='long',
         text='trained at L, linear (PI) + fine-tune clearly beats training at 4L'),
  ]  # fmt: skip
  return dict(
    name='rope_scaling_vs_long_training',
    claim='At one token budget, RoPE trained at L and scaled to 4L (linear or YaRN, with or '
    'without a short fine-tune at 4L) clearly beats the same model trained at 4L from the start.',
    description=f'CausalLM gpt_tiny (2 layers, d_model 64, RoPE) on the grammar task with 24 '
    f'documents joined per example, each row one example cut to its length (no packing), '
    f'SentencePiece 512. Budget: {steps} steps x {_ROWS} rows x L = {_LENGTH} tokens. short: all '
    f'of it at L. short95: {short95} steps at L, then (eval variants *_ft_*) '
    f'{steps - short95} steps (5%, as position interpolation fine-tunes) at 4L on {_ROWS // 4} '
    'rows with that scaling, fresh Adam moments and a warmup-cosine to 1e-3. long: '
    f'{steps} steps at 4L on {_ROWS // 4} rows. loss@1x and loss@4x: held-out loss on rows of L '
    'and 4L tokens (the same held-out examples, cut to length); past its trained length a model '
    'uses its rope_scaling at factor (eval length / trained length), and short and short95 '
    'themselves show plain RoPE there.',
    base='configs/gpt_tiny.py',
    overrides={
      'model.position': 'rope',
      'model.max_length': _FACTOR * _LENGTH,
      'data.max_length': _LENGTH,
      'data.batch_size': _ROWS,
      'data.pack': False,
      'data.grammar_join': 24,
      'data.num_train_examples': 2000 * scale,
      'data.num_eval_examples': 64,
      'train.steps': steps,
      'train.log_every': 10,
      'train.eval_every': steps,
      'train.checkpoint_every': steps,
      'train.eval_decode_examples': 0,
    },
    variants={
      'short': {},
      'short95': {
        'train.steps': short95,
        'train.eval_every': short95,
        'train.checkpoint_every': short95,
      },
      'long': {'data.max_length': _FACTOR * _LENGTH, 'data.batch_size': _ROWS // _FACTOR},
    },  # fmt: skip
    eval_variants={
      'short_linear': {'from': 'short', 'overrides': {'model.rope_scaling': 'linear'}},
      'short_yarn': {'from': 'short', 'overrides': {'model.rope_scaling': 'yarn'}},
      'short95_ft_linear': {'from': 'short95', 'overrides': {'model.rope_scaling': 'linear'}},
      'short95_ft_yarn': {'from': 'short95', 'overrides': {'model.rope_scaling': 'yarn'}},
    },
    measure='measure',
    measure_args={'length': _LENGTH, 'factor': _FACTOR, 'finetune': finetuned},
    metrics=['loss@1x', 'loss@4x'],
    nulls=[
      dict(
        name='unigram',
        reason="a model that learns only how often each token occurs scores the grammar's "
        f'unigram loss, {unigram:.3f} nats, at L and 4L whatever it was trained on or scaled '
        'by (computed from the task)',
        values={
          v: {'loss@1x': unigram, 'loss@4x': unigram}
          for v in ('short', 'short95', 'long', 'short_linear', 'short_yarn', *finetuned)
        },
      ),
    ],  # fmt: skip
    rules=rules,  # fmt: skip
  )
