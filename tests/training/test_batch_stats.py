"""model.norm='batchnorm' in training: the train step moves the running statistics (against a
float64 NumPy reference), evaluation uses them, checkpoints keep them, and packing is refused."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from transformer.config import ModelConfig
from transformer.config.experiment import Config
from transformer.model import models
from transformer.model.norms import BATCHNORM_MOMENTUM
from transformer.training import checkpoint, provenance, steps
from transformer.training.state import BatchNormTrainState, TrainState, create_state, weights

VOCAB, D = 40, 24
LENGTHS = (7, 4, 1)  # B=3 rows of T=7, each padded differently


def _cfg(family: str, **overrides) -> ModelConfig:
  # RoPE adds nothing to the embeddings and embedding_norm puts a norm right on them, so the
  # first norm's input is table[token] * sqrt(D): what the NumPy reference recomputes.
  base = dict(
    family=family, vocab_size=VOCAB, d_model=D, num_heads=2, d_ff=32, num_layers=1,
    max_length=16, dropout_rate=0.0, position='rope', embedding_norm=True, norm='batchnorm',
  )  # fmt: skip
  return ModelConfig(**{**base, **overrides})


def _rows(seed: int, lengths) -> np.ndarray:
  """Right-padded token rows [B, T] (0 = padding) of random ids >= 5."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(5, VOCAB, (len(lengths), 7)).astype(np.int32)
  return np.where(np.arange(7)[None] < np.array(lengths)[:, None], tokens, 0)


def _batch(family: str, seed: int, lengths=LENGTHS) -> dict:
  rows = _rows(seed, lengths)
  targets = _rows(seed + 100, lengths)
  batch = {'targets': targets, 'weights': (targets > 0).astype(np.float32)}
  if family == 'causal_lm':
    return {**batch, 'inputs': rows, 'segments': None, 'positions': None}
  source = _rows(seed + 200, lengths[::-1])  # the encoder's own padding
  return {
    **batch, 'inputs': source, 'decoder_inputs': rows, 'inputs_segments': None,
    'targets_segments': None, 'inputs_positions': None, 'targets_positions': None,
  }  # fmt: skip


