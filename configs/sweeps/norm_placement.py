"""Claim (Xiong et al. 2020): at depth, pre-LN trains well without warmup, while post-LN needs
warmup. A 6-layer GPT, pre- and post-LN, each with and without warmup."""


def get_sweep(scale: int = 1) -> dict:
  steps = 500 * scale
  return dict(
    name='norm_placement',
    claim='At depth, pre-LN trains well without warmup while post-LN needs it: without warmup '
    'pre-LN ends better than post-LN, and post-LN ends better with warmup than without.',
    description='CausalLM 6 layers, d_model 64, 4 heads, grammar task, rows of 64 tokens, batch '
    '16, AdamW at 3e-3 with a cosine decay; warmup = 100 linear steps, no_warmup = 0. No gradient '
    'clipping, so that nothing else tames the early steps.',
    base='configs/gpt_tiny.py',
    overrides={
      'model.num_layers': 6,
      'data.max_length': 64,
      'data.batch_size': 16,
      'optim.clip_norm': 0.0,
      'train.steps': steps,
      'train.log_every': 5,
      'train.eval_every': steps,
      'train.checkpoint_every': steps,
      'train.nonfinite': 'skip',
    },
    axes={
      'norm': {'pre': {'model.norm_placement': 'pre'}, 'post': {'model.norm_placement': 'post'}},
      'schedule': {'warmup': {'optim.warmup_steps': 100}, 'no_warmup': {'optim.warmup_steps': 0}},
    },
    metrics=['eval.loss', 'train.loss_rise'],
    rules=[
      dict(
        kind='less',
        metric='eval.loss',
        a='pre_no_warmup',
        b='post_no_warmup',
        text='without warmup, pre-LN ends better',
      ),
      dict(
        kind='less',
        metric='eval.loss',
        a='post_warmup',
        b='post_no_warmup',
        text='post-LN needs warmup',
      ),
    ],
  )
