"""Claim (seed §6.1): the ways out of attention's O(n^2) trade global information away. A local
window matches full attention where only nearby tokens matter (grammar) and fails on answers
beyond it (recall); linear attention costs O(n) and lies between them on recall. Memory: the
window (chunked path) and linear grow linearly in T, full 'xla' attention quadratically."""

# --scale of the one-GPU run (an estimate, not measured: 8 runs of 4x the steps on one H200,
# about 4 min, plus the step costs at 1024-16384 tokens).
GPU_SCALE = 4

_LENGTHS = (256, 512, 1024, 2048, 4096)
_WINDOWS = (8, 16)  # left context per layer; 2 layers see at most 2 * 16 = 32 tokens back
_GAP = 32  # filler between the pairs and the queries: every answer's pair is >= 34 tokens back
_PAIRS = (
  8  # key-value pairs, all of them queried: rows of 2 * 8 + 32 + 2 * 8 = 64 tokens + bos, eos
)


def measure(ctx, lengths=_LENGTHS) -> dict:
  from transformer.research import long_context

  return long_context.long_context(ctx, lengths=lengths)


def get_sweep(scale: int = 1) -> dict:
  steps = 800 * scale
  lengths = [n * scale for n in _LENGTHS]
  attention = {
    'full': {'model.attention_impl': 'xla'},
    **{f'w{w}': {'model.window': (w, 0), 'model.attention_impl': 'chunked'} for w in _WINDOWS},
    'linear': {'model.attention': 'linear'},
  }
  recall_knobs = {'data.task': 'recall', 'data.pack': False, 'data.recall_gap': _GAP}
  recall_knobs |= {'data.recall_pairs': _PAIRS, 'data.recall_queries': _PAIRS}
  ms, mib = [f'ms@{n}' for n in lengths], [f'mib@{n}' for n in lengths]
  power = lambda variant, metrics, low, high, text: dict(
    kind='fit_power_law', variant=f'grammar_{variant}', xs=lengths, metrics=metrics,
    slope_between=(low, high), text=text,
  )  # fmt: skip
  return dict(
    name='long_context',
    claim='A local window matches full attention on grammar and fails on recall answers beyond '
    'it; linear attention costs O(n) and lies between them on recall; window (chunked) and '
    'linear memory grow linearly in T, full (xla) attention memory quadratically.',
    description='CausalLM gpt_tiny (2 layers, d_model 64, 4 heads, RoPE), byte tokenizer, rows '
    f'of 128 tokens, {steps} steps of 32 rows, the same for every variant: full softmax '
    f"attention ('xla'), sliding windows of {_WINDOWS[0]} and {_WINDOWS[1]} keys back ('chunked'"
    ') and linear attention (elu + 1, Katharopoulos et al. 2020), so parameters and steps are '
    'equal. grammar: packed Markov-chain documents, eval loss in nats per byte. recall: '
    f'16 key-value pairs, {_GAP} filler bytes, then 8 queried keys each followed by its value; '
    'recall.accuracy is the argmax accuracy on those values (chance 1/26), every one of whose '
    f'pairs lies at least {_GAP + 2} tokens back, beyond what 2 layers of either window can '
    f'reach (2 x {_WINDOWS[-1]}). Costs (grammar runs only: the attention decides them): one '
    'training step of the same model at batch 1 and T tokens on CPU, the median of 3 after a '
    "warm-up (ms@T), and XLA's compiled temporary memory of it (mib@T).",
    base='configs/gpt_tiny.py',
    overrides={
      'model.position': 'rope',  # no length-bound table: the costs run to 4096 tokens
      'data.tokenizer': 'byte',  # one token per character: recall keys and values are tokens
      'data.max_length': 72,
      'data.num_train_examples': 20_000 * scale,
      'data.num_eval_examples': 256,
      'train.steps': steps,
      'train.log_every': 20,
      'train.eval_every': steps,
      'train.checkpoint_every': steps,
      'train.eval_decode_examples': 0,
    },
    axes={'task': {'grammar': {'data.task': 'grammar'}, 'recall': recall_knobs}, 'attn': attention},
    measure='measure',
    measure_args={'lengths': tuple(lengths)},
    metrics=['eval.loss', 'recall.accuracy', ms[-1], mib[-1]],
    rules=[
      dict(
        kind='close',
        metric='eval.loss',
        a='grammar_w8',
        b='grammar_full',
        rel_tolerance=0.02,
        text='grammar: a window of 16 matches full attention',
      ),
      dict(
        kind='close',
        metric='eval.loss',
        a='grammar_w16',
        b='grammar_full',
        rel_tolerance=0.02,
        text='grammar: a window of 32 matches full attention',
      ),
      dict(
        kind='at_most',
        metric='recall.accuracy',
        variants=['recall_w8', 'recall_w16'],
        value=0.1,
        text='recall: the windows fail (near chance, 1/26)',
      ),
      dict(
        kind='greater',
        metric='recall.accuracy',
        a='recall_full',
        b='recall_w16',
        rel_margin=1.0,
        text='recall: full attention answers where the window cannot',
      ),
      dict(
        kind='ordering',
        metric='recall.accuracy',
        variants=['recall_w16', 'recall_linear', 'recall_full'],
        direction='increasing',
        text='recall: linear attention lies between the window and full attention',
      ),
      power('linear', ms, 0.6, 1.4, 'linear attention step time is O(n)'),
      power('linear', mib, 0.6, 1.4, 'linear attention memory grows linearly'),
      power('w8', mib, 0.6, 1.4, 'window (chunked) memory grows linearly'),
      power('full', mib, 1.6, 2.4, 'full (xla) attention memory grows quadratically'),
    ],  # fmt: skip
    plots=[
      dict(
        kind='series',
        metrics=mib,
        x=lengths,
        logx=True,
        logy=True,
        title='compiled temp memory of a training step (batch 1)',
        xlabel='tokens',
        ylabel='MiB',
      ),
      dict(
        kind='series',
        metrics=ms,
        x=lengths,
        logx=True,
        logy=True,
        title='training step time on CPU (batch 1)',
        xlabel='tokens',
        ylabel='ms',
      ),
    ],  # fmt: skip
  )
