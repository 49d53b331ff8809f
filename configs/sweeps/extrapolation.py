"""Claim: trained at length L and evaluated at L, 2L, 4L, 8L, learned positions cannot go past L,
sinusoidal degrades, and RoPE with test-time scaling (linear, NTK, YaRN) holds best."""

from research.spec import task_losses

_LENGTH = 32  # L: every training row has exactly this many tokens

# About 3 GPU minutes on one H200: 5 trained runs of 1600 steps, then 8 x 4 evaluation lengths.
GPU_SCALE = 4


def _nulls(variants, factors) -> list[dict]:
  """A model that learns only token frequencies, built as each variant."""
  unigram = task_losses('configs/gpt_tiny.py', {'data.grammar_join': 24})['unigram']
  inf = float('inf')
  values = {
    v: {f'extrap.loss_{k}x': inf if v == 'learned' and k > 1 else unigram for k in factors}
    for v in variants
  }
  return [
    dict(
      name='unigram',
      reason="a model that learns only how often each token occurs scores the grammar's "
      f'unigram loss, {unigram:.3f} nats, at every length it can run (computed from the '
      'task); learned positions have no table rows past L, so that variant cannot run there '
      '(inf), trained or not',
      values=values,
    ),
  ]


def get_sweep(scale: int = 1) -> dict:
  steps = 400 * scale
  rules = [
    dict(kind='greater', metric='extrap.loss_2x', metric_b='extrap.loss_1x', a='learned',
         b='learned',
         text='learned positions cannot go past L'),
    dict(kind='greater', metric='extrap.loss_4x', metric_b='extrap.loss_1x', a='sinusoidal',
         b='sinusoidal',
         text='sinusoidal degrades'),
    dict(kind='best', metric='extrap.loss_8x',
         among=['sinusoidal', 'learned', 'rope', 'rope_linear', 'rope_ntk', 'rope_yarn'],
         expect=['rope_linear', 'rope_ntk', 'rope_yarn'],
         text='RoPE with scaling holds best'),
  ]  # fmt: skip
  plots = [
    dict(kind='series',
         metrics=['extrap.loss_1x', 'extrap.loss_2x', 'extrap.loss_4x', 'extrap.loss_8x'],
         x=[_LENGTH, 2 * _LENGTH, 4 * _LENGTH, 8 * _LENGTH], logx=True,
         title='held-out loss against evaluation length', xlabel='tokens per row (trained: L)',
         ylabel='loss (nats/token)'),
  ]  # fmt: skip
  return dict(
    name='extrapolation',
    claim='Trained at length L: learned positions cannot go past L, sinusoidal degrades with '
    'length, and RoPE with test-time scaling holds best among these.',
    description=f'CausalLM 2 layers, d_model 64 (gpt_tiny) on the grammar task with 24 documents '
    f'joined per example, so every training row is one truncated example of exactly L = {_LENGTH} '
    'tokens (no packing: positions 0..L-1). Eval rows are held-out examples cut the same way to '
    'k*L tokens, k = 1, 2, 4, 8: no training row was longer than L. The RoPE scalings reuse the '
    'trained `rope` checkpoint with model.rope_scaling set at test time and '
    'rope_scaling_factor = k (original length L). ALiBi and no positions are shown for '
    'reference; the claim compares the schemes it names. ALiBi is checked against the paper '
    '(slopes 2^(-8k/n) with its rule for head counts that are not powers of two, bias -m (i - j) '
    'on keys j <= i) and a float64 reference, through the dense and chunked paths and the KV '
    "cache past the trained length (tests/model/test_alibi.py); with gpt_tiny's 4 heads its "
    'slopes are 1/4, 1/16, 1/64 and 1/256, so over L = 32 tokens two heads are almost '
    'position-free, which may be why it extrapolates no better than no positions here (Press et '
    'al. train at 512 tokens and more). inf = cannot run at that length. Every '
    "variant multiplies the token embeddings by sqrt(d_model), as the paper does: with gpt_tiny's "
    'unscaled embeddings (std 0.02) the sinusoidal table (RMS 0.7) drowns the tokens and that '
    'variant does not train (loss 3.2 against 1.7 at length L in a first run).',
    base='configs/gpt_tiny.py',
    overrides={
      'model.scale_embeddings': True,  # the paper's sqrt(d_model), so sinusoidal can train
      'model.max_length': _LENGTH,
      'data.max_length': _LENGTH,
      'data.pack': False,
      'data.grammar_join': 24,
      'data.num_train_examples': 2000 * scale,
      'data.num_eval_examples': 64,
      'train.steps': steps,
      'train.log_every': 10,
      'train.eval_every': steps,
      'train.checkpoint_every': steps,
      'train.eval_decode_examples': 0,  # greedy samples would run past L with learned positions
    },
    variants={p: {'model.position': p} for p in ('sinusoidal', 'learned', 'rope', 'alibi', 'none')},
    eval_variants={
      f'rope_{s}': {'from': 'rope', 'overrides': {'model.rope_scaling': s}}
      for s in ('linear', 'ntk', 'yarn')
    },
    measure='extrapolation',
    measure_args={'factors': (1, 2, 4, 8), 'examples': 32},
    metrics=['extrap.loss_1x', 'extrap.loss_2x', 'extrap.loss_4x', 'extrap.loss_8x'],
    nulls=_nulls(
      ['sinusoidal', 'learned', 'rope', 'alibi', 'none', 'rope_linear', 'rope_ntk', 'rope_yarn'],
      (1, 2, 4, 8),
    ),
    rules=rules,
    plots=plots,
  )
