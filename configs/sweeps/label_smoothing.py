"""Claim (Table 3 row D): label smoothing raises the training cross-entropy (the model learns to
be less sure) and keeps or improves BLEU."""

from research.spec import PAPER_SCHEDULE, task_losses

# --scale of the one-GPU run (an estimate, not measured: one H200, 2400 steps (x4); 3 runs of ~1.5
# min: ~4 min).
GPU_SCALE = 4


def get_sweep(scale: int = 1) -> dict:
  steps = 600 * scale
  uniform = task_losses('configs/default.py')['uniform']  # the overrides leave the task as it is
  rules = [
    dict(kind='ordering', metric='train.nll', variants=['ls0.0', 'ls0.1', 'ls0.2'],
         direction='increasing',
         text='smoothing raises training cross-entropy'),
    dict(kind='no_worse', metric='eval.bleu', a='ls0.1', b='ls0.0', tolerance=1.0,
         text='BLEU kept (within 1 point) or improved'),
  ]  # fmt: skip
  return dict(
    name='label_smoothing',
    claim='Label smoothing raises the training cross-entropy and keeps or improves BLEU.',
    description='EncoderDecoder 2+2 layers, d_model 128, numbers task, eps_ls = 0, 0.1, 0.2. '
    '`train.nll` is the plain cross-entropy (not the smoothed loss) of the training batches, '
    'averaged over the last 10% of logged steps.',
    base='configs/default.py',
    overrides={
      **PAPER_SCHEDULE,  # the rsqrt schedule these results were run with
      'train.steps': steps,
      'train.log_every': 10,
      'train.eval_every': steps,
      'train.checkpoint_every': steps // 2,
      'train.eval_decode_examples': 256,
    },
    variants={f'ls{e}': {'train.label_smoothing': e} for e in (0.0, 0.1, 0.2)},
    metrics=['train.nll', 'eval.loss', 'eval.bleu'],
    nulls=[
      dict(
        name='uniform',
        reason="a model that learned nothing and predicts uniformly over the task's token ids "
        f'scores train.nll = ln V = {uniform:.3f} nats whatever the smoothing (computed from the '
        'task; an untrained model does no better, tests/research/test_nulls.py) and spells no '
        'number: BLEU 0 (an analytic value)',
        values={f'ls{e}': {'train.nll': uniform, 'eval.bleu': 0.0} for e in (0.0, 0.1, 0.2)},
      ),
    ],  # fmt: skip
    rules=rules,
  )
