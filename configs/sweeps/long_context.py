"""Claim (seed §6.1): the ways out of attention's O(n^2) keep what nearby tokens need. A local
window and hierarchical compression match full attention where only nearby tokens matter
(grammar); the window and linear attention cost O(n) in memory, compression about n^1.5, full
'xla' attention n^2. What they lose, global recall, is the `recall_mqar` sweep's claim."""

from research.rules import COMPILED_MEMORY
from research.spec import task_losses

# --scale of the one-GPU run (an estimate, not measured: 5 runs of 4x the steps on one H200,
# about 3 min, plus the step costs at 1024-16384 tokens).
GPU_SCALE = 4

_LENGTHS = (256, 512, 1024, 2048, 4096)
_WINDOWS = (4, 8)  # keys back per layer
_BLOCK = 16  # attention='compressed' on grammar: tokens pooled per block (the costs use ~sqrt(T))


def measure(ctx, lengths=_LENGTHS) -> dict:
  from research import long_context

  return long_context.long_context(ctx, lengths=lengths)


def _nulls(arms, data: dict) -> list[dict]:
  """The grammar arms' nulls; the costs have none (nothing learned enters them)."""
  losses = task_losses('configs/gpt_tiny.py', data)
  on_loss = lambda value: {f'grammar_{arm}': {'eval.loss': value} for arm in arms}
  return [
    dict(
      name='unigram',
      reason="a model that learns only how often each token occurs scores the grammar's "
      f'unigram loss, {losses["unigram"]:.3f} nats, whatever its attention (computed from the '
      'task)',
      values=on_loss(losses['unigram']),
    ),
    dict(
      name='previous word',
      reason='the grammar is a first-order chain over words, about a token each: the previous '
      f'word alone reaches its entropy floor, {losses["chain"]:.3f} nats (computed from the '
      'task), and every arm sees the previous token, so matching full attention here needs no '
      'context beyond it',
      values=on_loss(losses['chain']),
    ),
    dict(
      name='the compiled step',
      reason='step time and compiled memory do not depend on what the parameters learned: an '
      'untrained model has the same ones, so they have no null that learns nothing, and the '
      'cost rules are checked against none (they could fail: an arm could grow otherwise)',
      values={},
    ),
  ]


def get_sweep(scale: int = 1) -> dict:
  steps = 300 * scale
  lengths = [n * scale for n in _LENGTHS]
  attention = {
    'full': {'model.attention_impl': 'xla'},
    **{f'w{w}': {'model.window': (w, 0), 'model.attention_impl': 'chunked'} for w in _WINDOWS},
    'linear': {'model.attention': 'linear'},
    'compressed': {'model.attention': 'compressed', 'model.compress_block': _BLOCK},
  }
  ms, mib = [f'ms@{n}' for n in lengths], [f'mib@{n}' for n in lengths]
  power = lambda variant, metrics, low, high, text: dict(
    kind='fit_power_law', variant=f'grammar_{variant}', xs=lengths, metrics=metrics,
    slope_between=(low, high), text=text, **({'exact': COMPILED_MEMORY} if metrics == mib else {}),
  )  # fmt: skip
  close = lambda variant, text: dict(
    kind='close', metric='eval.loss', a=f'grammar_{variant}', b='grammar_full',
    rel_tolerance=0.02, text=text,
  )  # fmt: skip
  w_small, w_large = (f'w{w}' for w in _WINDOWS)
  plots = [
    dict(kind='series', metrics=mib, x=lengths, logx=True, logy=True,
         title='compiled temp memory of a training step (batch 1)', xlabel='tokens', ylabel='MiB'),
    dict(kind='series', metrics=ms, x=lengths, logx=True, logy=True,
         title='training step time on CPU (batch 1)', xlabel='tokens', ylabel='ms'),
  ]  # fmt: skip
  return dict(
    name='long_context',
    claim='A local window and hierarchical compression match full attention on grammar; '
    'window (chunked) and linear memory grow linearly in T, compressed about as T^1.5, full '
    '(xla) attention memory quadratically.',
    description='CausalLM gpt_tiny (2 layers, d_model 64, 4 heads, RoPE). Every variant has the '
    "same parameters, data and steps: full softmax attention ('xla'), sliding windows of "
    f"{_WINDOWS[0]} and {_WINDOWS[1]} keys back ('chunked'), linear attention (elu + 1, "
    "Katharopoulos et al. 2020) and hierarchical compression (attention='compressed': each "
    f'query sees the keys of its own block of {_BLOCK} and the mean-pooled earlier blocks, '
    'after the compressed branch of Native Sparse Attention). grammar: packed Markov-chain '
    'documents, SentencePiece 512 (about a word per token), rows of 64 tokens, '
    f'{steps} steps of 32 rows; eval.loss in nats per token. Costs: one training step of the '
    'same model at batch 1 and T tokens on CPU, the median of 3 after a warm-up (ms@T), and '
    "XLA's compiled temporary memory of it (mib@T); compressed attention pools blocks of the "
    'power of two nearest sqrt(T) there, where T * (block + T / block) is least. Recall, what '
    'the windows, linear attention and compression give up, is measured by the `recall_mqar` '
    'sweep.',
    base='configs/gpt_tiny.py',
    overrides={
      'model.position': 'rope',  # no length-bound table: the costs run to 4096 tokens
      'data.task': 'grammar',
      'data.max_length': 64,
      'data.num_train_examples': 20_000 * scale,
      'data.num_eval_examples': 256,
      'train.steps': steps,
      'train.eval_every': steps,
      'train.checkpoint_every': steps,
      'train.log_every': 20,
      'train.eval_decode_examples': 0,
    },
    axes={'task': {'grammar': {}}, 'attn': attention},
    measure='measure',
    measure_args={'lengths': tuple(lengths)},
    metrics=['eval.loss', ms[-1], mib[-1]],
    nulls=_nulls(attention, {'data.max_length': 64, 'data.num_train_examples': 20_000 * scale}),
    rules=[
      close(w_small, f'grammar: a window of {_WINDOWS[0]} matches full attention'),
      close(w_large, f'grammar: a window of {_WINDOWS[1]} matches full attention'),
      close('compressed', f'grammar: compressed blocks of {_BLOCK} match full attention'),
      power('linear', ms, 0.6, 1.4, 'linear attention step time is O(n)'),
      power('linear', mib, 0.6, 1.4, 'linear attention memory grows linearly'),
      power(w_small, mib, 0.6, 1.4, 'window (chunked) memory grows linearly'),
      power('compressed', mib, 1.2, 1.8, 'compressed attention memory grows about as n^1.5'),
      power('full', mib, 1.6, 2.4, 'full (xla) attention memory grows quadratically'),
    ],
    plots=plots,
  )
