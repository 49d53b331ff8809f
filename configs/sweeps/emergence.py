"""Claim (seed §5.2; Wei et al. 2022): past some scale a model suddenly does what smaller ones
cannot. Schaeffer et al. (2023) answer that much of this 'emergence' is the metric: exact match
jumps where a per-token measure of the same answers improves smoothly. Six widths of the default
encoder-decoder, spanning about 200x in parameters (4.6k to 934k), scored both ways on the
numbers task."""

# About 4 GPU minutes on one H200: 18 runs of 4000 steps (dispatch-bound at these widths).
GPU_SCALE = 4

# d_model; 128 is configs/default.py itself. Exact match rises between 8 and 16, so the grid is
# finer there.
_WIDTHS = (8, 10, 12, 14, 16, 24, 32, 64, 128)


def get_sweep(scale: int = 1) -> dict:
  steps = 1000 * scale
  sizes = [f'd{w}' for w in _WIDTHS]
  largest = sizes[-1]
  learns = f'{largest} learns the task'
  preconditions = [
    dict(name=learns, kind='at_least', metric='eval.exact_match', variants=[largest], value=0.9,
         every_seed=True,
         text=f'{largest}: exact match >= 0.9 at every seed'),
  ]  # fmt: skip
  rules = [
    dict(kind='largest_step', metric='eval.exact_match', variants=sizes, at_least_share=0.5,
         min_step=0.3, requires=[learns],
         text='exact match jumps: one step between neighbouring sizes carries over half of its '
              'rise, and at least 0.3'),
    dict(kind='largest_step', metric='eval.loss', variants=sizes, at_most_share=0.5,
         requires=[learns],
         text='the per-token negative log-likelihood changes smoothly: no step between '
              'neighbouring sizes carries half of its change'),
    dict(kind='ordering', metric='eval.loss', variants=sizes, direction='decreasing',
         text='the per-token negative log-likelihood falls at every step up in size'),
  ]  # fmt: skip
  plots = [
    dict(kind='scatter', x='params', y='eval.exact_match', logx=True,
         title='exact match against parameters', xlabel='parameters',
         ylabel='exact match (512 held-out numbers)'),
    dict(kind='scatter', x='params', y='eval.loss', logx=True, logy=True,
         title='per-token NLL of the same answers against parameters', xlabel='parameters',
         ylabel='eval NLL (nats/token)'),
  ]  # fmt: skip
  return dict(
    name='emergence',
    claim='Exact match on the numbers task jumps between two neighbouring sizes (over half of '
    'its whole rise in one step), while the per-token log-likelihood of the same answers '
    'improves smoothly (no step carries half of its change).',
    description='EncoderDecoder 2+2 layers, d_ff = 4 d_model, d_model '
    f'{", ".join(map(str, _WIDTHS))} (4 heads; 2 at d_model 8): the default run '
    '(configs/default.py, d_model 128) and five narrower copies, every other knob equal. The '
    'numbers task, digits to English words, numbers of 1 to 6 digits (every digit count equally '
    f'common), {steps} steps of batch 64, warmup to 3e-3 then a cosine. eval.exact_match: the '
    'share of 512 held-out numbers whose greedy translation is exactly right; eval.loss: the mean '
    'negative log-likelihood per target token of the same held-out answers, teacher forced and '
    'without label smoothing (lower is better; the per-token log-likelihood is its negative). '
    'largest_step: the largest '
    'change between neighbouring sizes as a share of all the changes along the six. The '
    'precondition keeps the emergence rules from judging a family whose largest member never '
    'learns the task.',
    base='configs/default.py',
    overrides={
      'train.steps': steps,
      'train.eval_every': steps,
      'train.checkpoint_every': steps,
      'train.log_every': 50,
    },
    variants={
      f'd{w}': {'model.d_model': w, 'model.d_ff': 4 * w, 'model.num_heads': 2 if w < 16 else 4}
      for w in _WIDTHS
    },
    metrics=['eval.exact_match', 'eval.loss', 'eval.accuracy', 'eval.bleu'],
    preconditions=preconditions,  # fmt: skip
    nulls=[
      dict(
        name='untrained',
        reason='a model that learned nothing spells no answer exactly: '
        'exact match 0 at every size (an analytic value), so no step carries a jump',
        values={size: {'eval.exact_match': 0.0} for size in sizes},
      ),
    ],  # fmt: skip
    rules=rules,  # fmt: skip
    plots=plots,  # fmt: skip
  )
