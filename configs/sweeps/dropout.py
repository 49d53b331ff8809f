"""Claim: on a small dataset, a high dropout rate underfits (Table 3 row D varies P_drop)."""


def get_sweep(scale: int = 1) -> dict:
  steps = 400 * scale
  return dict(
    name='dropout',
    claim='On a small dataset, a high dropout rate (0.3) underfits: it fits the training set '
    'worse than no dropout.',
    description='EncoderDecoder 2+2 layers, d_model 128, numbers task with only 2000 training '
    'examples (13 epochs). `trainset.loss` is the loss of the final model on 8 training batches '
    'without dropout (how well it fits what it saw).',
    base='configs/default.py',
    overrides={
      # The paper's rsqrt schedule (peak 0.0051 at step 300), which these results were run
      # with; configs/default.py itself moved to warmup_cosine (issue 14, default_recipe.py).
      'optim.schedule': 'rsqrt',
      'optim.learning_rate': 1.0,
      'optim.warmup_steps': 300,
      'data.num_train_examples': 2000,
      'train.steps': steps,
      'train.log_every': 10,
      'train.eval_every': steps,
      'train.checkpoint_every': steps,
      'train.eval_decode_examples': 256,
    },
    variants={f'd{p}': {'model.dropout_rate': p} for p in (0.0, 0.1, 0.2, 0.3)},
    measure='trainset_loss',
    metrics=['trainset.loss', 'eval.loss', 'eval.bleu'],
    rules=[
      dict(
        kind='greater',
        metric='trainset.loss',
        a='d0.3',
        b='d0.0',
        margin_std=2,
        text='a high rate underfits',
      ),
    ],
  )
