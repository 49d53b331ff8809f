"""Claim: on the numbers task the cross-attention maps show the source-target alignment: most
attention mass sits on the digits that decide each output word."""

from research.spec import PAPER_SCHEDULE

# --scale of the one-GPU run (an estimate, not measured: one H200, 3200 steps (x4); 1 run: ~2 min).
GPU_SCALE = 4


def get_sweep(scale: int = 1) -> dict:
  steps = 800 * scale
  rules = [
    dict(kind='greater', metric='align.score', metric_b='align.chance', a='default', b='default',
         rel_margin=0.5,
         text='alignment well above chance'),
  ]  # fmt: skip
  return dict(
    name='cross_attention_alignment',
    claim='Cross attention learns the source-target alignment: the share of its mass on the gold '
    'alignment is well above chance.',
    description='The embedded default (EncoderDecoder 2+2 layers, d_model 128, 4 heads) on the '
    'numbers task. Gold alignment (research.measures.gold_alignment): the digits split into '
    'groups of three from the right; in a group (h, t, o), "X hundred" <- h, a tens word <- t, a '
    'ones word <- o, "ten".."nineteen" <- t and o, the scale word ("thousand", ...) <- its whole '
    'group; a token aligns with the digits of the words it spans. align.score: the share of '
    'head-averaged cross-attention mass on gold source tokens, over target tokens of 64 held-out '
    'numbers, for the best decoder layer; align.chance: the share of visible source tokens that '
    'are gold.',
    base='configs/default.py',
    overrides={
      **PAPER_SCHEDULE,  # the rsqrt schedule these results were run with
      'train.steps': steps,
      'train.log_every': 10,
      'train.eval_every': steps,
      'train.checkpoint_every': steps // 2,
      'train.eval_decode_examples': 256,
    },
    variants={'default': {}},
    measure='alignment',
    metrics=['align.score', 'align.best_head', 'align.chance', 'eval.bleu'],
    nulls=[
      dict(
        name='uniform attention',
        reason='a model that learned nothing attends about '
        'uniformly over the visible source tokens, and so puts on the gold ones the share '
        'that align.chance is, as recorded',
        values={
          'default': {'align.score': 'as recorded: align.chance', 'align.chance': 'as recorded'}
        },
      ),
    ],  # fmt: skip
    rules=rules,
  )
