"""Claim: with post-LN, a large learning rate without warmup makes the loss spike or diverge, where
the same peak after a warmup trains smoothly. Four peak learning rates over a decade, each with
and without a linear warmup; compared only where both arms learn at first."""

from research.spec import task_losses

# ~5 GPU minutes at GPU_SCALE on one H200: 8 runs of 1200 steps, each dispatch-bound (~30 s).
GPU_SCALE = 4

_LRS = {'lr5e-4': 5e-4, 'lr1e-3': 1e-3, 'lr2e-3': 2e-3, 'lr5e-3': 5e-3}  # 5e-3 ~ the paper's peak
_LEARNED_EARLY = {'metric': 'train.learned_early', 'value': 1}


def get_sweep(scale: int = 1) -> dict:
  steps = 300 * scale
  uniform = task_losses('configs/default.py')['uniform']  # the overrides leave the task as it is
  rules = []
  for lr in _LRS:  # a rule per learning rate; each runs only if both arms learn at first
    a, b = f'{lr}_no_warmup', f'{lr}_warmup'
    rules += [
      dict(kind='greater', metric='train.spikes', a=a, b=b, where=_LEARNED_EARLY,
           text=f'at {lr}, the loss spikes more without warmup'),
      dict(kind='less', metric='eval.loss', a=b, b=a, where=_LEARNED_EARLY,
           text=f'at {lr}, warmup ends better'),
    ]  # fmt: skip
  rules.append(
    dict(kind='greater', metric='eval.loss', a='lr5e-3_no_warmup', b='lr5e-3_warmup',
         text='at lr5e-3, post-LN without warmup fails to learn: it ends above the warmed-up arm'),
  )  # fmt: skip
  return dict(
    name='warmup',
    claim='Post-LN without warmup (a large constant learning rate) spikes or diverges; with a '
    'warmup to the same peak it trains smoothly and ends better.',
    description='EncoderDecoder 2+2 layers, d_model 128, post-LN, numbers task, batch 64, '
    f"{steps} steps, no gradient clipping. Peak learning rate 5e-4 .. 5e-3 (the paper's rsqrt "
    f'peaks at 0.0051), constant; `warmup`: a linear warmup over the first {steps // 4} steps, '
    '`no_warmup`: the peak from the first step. The loss is logged at every step. '
    '`train.learned` = 1 when the final training cross-entropy (`train.nll`, the mean of the '
    'last 10% of steps) is below 1/4 of its value at step 1 (that of the initial parameters); '
    '`train.learned_early` = 1 when it got there within the first half of the run. '
    '`train.spikes` counts the steps whose loss exceeds 1.5x the median of the 50 before '
    '(training/faults.SpikeDetector, no rollback). Non-finite steps are skipped '
    '(train.nonfinite=skip); a run that keeps failing counts as diverged (infinite loss). The '
    'spike and end-loss rules compare the two arms at each learning rate where both learned at '
    'first (`where=train.learned_early`); where one never learns there is no spike to count, '
    'and that rule is not compared. The last rule compares the end losses at 5e-3 without '
    "that condition: an arm that fails to learn at all is the claim's strongest evidence.",
    base='configs/default.py',
    overrides={
      'optim.schedule': 'constant',
      'optim.clip_norm': 0.0,  # nothing else tames the early steps
      'train.steps': steps,
      'train.log_every': 1,
      'train.eval_every': steps,
      'train.checkpoint_every': steps,
      'train.eval_decode_examples': 0,  # the claim is about the loss; decoding costs minutes
      'train.nonfinite': 'skip',
      'train.spike_factor': 1.5,
      'train.spike_window': 50,
    },
    axes={
      'lr': {name: {'optim.learning_rate': lr} for name, lr in _LRS.items()},
      'schedule': {
        'warmup': {'optim.warmup_steps': steps // 4},
        'no_warmup': {'optim.warmup_steps': 0},
      },
    },
    metrics=[
      'train.learned',
      'train.learned_early',
      'train.spikes',
      'train.nll',
      'eval.loss',
      'train.loss_rise',
    ],
    nulls=[
      dict(
        name='uniform',
        reason='a model that learned nothing never learns early (train.learned_early 0), has no '
        f"spike and, predicting uniformly over the task's token ids, ends at ln V = "
        f'{uniform:.3f} nats (computed from the task; an untrained model does no better, '
        'tests/research/test_nulls.py) in both arms; the spike and end-loss rules compare only '
        'arms that learned early, so on this null they do not run, and the last rule sees the '
        'same loss in both arms at 5e-3 (a gap of 0), so it fails on it',
        values={
          f'{lr}_{arm}': {'train.learned_early': 0.0, 'train.spikes': 0.0, 'eval.loss': uniform}
          for lr in _LRS
          for arm in ('warmup', 'no_warmup')
        },
      ),
    ],  # fmt: skip
    rules=rules,
  )
