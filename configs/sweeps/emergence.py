"""Claim (seed §5.2; Wei et al. 2022): past some scale a model suddenly does what smaller ones
cannot. Schaeffer et al. (2023) answer that much of this 'emergence' is the metric: exact match
jumps where a per-token measure of the same answers improves smoothly. Nine widths of the default
encoder-decoder, spanning about 200x in parameters (4.6k to 934k) and finer where exact match
rises, scored four ways on the numbers task, with and without label smoothing."""

import math

# About 12 GPU minutes on one H200: 54 runs of 4000 steps (dispatch-bound at these widths).
GPU_SCALE = 4

# d_model; 128 is configs/default.py itself. Exact match rises between 8 and 16, so the grid is
# finer there.
_WIDTHS = (8, 10, 12, 14, 16, 24, 32, 64, 128)
# Every metric under the same rule: exact match should jump, the per-token measures should not.
_METRICS = (
  ('eval.exact_match', 'exact match'),
  ('eval.accuracy', 'the per-token accuracy'),
  ('eval.bleu', 'BLEU'),
  ('eval.loss', 'the per-token NLL'),
)
# A jump: the metric goes from 10% to 90% of its change within a factor of 4 in parameters, one
# doubling of d_model (parameters grow about as d_model^2), so between two neighbouring sizes of a
# grid that doubles d_model; a smooth rise takes longer. In e-folds of parameters: ln 4 = 1.386.
_JUMP_WIDTH = math.log(4)


def _variant(width: int, smoothing: bool) -> dict:
  variant = {
    'model.d_model': width,
    'model.d_ff': 4 * width,
    'model.num_heads': 2 if width < 16 else 4,
  }
  if not smoothing:  # the NLL of a model trained with label smoothing stops at its calibration
    variant['train.label_smoothing'] = 0.0
  return variant


def _rules(sizes: list[str], learns: str, family: str) -> list[dict]:
  """The same sigmoid_width rule on every metric of one family: a jump for exact match, a smooth
  rise for the others."""
  rules = []
  for metric, name in _METRICS:
    jump = metric == 'eval.exact_match'
    rule = dict(
      kind='sigmoid_width',
      metric=metric,
      variants=sizes,
      x='params',
      shape='jump' if jump else 'smooth',
      threshold=_JUMP_WIDTH,
      requires=[learns],
    )
    if jump:
      rule['text'] = (
        f'{family}: {name} jumps: it goes from 10% to 90% of its change within a '
        'factor of 4 in parameters'
      )
    else:
      rule['text'] = (
        f'{family}: {name} changes smoothly: going from 10% to 90% of its change takes '
        'more than a factor of 4 in parameters'
      )
    rules.append(rule)
  return rules


def get_sweep(scale: int = 1) -> dict:
  steps = 1000 * scale
  sizes = [f'd{w}' for w in _WIDTHS]
  plain = [f'{size}_ls0' for size in sizes]
  preconditions = [
    dict(name=f'{family[-1]} learns the task', kind='at_least', metric='eval.exact_match',
         variants=[family[-1]], value=0.9, every_seed=True,
         text=f'{family[-1]}: exact match >= 0.9 at every seed')
    for family in (sizes, plain)
  ]  # fmt: skip
  rules = [
    *_rules(sizes, preconditions[0]['name'], 'label smoothing 0.1'),
    *_rules(plain, preconditions[1]['name'], 'no label smoothing'),
    dict(kind='ordering', metric='eval.loss', variants=plain, direction='decreasing',
         text='no label smoothing: the per-token NLL falls at every step up in size'),
  ]  # fmt: skip
  plots = [
    dict(kind='scatter', x='params', y='eval.exact_match', logx=True, variants=sizes,
         title='exact match against parameters', xlabel='parameters',
         ylabel='exact match (512 held-out numbers)'),
    dict(kind='scatter', x='params', y='eval.loss', logx=True, logy=True, variants=plain,
         title='per-token NLL of the same answers, trained without label smoothing',
         xlabel='parameters', ylabel='eval NLL (nats/token)'),
  ]  # fmt: skip
  variants = {size: _variant(w, True) for size, w in zip(sizes, _WIDTHS)}
  variants |= {size: _variant(w, False) for size, w in zip(plain, _WIDTHS)}
  return dict(
    name='emergence',
    claim='Exact match on the numbers task jumps with model size: it goes from 10% to 90% of its '
    'change within a factor of 4 in parameters (one doubling of d_model), while the per-token '
    'accuracy, BLEU and the per-token log-likelihood of the same answers rise smoothly (taking '
    'longer than that), and the log-likelihood improves at every size when no label smoothing '
    'caps it.',
    description='EncoderDecoder 2+2 layers, d_ff = 4 d_model, d_model '
    f'{", ".join(map(str, _WIDTHS))} (4 heads; 2 below d_model 16): dW is the default run '
    '(configs/default.py, d_model 128, label smoothing 0.1) at width W, every other knob equal; '
    'dW_ls0 the same without label smoothing, whose NLL has no floor from the smoothed target. '
    'The numbers task, digits to English words, numbers of 1 to 6 digits (every digit count '
    f'equally common), {steps} steps of batch 64, warmup to 3e-3 then a cosine. '
    'eval.exact_match: the share of 512 held-out numbers whose greedy translation is exactly '
    'right; eval.accuracy: the share of their target tokens predicted right, teacher forced; '
    'eval.bleu: BLEU of the greedy translations; eval.loss: the mean negative log-likelihood per '
    'target token of the same answers, teacher forced, scored without label smoothing (lower is '
    'better). sigmoid_width: a logistic in ln(parameters) fitted by least squares to every '
    "seed's value; its width from 10% to 90% of its change, in e-folds of parameters, with a 95% "
    'interval from 1000 bootstrap resamples of the seeds within each size. A jump: the interval '
    f'lies below ln 4 = {_JUMP_WIDTH:.3f}; smooth: above it; across it, or when a logistic fits '
    'shuffled values as well (no rise beyond the noise), inconclusive. Unlike the share of the '
    'largest step between neighbouring sizes, the width does not shrink as sizes are added inside '
    'the rise. The preconditions keep the rules from judging a family whose largest member '
    'never learns the task.',
    base='configs/default.py',
    overrides={
      'train.steps': steps,
      'train.eval_every': steps,
      'train.checkpoint_every': steps,
      'train.log_every': 50,
    },
    variants=variants,
    metrics=[metric for metric, _ in _METRICS],
    preconditions=preconditions,  # fmt: skip
    nulls=[
      dict(
        name='untrained',
        reason='a model that learned nothing spells no answer exactly: '
        'exact match 0 at every size (an analytic value), so it has no rise to call a jump',
        values={size: {'eval.exact_match': 0.0} for size in variants},
      ),
    ],  # fmt: skip
    rules=rules,  # fmt: skip
    plots=plots,  # fmt: skip
  )
