"""Claim (Kaplan et al. 2020): at a fixed token budget, the loss above its irreducible floor falls
as a power law of the number of (non-embedding) parameters. Seven GPT widths over 2.4 decades of
N, the same steps and batches."""

from research.results import read_curve
from research.spec import task_losses

# ~4 GPU minutes at GPU_SCALE on one H200: 7 runs of 1600 steps (widths up to 512), dispatch-bound.
GPU_SCALE = 4

_WIDTHS = (8, 12, 20, 32, 52, 80, 128)  # about x1.6 apart; 4 heads divide each
# The grammar's entropy rate per token at these settings: the loss no model can go below.
# data/tasks._grammar_token_info computes it (entropy_per_word / tokens_per_word = 1.5397), and
# each run's log says "entropy floor 1.540 nats/token".
_FLOOR = 1.540


def loss_above_floor(ctx, floor: float) -> dict:
  """The final eval loss minus the entropy floor, for the log-log plot."""
  evals = read_curve(ctx.run_dir)['eval']
  return {'eval.loss_above_floor': evals[-1]['loss'] - floor} if evals else {}


def get_sweep(scale: int = 1) -> dict:
  steps = 400 * scale
  unigram = task_losses('configs/gpt_tiny.py', {'data.max_length': 64})['unigram']
  fit = dict(kind='fit_power_law', x='params_non_embedding', y='eval.loss', slope_sign=-1)
  plots = [
    dict(kind='scatter', x='params_non_embedding', y='eval.loss_above_floor', logx=True, logy=True,
         fit=True,
         title=f'eval loss above the entropy floor {_FLOOR} against parameters (log-log)',
         xlabel='non-embedding parameters', ylabel=f'eval loss - {_FLOOR} (nats/token)'),
  ]  # fmt: skip
  return dict(
    name='model_scaling',
    claim='At a fixed token budget, the loss above the entropy floor E falls as a power law of '
    'the parameter count: L - E ∝ N^-alpha with alpha > 0.',
    description=f'CausalLM 2 layers, 4 heads, d_ff = 4 d_model, d_model {_WIDTHS[0] * scale}..'
    f'{_WIDTHS[-1] * scale}, grammar task, {steps} steps of 16 rows x 64 tokens for every size '
    '(AdamW 3e-3, warmup then cosine). N = parameters without the embedding table. The grammar '
    f'has an exact entropy floor E = {_FLOOR} nats/token, so the power law is fitted to L - E '
    '(alpha = -slope; r2 of log(L - E) against log N), and once more with E fitted too (the '
    'floor minimising the squared error of E + c N^slope in L, over a grid below the lowest L). '
    'At this budget the largest model is still above the floor.',
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
    metrics=['eval.loss', 'eval.loss_above_floor', 'params_non_embedding'],
    nulls=[
      dict(
        name='unigram',
        reason="a model that learns only how often each token occurs scores the grammar's "
        f'unigram loss, {unigram:.3f} nats, at every size (computed from the task); its '
        'parameter count is the one recorded',
        values={
          f'd{w * scale}': {'eval.loss': unigram, 'params_non_embedding': 'as recorded'}
          for w in _WIDTHS
        },
      ),
      dict(
        name='random decreasing',
        reason='curves that only fall, with no law behind them: at the recorded parameter '
        'counts, losses drawn uniformly between the lowest and highest recorded means and '
        'sorted (a straight line in log N is among them); a fit rule that holds on more than 5% '
        'of 200 draws does not count',
        generator='decreasing_curves',
        args={'metric': 'eval.loss', 'variants': [f'd{w * scale}' for w in _WIDTHS]},
        draws=200,
      ),
    ],  # fmt: skip
    measure='loss_above_floor',
    measure_args={'floor': _FLOOR},
    rules=[
      dict(
        **fit,
        floor=_FLOOR,
        min_r2=0.9,  # a straight line on log-log axes, not merely a falling loss
        text=f'L - {_FLOOR} falls as a power of N',
      ),
      dict(**fit, floor='free', min_r2=0.9, text='L - E falls as a power of N, E fitted'),
    ],
    plots=plots,
  )
