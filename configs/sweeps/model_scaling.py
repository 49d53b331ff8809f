"""Claim (Kaplan et al. 2020): at a fixed token budget, loss falls as a power law of the number
of (non-embedding) parameters. Six GPT widths, the same steps and batches."""

_WIDTHS = (16, 32, 48, 64, 96, 128)


def get_sweep(scale: int = 1) -> dict:
  steps = 600 * scale
  return dict(
    name='model_scaling',
    claim='At a fixed token budget, the loss falls as a power law of the parameter count: '
    'loss ∝ N^-alpha with alpha > 0.',
    description='CausalLM 2 layers, 4 heads, d_ff = 4 d_model, d_model 16..128, grammar task, '
    f'{steps} steps of 16 rows x 64 tokens for every size. N = parameters without the embedding '
    'table. The grammar has an entropy floor (~1.5 nats/token), so the plain power law bends '
    'near it.',
    base='configs/gpt_tiny.py',
    overrides={
      'data.max_length': 64,
      'data.batch_size': 16,
      'train.steps': steps,
      'train.log_every': 10,
      'train.eval_every': steps,
      'train.checkpoint_every': steps,
    },
    variants={
      f'd{w * scale}': {'model.d_model': w * scale, 'model.d_ff': 4 * w * scale} for w in _WIDTHS
    },
    metrics=['eval.loss', 'params_non_embedding'],
    rules=[
      dict(
        kind='fit_power_law',
        x='params_non_embedding',
        y='eval.loss',
        slope_sign=-1,
        min_r2=0.9,  # a straight line on log-log axes, not merely a falling loss
        text='loss falls as a power of N',
      ),
    ],
    plots=[
      dict(
        kind='scatter',
        x='params_non_embedding',
        y='eval.loss',
        logx=True,
        logy=True,
        fit=True,
        title='eval loss against parameters (log-log)',
        xlabel='non-embedding parameters',
        ylabel='eval loss (nats/token)',
      ),
    ],
  )
