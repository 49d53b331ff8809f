"""Indirect-object identification (IOI, Wang et al. 2022) on a model trained offline: the
generated sentences, the clean and corrupted prompts, and one dissection of a run with the hooks
(activation and attribution patching, head ablation, direct logit attribution, attention from
S2 and the last token). `experiments.ioi` trains the runs and writes the report; docs/dissect.md
walks through it.
"""

from __future__ import annotations

import dataclasses
import os
import random

import jax.numpy as jnp
import numpy as np

from research import interventions as iv
from transformer import data
from transformer.model import hooks

NAMES = (
  'Mary', 'John', 'Anna', 'Tom', 'Lisa', 'Paul', 'Kate', 'Mark',
  'Emma', 'Jack', 'Sara', 'Dave', 'Rose', 'Adam', 'Nora', 'Sam',
)  # fmt: skip
PLACES = ('store', 'park', 'school', 'garden', 'station', 'market', 'office', 'beach')
OBJECTS = ('drink', 'book', 'ring', 'ball', 'letter', 'snack', 'key', 'gift')
# {A} and {B} are IO and S in either order; S comes back, and the sentence ends with IO.
TEMPLATES = (
  'When {A} and {B} went to the {P}, {S} gave a {O} to {IO}.',
  'After {A} and {B} went to the {P}, {S} gave a {O} to {IO}.',
  'Then {A} and {B} had a long talk at the {P}. {S} handed a {O} to {IO}.',
  '{A} and {B} were working at the {P}. {S} decided to give a {O} to {IO}.',
)


def sentences(n: int, seed: int = 0) -> list[str]:
  """n IOI sentences: a random template, two different names in a random order, place, object."""
  rng = random.Random(seed)
  out = []
  for _ in range(n):
    io, s = rng.sample(NAMES, 2)
    a, b = (io, s) if rng.random() < 0.5 else (s, io)
    place, thing = rng.choice(PLACES), rng.choice(OBJECTS)
    out.append(rng.choice(TEMPLATES).format(A=a, B=b, S=s, IO=io, P=place, O=thing))
  return out


@dataclasses.dataclass
class Prompts:
  """A clean and a corrupted batch of IOI prompts with the same tokens but S2."""

  clean: np.ndarray  # [B, T] int32: bos + "When IO and S went to the store, S gave a drink to"
  corrupt: np.ndarray  # [B, T]: the same with S2 replaced by a third name
  io: np.ndarray  # [B] each row's IO token
  s: np.ndarray  # [B] each row's S token
  labels: list[str]  # [T] the first prompt's pieces, its names replaced by IO, S1 and S2
  roles: dict[str, int]  # position of IO, S1, S2 and END (the last token)


def prompts(tokenizer, n: int = 64, seed: int = 1, bos: int = data.BOS_ID) -> Prompts:
  """n prompts of the first template (store, drink) with IO first, each a different name pair."""
  rng = random.Random(seed)
  pairs = [(io, s) for io in NAMES for s in NAMES if io != s]
  rng.shuffle(pairs)
  if not 1 <= n <= len(pairs):
    raise ValueError(f'prompts={n} must be in [1, {len(pairs)}] (the ordered name pairs)')
  template = TEMPLATES[0].split(' {IO}')[0]
  rows, corrupt, io_ids, s_ids = [], [], [], []
  for io, s in pairs[:n]:
    text = template.format(A=io, B=s, S=s, P='store', O='drink')
    c = rng.choice([x for x in NAMES if x not in (io, s)])
    ids = tokenizer.encode(text)
    names = []
    for name in (io, s):
      full = tokenizer.encode(f'{text} {name}.')
      if full[: len(ids)] != ids or tokenizer.decode([full[len(ids)]]).strip() != name:
        raise ValueError(
          f'the name {name!r} is not one token after the prompt with this tokenizer; IOI needs '
          'one token per name (train on `sentences()`, as python -m experiments.ioi does)'
        )
      names.append(full[len(ids)])
    bad = template.format(A=io, B=s, S=c, P='store', O='drink')
    rows.append([bos] + ids)
    corrupt.append([bos] + tokenizer.encode(bad))
    io_ids.append(names[0])
    s_ids.append(names[1])
  lengths = {len(r) for r in rows + corrupt}
  if len(lengths) != 1:
    raise ValueError(f'the prompts tokenise to different lengths {sorted(lengths)}; need one')
  clean, bad = np.asarray(rows, np.int32), np.asarray(corrupt, np.int32)
  io_ids, s_ids = np.asarray(io_ids, np.int32), np.asarray(s_ids, np.int32)
  io_at = np.argmax(clean == io_ids[:, None], 1)
  s_at = [np.flatnonzero(row == s) for row, s in zip(clean, s_ids)]
  if len(set(io_at)) != 1 or any(len(x) != 2 or list(x) != list(s_at[0]) for x in s_at):
    raise ValueError('the names do not sit at the same positions in every prompt')
  roles = {
    'IO': int(io_at[0]),
    'S1': int(s_at[0][0]),
    'S2': int(s_at[0][1]),
    'END': len(rows[0]) - 1,
  }
  labels = [tokenizer.decode([t]) or '_' for t in clean[0]]
  labels[0] = '<bos>'
  for role, at in roles.items():
    if role != 'END':
      labels[at] = role
  return Prompts(clean, bad, io_ids, s_ids, labels, roles)


