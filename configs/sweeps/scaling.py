"""Claim: without the 1/sqrt(d_k) scale of the attention logits (at d_k = 64), the loss curve
oscillates more and training ends worse. Numbers task (digits -> words), the embedded default
with 2 heads."""

from research.spec import PAPER_SCHEDULE, task_losses

# ~3 GPU minutes at GPU_SCALE on one H200: 6 runs (3 seeds) of 1600 steps, dispatch-bound.
GPU_SCALE = 4


def get_sweep(scale: int = 1) -> dict:
  steps = 400 * scale
  uniform = task_losses('configs/default.py')['uniform']  # the overrides leave the task as it is
  rules = [
    dict(kind='less', metric='eval.loss', a='scaled', b='unscaled',
         text='ends worse without the scale'),
    dict(kind='greater', metric='train.oscillation', a='unscaled', b='scaled',
         text='less stable without the scale: the loss oscillates more within each run'),
    dict(kind='variance_greater', metric='eval.loss', a='unscaled', b='scaled',
         text='less stable without the scale: a larger spread of the final loss over seeds'),
  ]  # fmt: skip
  return dict(
    name='scaling',
    claim='Without the 1/sqrt(d_k) scale (d_k = 64), training is less stable (the loss curve '
    'oscillates more) and ends worse.',
    description='EncoderDecoder 2+2 layers, d_model 128, 2 heads (d_k = 64), post-LN, on the '
    f'built-in numbers task, {steps} steps; rsqrt schedule with 300 warmup steps. The training '
    'loss is logged at every step. "Less stable" is read per run as `train.oscillation`: the std '
    'of the step-to-step change of log(loss) over the second half of the run (a steady fall '
    'does not count; a zigzag does), compared over seeds; `train.oscillation_detrended`, the '
    'std of log(loss) about its straight-line fit there, also counts slow swings. The spread '
    'of the final eval loss over seeds is a second reading (needs --seeds >= 2). '
    '`train.loss_rise` (the largest rise of the training loss above its lowest value so far) '
    'is shown for spikes.',
    base='configs/default.py',
    overrides={
      **PAPER_SCHEDULE,  # the rsqrt schedule these results were run with
      'model.num_heads': 2,
      'train.steps': steps,
      'train.log_every': 1,  # every step: the oscillation is a property of the curve itself
      'train.eval_every': steps,
      'train.checkpoint_every': steps,
      'train.eval_decode_examples': 128,
    },
    variants={'scaled': {}, 'unscaled': {'model.attention_scale': False}},
    metrics=[
      'eval.loss',
      'eval.bleu',
      'train.oscillation',
      'train.oscillation_detrended',
      'train.loss_rise',
    ],
    nulls=[
      dict(
        name='uniform',
        reason="a model that learned nothing and predicts uniformly over the task's token ids "
        f'scores eval.loss = ln V = {uniform:.3f} nats with or without the scale (computed from '
        'the task; an untrained model does no better, tests/research/test_nulls.py). Its '
        'oscillation has no value that does not depend on the batches, so the '
        'stability rules are not checked against it',
        values={v: {'eval.loss': uniform} for v in ('scaled', 'unscaled')},
      ),
    ],  # fmt: skip
    rules=rules,
  )
