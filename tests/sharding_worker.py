"""Runs in a subprocess with 8 fake CPU devices (tests/test_sharding.py starts it).

Trains each family 3 steps on several meshes and on one device, checks shardings, saves and
restores across mesh shapes, and writes everything the test asserts on to a JSON file.
Usage: python tests/sharding_worker.py OUT_DIR [default|rules|dropout|full]
"""

import json
import os
import sys

import xla_flags

# The suite's fast-compile flags (tests/xla_flags.py); every run here shares them.
os.environ['XLA_FLAGS'] = f'--xla_force_host_platform_device_count=8 {xla_flags.fast_compile()}'
os.environ['JAX_PLATFORMS'] = 'cpu'

import jax  # noqa: E402
import numpy as np  # noqa: E402

from transformer.config import experiment
from transformer.training import checkpoint, provenance
from transformer.training.run import Run

MESHES = [(8, 1, 1), (1, 8, 1), (2, 2, 2), (1, 2, 4)]
FAMILIES = ['causal_lm', 'encoder_decoder', 'bidirectional_lm']
# The fast suite's dropout cases: tensor parallelism (where the rules bite) and FSDP, about 10 s
# each; the 'rules' half adds every family with dropout off on (2, 2, 2). The full matrix (every
# family on every mesh, dropout on and off) is the slow 'full'.
FAST = {
  'causal_lm': [(1, 2, 4)],
  'encoder_decoder': [(1, 8, 1)],
}


def bytes_per_device(tree) -> int:
  """Bytes that one device holds of a pytree of jax Arrays (its addressable shard of each)."""
  total = 0
  for leaf in jax.tree_util.tree_leaves(tree):
    shard = leaf.addressable_shards[0]
    total += shard.data.size * shard.data.dtype.itemsize
  return total


def tiny_config(family: str, dropout: float, mesh=(1, 1, 1)):
  config = experiment.default_configdict()  # configs/base.py's defaults, without the clone's path
  config.model.family = family
  m = config.model
  m.d_model, m.num_heads, m.d_ff, m.num_layers = 32, 4, 64, 1  # one layer: fast compiles
  m.dropout_rate = dropout
  m.attention_dropout_rate = dropout
  m.norm_placement = 'pre'
  m.position = {'causal_lm': 'learned', 'bidirectional_lm': 'rope'}.get(family, 'sinusoidal')
  if family == 'bidirectional_lm':
    m.type_vocab_size, m.embedding_norm = 2, True
  d = config.data
  d.num_train_examples, d.num_eval_examples = 64, 16
  d.batch_size = d.eval_batch_size = 8
  d.max_source_length = d.max_target_length = d.max_length = 24
  d.vocab_multiple = 8  # 261 byte ids -> 264, which the tensor axis (up to 4) divides
  d.task = 'numbers'
  # Adam with eps=1e-9 maps gradients that are analytically zero but carry rounding noise (the key
  # bias: softmax ignores a per-query constant) to full +-lr steps whose sign the summation order
  # decides. eps=1 makes every update proportional to its gradient, so the comparison is fair.
  o = config.optim
  o.schedule, o.learning_rate, o.warmup_steps, o.eps = 'constant', 0.5, 0, 1.0
  config.mesh.shape = mesh
  return config


def relative_error(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def train_three_steps(config, devices=None, initial=None):
  """Losses of 3 steps; the state starts from `initial` (host arrays) or the Run's own init."""
  run = Run(config, None, devices)
  state = run.init_state() if initial is None else jax.device_put(initial, run.state_shardings)
  start = jax.device_get(state.params)
  iterator = run.task.train_iterator()
  rng = run.replicate(jax.random.PRNGKey(7))
  losses = []
  for _ in range(3):
    state, metrics = run.train_step(state, run.place(next(iterator)), rng)
    losses.append(float(metrics['loss']) / float(metrics['denominator']))
  return run, state, losses, start


def _flat(leaves) -> np.ndarray:
  return np.concatenate([np.ravel(x) for x in leaves])


def equality(results: dict, dropout: float, meshes) -> None:
  """Loss and parameters after 3 steps on each mesh against one device, from the same init.

  `meshes`: a list for every family, or a dict of the families to run to their lists.

  (The sharded init itself is compared with the single-device one in `shardings`.)
  """
  one = jax.devices()[:1]
  for family in meshes if isinstance(meshes, dict) else FAMILIES:
    ref_run = Run(tiny_config(family, dropout), None, one)
    initial = jax.device_get(ref_run.init_state())
    _, ref_state, ref_losses, ref_start = train_three_steps(
      tiny_config(family, dropout), one, initial
    )
    ref_params = jax.tree_util.tree_leaves(jax.device_get(ref_state.params))
    ref_update = [a - b for a, b in zip(ref_params, jax.tree_util.tree_leaves(ref_start))]
    for mesh in meshes[family] if isinstance(meshes, dict) else meshes:
      _, state, losses, start = train_three_steps(tiny_config(family, dropout, mesh), None, initial)
      params = jax.tree_util.tree_leaves(jax.device_get(state.params))
      update = [a - b for a, b in zip(params, jax.tree_util.tree_leaves(start))]
      results['equality'].append(
        {
          'family': family,
          'dropout': dropout,
          'mesh': mesh,
          'loss_error': relative_error(losses, ref_losses),
          'param_error': relative_error(_flat(params), _flat(ref_params)),
          # What the 3 steps changed, relative to the largest change of any parameter.
          'update_error': relative_error(_flat(update), _flat(ref_update)),
          'losses': losses,
          'ref_losses': ref_losses,
        }
      )


def shardings(results: dict) -> None:
  """Shardings of each kind of weight, the bytes one device holds, and the sharded init."""
  one = Run(tiny_config('causal_lm', 0.0), None, jax.devices()[:1])
  reference = jax.tree_util.tree_leaves(jax.device_get(one.init_state().params))
  for mesh in [(1, 2, 4), (1, 8, 1), (8, 1, 1)]:
    run = Run(tiny_config('causal_lm', 0.0, mesh), None)
    state = run.init_state()
    p, mu = state.params, state.opt_state
    initial = jax.tree_util.tree_leaves(jax.device_get(p))
    results['init'][str(mesh)] = relative_error(_flat(initial), _flat(reference))
    layer = p['decoder']['stack']['layer_0']
    adam = [s for s in jax.tree_util.tree_leaves(mu, is_leaf=lambda x: hasattr(x, 'mu'))]
    adam = [s for s in adam if hasattr(s, 'mu')][0]
    spec = lambda x: [list(a) if isinstance(a, tuple) else a for a in x.sharding.spec]
    results['specs'][str(mesh)] = {
      'embedding': spec(p['embedding']['embedding']),
      'query': spec(layer['self_attention']['query']['kernel']),
      'query_bias': spec(layer['self_attention']['query']['bias']),
      'out': spec(layer['self_attention']['out']['kernel']),
      'wi': spec(layer['mlp']['wi']['kernel']),
      'wo': spec(layer['mlp']['wo']['kernel']),
      'norm': spec(layer['mlp_norm']['scale']),
      'positions': spec(p['decoder']['embedder']['positions']['positions']['embedding']),
      'adam_mu_query': spec(
        adam.mu['decoder']['stack']['layer_0']['self_attention']['query']['kernel']
      ),
      'step': spec(state.step),
    }
    total = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(p))
    results['bytes'][str(mesh)] = {
      'total': total,
      'per_device': bytes_per_device(p),
      'opt_per_device': bytes_per_device(state.opt_state),
      'opt_total': sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(mu)),
    }