def dissect(cfg, params, p: Prompts, out: str | None = None) -> dict:
  """The measures listed in the module docstring, on one model; figures to `out` if given."""
  clean, corrupt = {'inputs': jnp.asarray(p.clean)}, {'inputs': jnp.asarray(p.corrupt)}
  B, L = p.clean.shape[0], cfg.num_layers
  metric = iv.logit_diff(-1, p.io, p.s)
  rows = np.arange(B)

  def diffs(logits):
    last = np.asarray(logits, np.float64)[:, -1]
    return last[rows, p.io] - last[rows, p.s], last

  names = [f'blocks.{l_}.attn.hook_pattern' for l_ in range(L)]
  clean_logits, cache = hooks.run_jit(cfg, params, clean, names=names)
  clean_d, last = diffs(clean_logits)
  corr_d, _ = diffs(hooks.run_jit(cfg, params, corrupt)[0])
  r = {
    'clean': float(clean_d.mean()), 'clean_std': float(clean_d.std()),
    'corrupt': float(corr_d.mean()), 'corrupt_std': float(corr_d.std()),
    'io_over_s': float((clean_d > 0).mean()),
    'top1_io': float((last.argmax(-1) == p.io).mean()),
  }  # fmt: skip
  span = r['clean'] - r['corrupt']
  for activation in ('resid_pre', 'attn_out', 'mlp_out', 'z'):
    if activation == 'mlp_out' and not cfg.d_ff:
      continue
    raw = iv.patching(cfg, params, clean, corrupt, metric, activation)
    r[f'patch_{activation}'] = (raw - r['corrupt']) / span
  approx = iv.attribution_patching(cfg, params, clean, corrupt, metric, 'z')
  r['attrib_z'] = (approx - r['corrupt']) / span
  r['attrib_r'] = float(np.corrcoef(r['attrib_z'].ravel(), r['patch_z'].ravel())[0, 1])
  for mode in ('zero', 'mean'):  # mean: each head's mean output over the clean prompts
    r[f'ablate_{mode}'] = iv.head_ablation_effects(cfg, params, clean, metric, mode, clean)
  parts = iv.direct_logit_attribution(cfg, params, clean, -1, p.io, p.s)
  total = parts.pop('total')
  r['dla'] = {k: float(v.mean()) for k, v in parts.items()}
  r['dla_residual'] = float(np.abs(sum(parts.values()) - total).max())
  # Where every head looks from S2 and from END: mean attention on IO, S1 and S2 [L, N, 2, 3].
  keys = [p.roles[k] for k in ('IO', 'S1', 'S2')]
  queries = [p.roles[k] for k in ('S2', 'END')]
  patterns = np.stack([np.asarray(cache[n], np.float64).mean(0) for n in names])  # [L, N, T, S]
  r['looks'] = patterns[:, :, queries][..., keys]
  layer, head = np.unravel_index(np.argmax(r['patch_z']), r['patch_z'].shape)
  r['key_head'] = (int(layer), int(head))  # the head whose clean output restores the most
  groups = {'heads': '.head_', 'MLPs': '.mlp', 'embeddings': 'embed'}
  r['dla_groups'] = {
    g: sum(v for k, v in r['dla'].items() if key in k) for g, key in groups.items()
  }
  if out:
    _figures(r, p, cfg, out)
  return r


def _figures(r: dict, p: Prompts, cfg, out: str) -> None:
  os.makedirs(out, exist_ok=True)
  for activation in ('resid_pre', 'attn_out', 'mlp_out'):
    if f'patch_{activation}' in r:
      iv.heatmap(r[f'patch_{activation}'], os.path.join(out, f'ioi_patch_{activation}.png'),
                 f'patching {activation} (1 = restores the clean logit difference)', 'position',
                 p.labels)  # fmt: skip
  iv.heatmap(np.concatenate([r['patch_z'], r['attrib_z']], 1),
             os.path.join(out, 'ioi_patch_z.png'),
             'heads: patching (left), attribution (right)', 'head',
             [f'{h}' for h in range(cfg.num_heads)] * 2)  # fmt: skip
  iv.heatmap(np.concatenate([r['ablate_zero'], r['ablate_mean']], 1),
             os.path.join(out, 'ioi_ablation.png'),
             'one head ablated: zero (left), mean (right)',
             'head', [f'{h}' for h in range(cfg.num_heads)] * 2)  # fmt: skip
  iv.bars(
    r['dla'],
    os.path.join(out, 'ioi_dla.png'),
    f'direct logit attribution of logit(IO) - logit(S) (sum {r["clean"]:.2f})',
  )


