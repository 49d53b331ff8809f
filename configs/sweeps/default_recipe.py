"""Recipe selection for the embedded default: which schedule reaches BLEU >= 97 and
exact match >= 95% at every seed in the default's 1000 steps of 64."""

# --scale of the one-GPU run (an estimate, not measured: one H200, the claim is about the default's
# own 1000 steps, so the GPU reruns it as it is: 20 runs of ~1 min (4 evaluations decode 512 numbers
# each); ~6 min at --parallel=4).
GPU_SCALE = 1

_RECIPE_KEYS = (
  'optim.schedule', 'optim.learning_rate', 'optim.warmup_steps', 'optim.end_learning_rate_factor',
  'optim.clip_norm', 'train.label_smoothing',
)  # fmt: skip


def _recipe(schedule, learning_rate, warmup, end=0.0, clip=0.0, smoothing=0.1) -> dict:
  """Every knob a variant may change, stated in full, so the runs do not move with default.py."""
  return dict(zip(_RECIPE_KEYS, (schedule, learning_rate, warmup, end, clip, smoothing)))


def get_sweep(scale: int = 1) -> dict:
  steps = 1000 * scale
  rules = [
    dict(kind='at_least', metric='eval.bleu', variants=['cos3e-3_w100'], value=97.0,
         every_seed=True,
         text='the chosen recipe reaches BLEU >= 97 at every seed'),
    dict(kind='at_least', metric='eval.exact_match', variants=['cos3e-3_w100'], value=0.95,
         every_seed=True,
         text='and exact match >= 95% at every seed'),
  ]  # fmt: skip
  return dict(
    name='default_recipe',
    claim='With a linear warmup to 3e-3 and a cosine to 0, the default run reaches BLEU >= 97 and '
    'exact match >= 95% at every seed.',
    description='`python -m experiments.train` as it is (EncoderDecoder 2+2 layers, d_model 128, '
    'numbers task, 1000 steps of 64, evaluation at steps 500 and 1000 on 512 held-out numbers), '
    'with the optimizer schedule varied. `rsqrt`: the old default (paper schedule, 300 warmup '
    'steps, peak 128^-0.5 * 300^-0.5 = 0.0051). `cos5e-3_w300`, `cos3e-3_w100`, `cos5e-3_w100`: '
    'linear warmup to the peak, then half a cosine to 0 at the last step. Candidates were first '
    'screened at seed 0 (the seed the old recipe fails); the chosen one and the old one ran at '
    'seeds 0-4. The rules take the worst seed (every_seed=True); README lists every seed.',
    base='configs/default.py',
    # Stated, so that the runs stay put when default.py changes its evaluation cadence (it now
    # evaluates at the end only; the step-500 evaluation here adds a point to the curves).
    overrides={'train.steps': steps, 'train.eval_every': 500, 'train.checkpoint_every': 500},
    variants={
      'rsqrt': _recipe('rsqrt', 1.0, 300),
      'cos5e-3_w300': _recipe('warmup_cosine', 0.0051, 300),
      'cos3e-3_w100': _recipe('warmup_cosine', 0.003, 100),
      'cos5e-3_w100': _recipe('warmup_cosine', 0.0051, 100),
    },
    metrics=['eval.bleu', 'eval.exact_match', 'eval.loss'],
    nulls=[
      dict(
        name='untrained',
        reason='a model that learned nothing spells no number: BLEU 0 and '
        'exact match 0 (an analytic value)',
        values={'cos3e-3_w100': {'eval.bleu': 0.0, 'eval.exact_match': 0.0}},
      ),
    ],  # fmt: skip
    rules=rules,
  )
