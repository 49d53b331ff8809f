"""Claim (Zoology, Arora et al. 2023, MQAR): at a fixed model width, as the key-value pairs grow,
full attention keeps recalling while the ways out of its O(n^2) cost fall behind: a local window,
hierarchical compression and linear attention, whose recall grows with its state (the feature
dimension: Zoology's recall-memory tradeoff).

Elimination is worth almost nothing here: 512 keys and 512 values (one token each), distinct
values, and only a quarter of the pairs asked, so keeping the bag of values and dropping those
answered scores 1.00-1.13 times 1 / pairs (with every key asked it would score 0.34 at 8
pairs). Each seed draws its own data, no eval example occurs in training, and every arm keeps
the learning rate, of three to five, with the lowest training loss: chosen without the held-out
examples that score it.
"""

# --scale of a one-GPU run, with Zoology's range: 8192 keys and values, pairs up to 64 (rows of
# up to 176 tokens). Not measured: 4x the steps of 69 runs per seed.
GPU_SCALE = 4

_GAP = 8  # filler zeros between the pairs and the queries: every pair >= 10 tokens back
_WINDOW = 2  # keys back per layer; with the 3-tap convolution 2 layers reach 2 * (2 + 2) = 8
_BLOCK = 8  # attention='compressed': tokens pooled per block
_RATES = {'lr1e-3': 1e-3, 'lr3e-3': 3e-3, 'lr1e-2': 1e-2}  # peak rates, a third of Zoology's grid
# ... widened, in order, for the arms whose best mean recall lay at an edge of those three in the
# runs at fce017b: full attention (at 4 pairs) and linear attention at 1e-2, compressed at 1e-3.
# At 3e-2 and 3e-4 (runs at 24aae32) linear and compressed were best at the new edge again, so
# they go one step further.
_WIDER = {
  'full': {'lr3e-2': 3e-2},
  'linear': {'lr3e-2': 3e-2, 'lr1e-1': 1e-1},
  'compressed': {'lr1e-4': 1e-4, 'lr3e-4': 3e-4},
}


def _rates(arm: str) -> dict[str, float]:
  """An arm's peak rates in increasing order ('linear_h8' as 'linear')."""
  wider = _WIDER.get(arm.split('_')[0], {})
  return dict(sorted({**_RATES, **wider}.items(), key=lambda item: item[1]))


_ARMS = {
  'full': {'model.attention_impl': 'xla'},
  f'w{_WINDOW}': {'model.window': (_WINDOW, 0), 'model.attention_impl': 'chunked'},
  'linear': {'model.attention': 'linear'},  # head_dim 16: d_model 64 over 4 heads
  'compressed': {'model.attention': 'compressed', 'model.compress_block': _BLOCK},
}
# Linear attention's state per layer and head is [head_dim, head_dim] (elu + 1 acts elementwise,
# so its feature dimension is head_dim): the 'linear' arm is 16; these add the others at the
# largest pair count on 2 CPU cores (8) or at 16 pairs on a GPU.
_HEAD_DIMS = (8, 16, 32, 64)
# Steps per pair count (times --scale). At 8 pairs and peak rate 3e-3, full attention learned at
# about step 1000-1400 of a 4000-step run (seed 0); a 1500-step run had reached only 0.41.
_STEPS = {4: 1500, 8: 2500, 16: 3000, 32: 3000, 64: 3000}


def _pairs(scale: int) -> tuple[int, ...]:
  """Pair counts: as far as 2 CPU cores go (8 pairs; each seed is ~80 min of run time), and
  Zoology's range on a GPU."""
  return (4, 8, 16, 32, 64) if scale >= GPU_SCALE else (4, 8)


def _state_pairs(scale: int) -> int:
  return 16 if scale >= GPU_SCALE else 8


def _states(scale: int) -> list[str]:
  """The groups of linear attention at _state_pairs, smallest state first ('p8_linear_h8')."""
  n = _state_pairs(scale)
  return [f'p{n}_linear' + ('' if d == 16 else f'_h{d}') for d in _HEAD_DIMS]


def _vocab(scale: int) -> int:
  return 8192 if scale >= GPU_SCALE else 512