def _fmt(x: np.ndarray) -> str:
  return ' / '.join(f'{v:+.2f}' for v in x)


def report(results: list[dict], p: Prompts, cfg, command: str, revision: str) -> str:
  """ioi.md: the table over seeds, every seed's heads, then the first seed's figures."""
  lines = ['# IOI, dissected', '', f'Command: `{command}` at {revision}.', '']
  lines += [
    f'{len(results)} runs of configs/gpt_tiny.py (seeds 0-{len(results) - 1}) on '
    f'{p.clean.shape[0]} prompts "When IO and S went to the store, S gave a drink to", each with '
    'its own pair of names; the corrupted prompts replace S2 by a third name. The logit '
    'difference is logit(IO) - logit(S) after the last token (mean ± std over the prompts). '
    'Patching is normalised, (patched - corrupted) / (clean - corrupted): 1 restores the clean '
    'run, 0 changes nothing. The key head is the one whose clean output (hook_z), patched into '
    'the corrupted run, restores the most.',
    '',
    '| seed | logit diff clean | corrupted | IO > S | top-1 is IO | resid_pre at END, patched, '
    'by layer | key head: patched / attribution estimate | its attention from END on IO / S1 / '
    'S2 | mean-ablating it | direct logit attribution: heads / MLPs / embeddings | attribution '
    'vs patching over heads (r) |',
    '|---|---|---|---|---|---|---|---|---|---|---|',
  ]
  end = p.roles['END']
  three = lambda x: ' / '.join(f'{v:.2f}' for v in x)
  for seed, r in enumerate(results):
    layer, head = r['key_head']
    g = r['dla_groups']
    lines.append(
      f'| {seed} | {r["clean"]:.2f} ± {r["clean_std"]:.2f} | {r["corrupt"]:.2f} ± '
      f'{r["corrupt_std"]:.2f} | {r["io_over_s"]:.2f} | {r["top1_io"]:.2f} | '
      f'{_fmt(r["patch_resid_pre"][:, end])} | {layer}.{head}: {r["patch_z"][layer, head]:.2f} / '
      f'{r["attrib_z"][layer, head]:.2f} | {three(r["looks"][layer, head, 1])} | '
      f'{r["ablate_mean"][layer, head]:+.2f} | {g["heads"]:+.2f} / {g["MLPs"]:+.2f} / '
      f'{g["embeddings"]:+.2f} | {r["attrib_r"]:.3f} |'
    )
  lines += ['', 'Every head of every seed: its effect on the clean logit difference when ablated '
            "(zero, or the mean of its output over the prompts), patching its output, and where it "
            'looks from S2 and from END.', '']  # fmt: skip
  lines += ['| seed | head | zero-ablation | mean-ablation | patched | attention from S2 on IO / '
            'S1 / S2 | from END on IO / S1 / S2 |', '|---|---|---|---|---|---|---|']  # fmt: skip
  for seed, r in enumerate(results):
    for layer in range(cfg.num_layers):
      for head in range(cfg.num_heads):
        at = r['looks'][layer, head]
        lines.append(
          f'| {seed} | {layer}.{head} | {r["ablate_zero"][layer, head]:+.2f} | '
          f'{r["ablate_mean"][layer, head]:+.2f} | {r["patch_z"][layer, head]:.2f} | '
          f'{three(at[0])} | {three(at[1])} |'
        )
  r = results[0]
  lines += ['', '## Seed 0', '']
  lines += [f'Position labels: {" ".join(f"`{x}`" for x in p.labels)}', '']
  for name in ('resid_pre', 'attn_out', 'mlp_out'):
    if f'patch_{name}' in r:
      lines += [f'![patching {name}](ioi_patch_{name}.png)', '']
  lines += ['![patching heads](ioi_patch_z.png)', '', '![ablation](ioi_ablation.png)', '']
  lines += ['![direct logit attribution](ioi_dla.png)', '']
  top = sorted(r['dla'].items(), key=lambda kv: -abs(kv[1]))[:6]
  lines += ['Largest parts: ' + ', '.join(f'{k} {v:+.2f}' for k, v in top) + '; the parts sum '
            f'to the logit difference within {r["dla_residual"]:.1e}.']  # fmt: skip
  return '\n'.join(lines) + '\n'
