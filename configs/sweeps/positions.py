"""Claim (Table 3 row E): learned positions do about as well as sinusoidal ones; some position
information is needed. Sinusoidal, learned, RoPE, ALiBi and none on the numbers task."""

from research.spec import PAPER_SCHEDULE, task_losses

# --scale of the one-GPU run (an estimate, not measured: one H200, 1600 steps (x4); 15 runs (5
# variants x 3 seeds) of ~1 min: ~5 min at --parallel=4).
GPU_SCALE = 4


def get_sweep(scale: int = 1) -> dict:
  steps = 400 * scale
  null = task_losses('configs/default.py')  # the overrides leave the task as it is
  rules = [
    dict(kind='close', metric='eval.accuracy', a='learned', b='sinusoidal', tolerance=0.02,
         text='learned ~ sinusoidal'),
    dict(kind='worst', metric='eval.loss', expect=['none'],
         text='no positions is worst'),
  ]  # fmt: skip
  return dict(
    name='positions',
    claim='Learned and sinusoidal positions give nearly identical results; without position '
    'information the model is worst (the encoder cannot tell the digits apart by place).',
    description='EncoderDecoder 2+2 layers, d_model 64, 4 heads, numbers task. RoPE and ALiBi act '
    'in self attention only; cross attention has no positions in any variant.',
    base='configs/default.py',
    overrides={
      **PAPER_SCHEDULE,  # the rsqrt schedule these results were run with
      'model.d_model': 64,
      'model.d_ff': 256,
      'train.steps': steps,
      'train.log_every': 10,
      'train.eval_every': steps,
      'train.checkpoint_every': steps,
      'train.eval_decode_examples': 256,
    },
    variants={p: {'model.position': p} for p in ('sinusoidal', 'learned', 'rope', 'alibi', 'none')},
    metrics=['eval.loss', 'eval.accuracy', 'eval.bleu'],
    nulls=[
      dict(
        name='uniform',
        reason="a model that learned nothing and predicts uniformly over the task's token ids, "
        f'whatever its positions, scores eval.loss = ln V = {null["uniform"]:.3f} nats and '
        f'eval.accuracy = 1/V = {null["chance"]:.4f} (computed from the task; an untrained '
        'model does no better, tests/research/test_nulls.py)',
        values={
          p: {'eval.loss': null['uniform'], 'eval.accuracy': null['chance']}
          for p in ('sinusoidal', 'learned', 'rope', 'alibi', 'none')
        },
      ),
    ],  # fmt: skip
    rules=rules,
  )