def _row(pairs: int) -> int:
  """Row length: bos + pairs + filler + a quarter of the keys asked, in whole blocks."""
  tokens = 1 + 2 * pairs + _GAP + 2 * (pairs // 4)
  return -(-tokens // _BLOCK) * _BLOCK


def measure(ctx) -> dict:
  from research import long_context

  return long_context.recall_accuracy(ctx)


def _arms() -> dict[str, dict]:
  """Each arm's overrides, the linear state sizes included ('linear_h8', ...)."""
  state = {f'linear_h{d}': {**_ARMS['linear'], 'model.head_dim': d} for d in _HEAD_DIMS if d != 16}
  return {**_ARMS, **state}


def _variants(scale: int) -> dict[str, dict]:
  """'p{n}_{arm}_{rate}': n pairs, n / 4 asked; the linear state sizes at _state_pairs only."""
  steps, out = _STEPS, {}
  for n in _pairs(scale):
    task = {
      'data.recall_pairs': n, 'data.recall_queries': n // 4, 'data.max_length': _row(n),
      'model.max_length': max(128, _row(n)), 'train.steps': steps[n] * scale,
      'train.eval_every': steps[n] * scale, 'train.checkpoint_every': steps[n] * scale,
    }  # fmt: skip
    for arm, overrides in _arms().items():
      if arm.startswith('linear_h') and n != _state_pairs(scale):
        continue
      for tag, rate in _rates(arm).items():
        out[f'p{n}_{arm}_{tag}'] = {**task, **overrides, 'optim.learning_rate': rate}
  return out


def _groups(variants) -> dict[str, dict]:
  """'p{n}_{arm}': the learning rate of that arm at n pairs with the lowest train.loss (the mean
  loss of the last 10% of logged training batches, examples disjoint from the held-out ones), so
  that the held-out examples that score recall.accuracy play no part in the choice."""
  groups = {}
  for name in variants:
    group = name.rsplit('_', 1)[0]
    entry = {'best_of': [], 'metric': 'train.loss', 'grid': True}  # rates, in order
    groups.setdefault(group, entry)['best_of'].append(name)
  return groups


def _nulls(groups, scale: int) -> list[dict]:
  """What recall scores without a key-to-value lookup: nothing of the pairs, or elimination."""
  from research import long_context

  vocab = _vocab(scale)
  elimination = {
    n: sum(long_context.elimination_accuracy(n, _GAP, n // 4, count=2_000, vocab=vocab)) / (n // 4)
    for n in _pairs(scale)
  }  # fmt: skip
  shown = ', '.join(f'{n} pairs: {x:.4f} (1/{n} = {1 / n:.4f})' for n, x in elimination.items())
  return [
    dict(
      name='no pairs',
      values={g: {'recall.accuracy': 1 / vocab} for g in groups},
      reason=f'a model that sees none of the pairs guesses among the {vocab} values: 1/{vocab}',
    ),
    dict(
      name='elimination',
      values={g: {'recall.accuracy': elimination[int(g.split('_')[0][1:])]} for g in groups},
      reason='no key-to-value lookup: keep the bag of values from the pairs, drop those '
      'already answered and guess one of the rest. A quarter of the pairs is asked and the '
      'values are distinct, so this is little more than copying any value of the pairs '
      f'(1/pairs). Expected accuracy from the generator: {shown}',
    ),
    dict(
      name='out of reach',
      values={
        g: {'recall.accuracy': 0.9 if g.endswith('_full') else 1 / vocab}
        for g in groups
        if g.endswith(('_full', f'_w{_WINDOW}'))
      },
      reason=f'the window reaches at most 8 tokens back (2 layers of {_WINDOW} keys, each '
      f'widened by the 3-tap convolution) and every pair lies at least {_GAP + 2} tokens before '
      'its query, so the window sees no pair whatever it learns (1/vocab), while full attention '
      'meets its precondition (0.9): "full attention recalls more than a local window" holds '
      'for any full attention that learns, by construction',
    ),
  ]


def _rules(scale: int) -> tuple[list[dict], list[dict]]:
  """(preconditions, rules), each on the arms' best learning rates, chance = elimination."""
  chance = dict(chance='elimination', chance_tolerance=0.01)
  gap = dict(kind='greater', metric='recall.accuracy', rel_margin=0.1, **chance)
  preconditions, rules = [], []
  for n in _pairs(scale):
    name = f'full attention learns p{n}'
    preconditions.append(
      dict(name=name, kind='at_least', metric='recall.accuracy', variants=[f'p{n}_full'],
           value=0.9, every_seed=True, text=f'full attention recalls >= 0.9 with {n} pairs')
    )  # fmt: skip
    for arm, words in ((f'w{_WINDOW}', 'a local window'), ('compressed', 'compressed blocks')):
      rules.append(
        dict(**gap, a=f'p{n}_full', b=f'p{n}_{arm}', requires=[name],
             text=f'{n} pairs: full attention recalls more than {words}')
      )  # fmt: skip
    if n >= _state_pairs(scale):
      rules.append(
        dict(**gap, a=f'p{n}_full', b=f'p{n}_linear', requires=[name],
             text=f'{n} pairs: full attention recalls more than linear attention')
      )  # fmt: skip
  rules.append(
    dict(kind='ordering', metric='recall.accuracy', direction='increasing', variants=_states(scale),
         requires=[], text=f'{_state_pairs(scale)} pairs: linear attention recalls more with a '
         f'larger state (head_dim {", ".join(map(str, _HEAD_DIMS))})', **chance)
  )  # fmt: skip
  return preconditions, rules


def get_sweep(scale: int = 1) -> dict:
  variants = _variants(scale)
  groups = _groups(variants)
  preconditions, rules = _rules(scale)
  pairs, vocab, state_pairs = _pairs(scale), _vocab(scale), _state_pairs(scale)
  plots = [
    dict(kind='lines', metric='recall.accuracy', x=list(pairs),
         lines={arm: [f'p{n}_{arm}' for n in pairs] for arm in _ARMS},
         title='recall against the key-value pairs (best rate of each arm)',
         xlabel='key-value pairs', ylabel='value accuracy'),
    dict(kind='lines', metric='recall.accuracy', x=[4 * d * d for d in _HEAD_DIMS],
         lines={'linear attention': _states(scale)}, logx=True,
         title=f'linear attention: recall against its state ({state_pairs} pairs)',
         xlabel='state per layer (heads x head_dim^2)', ylabel='value accuracy'),
  ]  # fmt: skip
  return dict(
    name='recall_mqar',
    claim='As the key-value pairs of MQAR grow at a fixed width, full attention keeps '
    'recalling and recalls more than a local window, compressed blocks and (from '
    f'{state_pairs} pairs) linear attention; linear attention recalls more with a larger state.',
    description='CausalLM gpt_tiny (2 layers, d_model 64, 4 heads, learned positions) with a '
    "3-tap causal convolution before each self attention (model.short_conv=3, as in Zoology's "
    f'MQAR models). Multi-query associative recall: {vocab} keys and {vocab} values, one char '
    f'token each (data.recall_vocab={vocab}, distinct values per example); n pairs, {_GAP} '
    'filler zeros, then n/4 of the keys in a random order, each followed by its value; only '
    "those values carry loss (data.recall_loss='answers'). n = "
    + ', '.join(map(str, pairs))
    + '. Each seed draws its own examples (data.recall_seed=None) and training drops any '
    'example that occurs in the eval set (data.recall_disjoint). Arms: full softmax attention '
    f"('xla'), a sliding window of {_WINDOW} keys back ('chunked'; with the convolution two "
    f'layers reach {2 * (_WINDOW + 2)} tokens, and every pair lies at least {_GAP + 2} back), '
    'linear attention (elu + 1, head_dim 16) and compressed blocks of '
    f'{_BLOCK}; at {state_pairs} pairs also linear attention with head_dim '
    + ', '.join(str(d) for d in _HEAD_DIMS if d != 16)
    + ' (its state per layer is heads x head_dim^2). Every arm trains at peak rates '
    + ', '.join(f'{r:g}' for r in _RATES.values())
    + ', full attention also at '
    + ', '.join(f'{r:g}' for r in _WIDER['full'].values())
    + ', linear attention at '
    + ', '.join(f'{r:g}' for r in _WIDER['linear'].values())
    + ' and compressed blocks at '
    + ', '.join(f'{r:g}' for r in _WIDER['compressed'].values())
    + ' (warmup, then a cosine to 0) and is judged at the rate of its lowest mean train.loss '
    '(the groups p{n}_{arm}; the last 10% of logged training batches, which hold none of the '
    'held-out examples, so the choice does not see the examples that score it). '
    "recall.accuracy: argmax accuracy on the 1024 held-out examples' values. "
    "Not stated as a rule: 'linear falls as the pairs grow' also holds for elimination, whose "
    'score falls as 1/n.',
    base='configs/gpt_tiny.py',
    overrides={
      'model.position': 'learned',
      'model.short_conv': 3,
      'data.task': 'recall',
      'data.tokenizer': 'char',
      'data.pack': False,
      'data.recall_vocab': vocab,
      'data.recall_gap': _GAP,
      'data.recall_filler': 'constant',
      'data.recall_loss': 'answers',
      'data.recall_seed': None,
      'data.recall_disjoint': True,
      'data.batch_size': 64,
      'data.num_train_examples': 100_000 * scale,
      'data.num_eval_examples': 1024,
      'train.log_every': 50,
      'train.eval_decode_examples': 0,
    },
    variants=variants,
    groups=groups,
    measure='measure',
    metrics=['eval.loss', 'recall.accuracy'],
    preconditions=preconditions,
    nulls=_nulls(groups, scale),
    rules=rules,
    plots=plots,
  )