def _embedding_stats(table: np.ndarray, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Float64 mean and biased variance of the scaled embeddings of the real tokens."""
  x = np.asarray(table, np.float64)[tokens[tokens > 0]] * np.sqrt(D)  # [N, D]
  return x.mean(axis=0), x.var(axis=0)


def _setup(family: str, grad_accum_steps: int = 1, **overrides):
  cfg = _cfg(family, **overrides)
  model, tx = models.build(cfg), optax.adam(1e-2)
  step = jax.jit(
    functools.partial(
      steps.train_step, model=model, family=family, tx=tx, schedule=optax.constant_schedule(1e-2),
      label_smoothing=0.0, grad_accum_steps=grad_accum_steps,
    )
  )  # fmt: skip
  return cfg, model, tx, step


# Where the embedding norm's statistics sit in each family's batch_stats.
EMBEDDING_NORMS = {
  'causal_lm': [('decoder', 'inputs')],
  'encoder_decoder': [('encoder', 'inputs'), ('decoder', 'decoder_inputs')],
}


@pytest.mark.parametrize('family', ['causal_lm', 'encoder_decoder'])
def test_train_steps_move_the_running_statistics_by_the_momentum(family):
  cfg, model, tx, step = _setup(family)
  state = create_state(model, cfg, tx, 0, 1.0)
  assert isinstance(state, BatchNormTrainState)
  m, rng = BATCHNORM_MOMENTUM, jax.random.PRNGKey(0)
  batches = [_batch(family, 0), _batch(family, 1, (2, 7, 5))]
  states = [state]
  for batch in batches:
    state, metrics = step(state, batch, rng)
    assert np.isfinite(metrics['loss']) and not metrics['skipped']
    states.append(state)
  # Every norm of the model moved its statistics, and the parameters moved.
  moved = jax.tree.map(lambda a, b: np.abs(a - b).max(), states[1].batch_stats,
                       states[0].batch_stats)  # fmt: skip
  assert min(jax.tree.leaves(moved)) > 0
  # Post-LN, one layer: embedding, self attention, (cross attention,) MLP norms; 2 stats each.
  assert len(jax.tree.leaves(moved)) == (6 if family == 'causal_lm' else 14)
  # The embedding norms against NumPy: running = m * running + (1 - m) * the batch's statistics
  # over its real tokens, whose embeddings come from the parameters before each step.
  for side, key in EMBEDDING_NORMS[family]:
    want_mean, want_var = np.zeros(D), np.ones(D)
    for before, after, batch in zip(states[:-1], states[1:], batches):
      table = before.params['embedding']['embedding']
      mean, var = _embedding_stats(table, batch[key])
      want_mean, want_var = m * want_mean + (1 - m) * mean, m * want_var + (1 - m) * var
      got = after.batch_stats[side]['embedder']['norm']
      np.testing.assert_allclose(got['mean'], want_mean, rtol=1e-5, atol=1e-6)
      np.testing.assert_allclose(got['var'], want_var, rtol=1e-5, atol=1e-6)


def test_a_non_finite_step_keeps_the_statistics_and_accumulation_updates_per_micro_batch():
  cfg, model, tx, step = _setup('causal_lm')
  state = create_state(model, cfg, tx, 0, 1.0)
  batch, rng = _batch('causal_lm', 0), jax.random.PRNGKey(0)
  kept, metrics = step(state.replace(loss_scale=jnp.float32(jnp.inf)), batch, rng)
  assert metrics['skipped']
  jax.tree.map(np.testing.assert_array_equal, kept.batch_stats, state.batch_stats)
  # Two micro-batches of two rows: two momentum updates, each over its own real tokens.
  _, _, _, accumulated = _setup('causal_lm', grad_accum_steps=2)
  four = _batch('causal_lm', 0, (7, 3, 5, 1))
  after, _ = accumulated(state, four, rng)
  table, m = state.params['embedding']['embedding'], BATCHNORM_MOMENTUM
  want_mean, want_var = np.zeros(D), np.ones(D)
  for rows in (slice(0, 2), slice(2, 4)):
    mean, var = _embedding_stats(table, four['inputs'][rows])
    want_mean, want_var = m * want_mean + (1 - m) * mean, m * want_var + (1 - m) * var
  got = after.batch_stats['decoder']['embedder']['norm']
  np.testing.assert_allclose(got['mean'], want_mean, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(got['var'], want_var, rtol=1e-5, atol=1e-6)


def test_evaluation_uses_the_running_statistics():
  cfg, model, tx, step = _setup('causal_lm')
  state, _ = step(
    create_state(model, cfg, tx, 0, 1.0), _batch('causal_lm', 0), jax.random.PRNGKey(0)
  )
  batch = _batch('causal_lm', 1)
  evaluate = functools.partial(steps.eval_step, model=model, family='causal_lm')
  whole = evaluate(weights(state), batch)
  # Each token is normalised by the running statistics alone: row by row sums to the same.
  rows = [evaluate(weights(state), {k: v if v is None else v[i : i + 1] for k, v in batch.items()})
          for i in range(len(LENGTHS))]  # fmt: skip
  for key in ('loss', 'correct', 'denominator'):
    np.testing.assert_allclose(sum(float(r[key]) for r in rows), whole[key], rtol=1e-5)
  with pytest.raises(ValueError, match=r"norm='batchnorm'.*batch_stats"):
    evaluate(state.params, batch)  # the parameters alone do not say how to normalise


def test_checkpoints_restore_the_statistics_exactly(tmp_path):
  cfg, model, tx, step = _setup('encoder_decoder')
  state, _ = step(create_state(model, cfg, tx, 0, 1.0), _batch('encoder_decoder', 0),
                  jax.random.PRNGKey(0))  # fmt: skip
  ckpt = checkpoint.Checkpointer(str(tmp_path))
  try:
    ckpt.save(1, state, {})
    abstract = jax.eval_shape(lambda: create_state(model, cfg, tx, 0, 1.0))
    restored, _, _ = ckpt.restore(abstract)
  finally:
    ckpt.close()
  assert isinstance(restored, BatchNormTrainState)
  jax.tree.map(np.testing.assert_array_equal, restored.batch_stats, state.batch_stats)
  jax.tree.map(np.testing.assert_array_equal, restored.params, state.params)


def test_other_norms_keep_the_plain_state_and_checkpoint(tmp_path):
  cfg = _cfg('causal_lm', norm='layernorm')
  model, tx = models.build(cfg), optax.adam(1e-2)
  state = create_state(model, cfg, tx, 0, 1.0)
  assert type(state) is TrainState and weights(state) is state.params
  ckpt = checkpoint.Checkpointer(str(tmp_path))
  try:
    ckpt.save(0, state, {})
  finally:
    ckpt.close()
  with open(os.path.join(tmp_path, 'checkpoints', '0', 'state', '_METADATA')) as f:
    assert 'batch_stats' not in f.read()


def test_a_run_trains_saves_and_loads_its_statistics(tmp_path, tiny_config):
  from transformer import load
  from transformer.training.run import Run

  config = tiny_config('causal_lm')
  config.model.norm, config.data.pack = 'batchnorm', False
  run = Run(config, str(tmp_path))
  assert run.state_shardings.batch_stats  # sharded like the parameters' features
  state, batch = run.init_state(), run.place(next(run.task.train_iterator()))
  assert (np.asarray(batch['inputs']) == 0).any()  # padded rows
  before = jax.device_get(state.batch_stats)
  state, _ = run.train_step(state, batch, run.replicate(jax.random.PRNGKey(0)))
  moved = jax.tree.map(lambda a, b: np.abs(a - b).max(), state.batch_stats, before)
  assert min(jax.tree.leaves(moved)) > 0
  run.task.tokenizer.save(os.path.join(tmp_path, 'tokenizer'))
  provenance.write_run_metadata(str(tmp_path), run.config)
  ckpt = checkpoint.Checkpointer(str(tmp_path))
  try:
    ckpt.save(1, state, {})
  finally:
    ckpt.close()
  loaded = load(str(tmp_path))
  jax.tree.map(np.testing.assert_array_equal, loaded.batch_stats, state.batch_stats)
  tokens = np.asarray(batch['inputs'])[:2]
  want = run.model.apply(weights(jax.device_get(state)), tokens)
  np.testing.assert_allclose(loaded.logits(tokens), want, rtol=1e-5, atol=1e-5)
  assert len(loaded.generate('the', max_new_tokens=3)) == 1


def test_batchnorm_with_packing_is_one_error(tiny_config, tmp_path):
  from transformer.training.run import Run

  config = tiny_config('causal_lm')  # gpt_tiny packs its rows
  config.model.norm = 'batchnorm'
  assert config.data.pack
  with pytest.raises(ValueError, match=r"data\.pack=True.*norm='batchnorm'"):
    Config.from_configdict(config)
  with pytest.raises(ValueError, match=r"data\.pack=True.*norm='batchnorm'"):
    Run(config, str(tmp_path))  # before any data work
  assert not os.listdir(tmp_path)
  config.data.pack = False
  Config.from_configdict(config)