def checkpoints(results: dict, out_dir: str) -> None:
  """Save on (2, 2, 2); restore on (8, 1, 1) here, and on 1 device in the test's process."""
  workdir = os.path.join(out_dir, 'run')
  config = tiny_config('causal_lm', 0.0, (2, 2, 2))
  run, state, _, _ = train_three_steps(config)
  provenance.write_run_metadata(workdir, config)
  ckpt = checkpoint.Checkpointer(workdir)
  ckpt.save(3, state, run.task.train_iterator().get_state())
  ckpt.close()
  tokens = np.random.default_rng(0).integers(5, 200, size=(4, 16)).astype(np.int32)
  np.save(os.path.join(out_dir, 'tokens.npy'), tokens)
  # Logits from host copies of the parameters, so both are computed the same way on one device.
  apply = lambda params: np.asarray(run.model.apply({'params': jax.device_get(params)}, tokens))
  flat = {
    jax.tree_util.keystr(k): v
    for k, v in jax.tree_util.tree_flatten_with_path(jax.device_get(state.params))[0]
  }
  np.savez(os.path.join(out_dir, 'params.npz'), **flat)
  results['logits']['saved'] = apply(state.params).tolist()
  other = Run(tiny_config('causal_lm', 0.0, (8, 1, 1)), None)
  ckpt = checkpoint.Checkpointer(workdir)
  restored, _, _ = ckpt.restore(other.abstract_state)
  ckpt.close()
  results['logits']['restored_8_1_1'] = apply(restored.params).tolist()
  results['restored_sharding'] = str(restored.params['embedding']['embedding'].sharding.spec)
  results['restored_equal'] = all(
    np.array_equal(a, b)
    for a, b in zip(
      jax.tree_util.tree_leaves(jax.device_get(restored.params)),
      jax.tree_util.tree_leaves(jax.device_get(state.params)),
    )
  )


def errors(results: dict) -> None:
  """Bad meshes and rules: the errors as the user sees them."""
  for name, mesh, change in [
    ('mesh_count', (2, 2, 1), None),
    ('not_divisible', (1, 1, 8), None),  # 4 heads over tensor=8
    ('unknown_axis', (8, 1, 1), lambda c: c.mesh.rules.update(hidden='tensor')),
    ('batch', (8, 1, 1), lambda c: c.data.update(batch_size=12)),
  ]:
    config = tiny_config('causal_lm', 0.0, mesh)
    if change is not None:
      with config.unlocked():
        change(config)
    try:
      Run(config, None)
      results['errors'][name] = None
    except ValueError as error:
      results['errors'][name] = str(error)


def main(out_dir: str, mode: str) -> None:
  assert jax.device_count() == 8, jax.devices()
  results = {'equality': [], 'specs': {}, 'bytes': {}, 'errors': {}, 'logits': {}, 'init': {}}
  if mode == 'full':  # slow: every family on every mesh, dropout on and off
    equality(results, 0.1, MESHES)
    equality(results, 0.0, MESHES)
  if mode in ('default', 'rules'):
    shardings(results)
    errors(results)
    checkpoints(results, out_dir)
    equality(results, 0.0, [(2, 2, 2)])
  if mode in ('default', 'dropout'):  # 'rules' + 'dropout' = 'default', in two processes
    equality(results, 0.1, FAST)
  with open(os.path.join(out_dir, 'results.json'), 'w') as f:
    json.dump(results, f)


if __name__ == '__main__':
  main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else 'default')
