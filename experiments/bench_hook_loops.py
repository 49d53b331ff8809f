"""TransformerLens-style loops of run_with_hooks, sparrow beside TransformerLens: python -m
experiments.bench_hook_loops [--layers=12 --d_model=768 --heads=12 --repeats=3]

Writes a random GPT-2 folder (every weight perturbed) and opens it in both: sparrow
(`transformer.load`) and TransformerLens's `TransformerBridge` (weights unprocessed). Then it runs
the Exploratory Analysis Demo's three kinds of loop, in turns (sparrow, TransformerLens, sparrow,
...), each call a new hook that differs only in Python numbers:
  - resid: patch the residual stream at each (layer, position) from the clean run's cache,
    `partial(patch, pos=p, clean_cache=cache)` on blocks.L.hook_resid_pre;
  - head: patch each head's output, `partial(patch_head, head_index=h, clean_cache=cache)` on
    blocks.L.attn.hook_z;
  - ablate: zero each head, a lambda closing over the loop variables.
Prints each loop's median seconds over --repeats and the ratio sparrow / TransformerLens. The first
sparrow repeat includes its compiles (one per hook name); the medians are the steady state.
"""

import functools
import os
import statistics
import tempfile
import time

from absl import app, flags

_LAYERS = flags.DEFINE_integer('layers', 12, 'Blocks of the random GPT-2.')
_D_MODEL = flags.DEFINE_integer('d_model', 768, 'Width.')
_HEADS = flags.DEFINE_integer('heads', 12, 'Attention heads.')
_LENGTH = flags.DEFINE_integer('length', 15, 'Prompt tokens (the IOI prompts are 15).')
_REPEATS = flags.DEFINE_integer('repeats', 3, 'Runs of each loop per library; medians shown.')


def _folder(root: str) -> str:
  import torch
  import transformers

  config = transformers.GPT2Config(
    vocab_size=1000, n_positions=64, n_embd=_D_MODEL.value, n_layer=_LAYERS.value,
    n_head=_HEADS.value, initializer_range=0.05,
  )  # fmt: skip
  torch.manual_seed(0)
  model = transformers.GPT2LMHeadModel(config).eval()
  with torch.no_grad():
    for p in model.parameters():
      p.add_(0.02 * torch.randn_like(p))
  folder = os.path.join(root, 'gpt2')
  model.save_pretrained(folder, safe_serialization=True)
  return folder


def _loops(run, cache, layers: int, heads: int, length: int, set_row, zero_head) -> dict:
  """{loop name: thunk} over one library's run(hooks) and clean cache."""

  def patch(resid, hook, pos, clean_cache):
    return set_row(resid, pos, clean_cache[hook.name])

  def patch_head(z, hook, head_index, clean_cache):
    return set_row(z, head_index, clean_cache[hook.name], axis=2)

  def resid():
    for layer in range(layers):
      for pos in range(length):
        hook = functools.partial(patch, pos=pos, clean_cache=cache)
        run([(f'blocks.{layer}.hook_resid_pre', hook)])

  def head():
    for layer in range(layers):
      for h in range(heads):
        hook = functools.partial(patch_head, head_index=h, clean_cache=cache)
        run([(f'blocks.{layer}.attn.hook_z', hook)])

  def ablate():
    for layer in range(layers):
      for h in range(heads):
        run([(f'blocks.{layer}.attn.hook_z', lambda z, hook: zero_head(z, h))])  # noqa: B023

  return {'resid': resid, 'head': head, 'ablate': ablate}


def main(_):
  os.environ['HF_HUB_OFFLINE'] = '1'
  import numpy as np
  import torch
  from transformer_lens.model_bridge import TransformerBridge

  import transformer

  folder = _folder(tempfile.mkdtemp(prefix='bench_hook_loops_'))
  layers, heads, length = _LAYERS.value, _HEADS.value, _LENGTH.value
  tokens = np.random.default_rng(0).integers(0, 1000, size=(1, length)).astype(np.int32)

  m = transformer.load(folder)
  _, ours_cache = m.run_with_cache(tokens)
  ours = _loops(
    lambda hooks: m.run_with_hooks(tokens, fwd_hooks=hooks),
    ours_cache, layers, heads, length,
    set_row=lambda x, i, clean, axis=1: x.at[(slice(None),) * axis + (i,)].set(
      clean[(slice(None),) * axis + (i,)]
    ),
    zero_head=lambda z, h: z.at[:, :, h].set(0.0),
  )  # fmt: skip

  bridge = TransformerBridge.boot_transformers(folder, device='cpu')
  bridge.enable_compatibility_mode(disable_warnings=True, no_processing=True)
  tl_tokens = torch.tensor(tokens, dtype=torch.long)
  with torch.no_grad():
    _, tl_cache = bridge.run_with_cache(tl_tokens)

  def tl_set(x, i, clean, axis=1):
    x[(slice(None),) * axis + (i,)] = clean[(slice(None),) * axis + (i,)]
    return x

  def tl_zero(z, h):
    z[:, :, h] = 0.0
    return z

  def tl_run(hooks):
    with torch.no_grad():
      bridge.run_with_hooks(tl_tokens, fwd_hooks=hooks)

  theirs = _loops(tl_run, tl_cache, layers, heads, length, tl_set, tl_zero)
  times = {name: ([], []) for name in ours}
  for _ in range(_REPEATS.value):
    for name in ours:
      for side, loops in enumerate((ours, theirs)):
        start = time.perf_counter()
        loops[name]()
        times[name][side].append(time.perf_counter() - start)
  calls = {'resid': layers * length, 'head': layers * heads, 'ablate': layers * heads}
  print(f'random GPT-2, {layers} layers, d_model {_D_MODEL.value}, {heads} heads, {length} tokens')
  print('| loop | calls | sparrow s (first) | TransformerLens s | ratio |')
  print('|---|---|---|---|---|')
  for name, (a, b) in times.items():
    ma, mb = statistics.median(a), statistics.median(b)
    print(f'| {name} | {calls[name]} | {ma:.2f} ({a[0]:.2f}) | {mb:.2f} | {ma / mb:.2f} |')


if __name__ == '__main__':
  app.run(main)
