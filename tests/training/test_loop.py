"""The training loop: smoke runs per family, exact resume, accumulation, loss scaling, errors."""

import functools
import json
import logging
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow_datasets as tfds
from tensorboard.backend.event_processing import event_accumulator

from transformer.training.loop import train_and_evaluate
from transformer.training.run import Run
from transformer.training.steps import train_step


# Smoke runs: the same path as the CLI, for every family -----------------------------------------
# The encoder-decoder's run (about 40 s: it compiles beam search for BLEU) is slow; the fast suite
# trains, evaluates and translates with one in test_evaluate_cli_prints_json_metrics_and_...
@pytest.mark.parametrize(
  'family',
  [pytest.param('encoder_decoder', marks=pytest.mark.slow), 'causal_lm', 'bidirectional_lm'],
)
def test_each_family_trains_evaluates_and_checkpoints(family, tmp_path, tiny_config):
  result = train_and_evaluate(tiny_config(family), str(tmp_path))
  assert result['step'] == 4 and [h['step'] for h in result['train']] == [1, 2, 3, 4]
  assert all(np.isfinite(h['loss']) and h['loss'] > 0 for h in result['train'])
  assert np.isfinite(result['eval']['loss']) and result['eval']['perplexity'] > 1
  if family == 'encoder_decoder':
    assert 0 <= result['eval']['bleu'] <= 100 and 'exact_match' in result['eval']
  names = set(os.listdir(tmp_path))
  assert {'checkpoints', 'config.json', 'git_revision.txt', 'tensorboard', 'tokenizer'} <= names
  assert sorted(os.listdir(tmp_path / 'checkpoints')) == ['2', '4']
  # TensorBoard's own reader (what `tensorboard --logdir` runs) finds every logged step.
  events = event_accumulator.EventAccumulator(str(tmp_path / 'tensorboard'), {'tensors': 0})
  events.Reload()
  logged = [(e.step, e.tensor_proto.float_val[0]) for e in events.Tensors('train/loss')]
  assert logged == [(h['step'], pytest.approx(h['loss'])) for h in result['train']]
  (eval_loss,) = events.Tensors('eval/loss')
  assert eval_loss.step == 4 and eval_loss.tensor_proto.float_val == [
    pytest.approx(result['eval']['loss'])
  ]
  if family != 'bidirectional_lm':  # the masked LM decodes no samples
    assert events.SummaryMetadata('eval/samples').plugin_data.plugin_name == 'text'
    assert b'reference: ' in events.Tensors('eval/samples')[0].tensor_proto.string_val[0]


def test_event_files_are_written_without_tensorflow(tmp_path):
  # flax.metrics.tensorboard went through tf.summary: every run imported TensorFlow (~3 s).
  code = (
    'import sys; from transformer.training import events, loop; '
    f'w = events.SummaryWriter({str(tmp_path)!r}); w.scalar("a", 1.0, 1); w.text("b", "c", 1); '
    'import os; print(os.path.getsize(w.path)); '  # on disk before close: a killed run keeps them
    'w.close(); print(sorted(m for m in sys.modules if m.split(".")[0] == "tensorflow"))'
  )
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True)
  size_before_close, modules = out.stdout.strip().splitlines()
  assert modules == '[]'
  assert int(size_before_close) == os.path.getsize(next(tmp_path.iterdir()))
  assert [name.startswith('events.out.tfevents.') for name in os.listdir(tmp_path)] == [True]


def test_a_run_shorter_than_its_warmup_trains_with_one_warning(tmp_path, tiny_config, caplog):
  # gpt_tiny's schedule (warmup_cosine, 100 warmup steps, peak 3e-3) in a 1-step run: it once
  # stopped with 'total_steps=1 must exceed warmup_steps=100'.
  config = tiny_config('causal_lm', steps=1, checkpoint_every=1, eval_every=1)
  config.optim.schedule, config.optim.warmup_steps, config.optim.learning_rate = (
    'warmup_cosine',
    100,
    3e-3,
  )
  with caplog.at_level(logging.WARNING):
    result = train_and_evaluate(config, str(tmp_path))
  warnings = [r.getMessage() for r in caplog.records if 'warmup_steps=' in r.getMessage()]
  assert len(warnings) == 1 and 'warmup_steps=100' in warnings[0] and 'total_steps=1' in warnings[0]
  assert result['step'] == 1 and np.isfinite(result['eval']['loss'])
  (first,) = result['train']
  assert first['learning_rate'] == pytest.approx(3e-3)  # the one update is at the peak, not at 0
  assert np.isfinite(first['loss']) and first['grad_norm'] > 0


@pytest.mark.parametrize(
  'family,name', [('encoder_decoder', 'wmt14_translate/de-en'), ('causal_lm', 'lm1b')]
)
def test_tfds_mock_data_trains(family, name, tmp_path, tiny_config):
  config = tiny_config(family, task='tfds', steps=2, checkpoint_every=2, eval_every=2)
  config.data.tfds_name = name
  config.data.tfds_data_dir = str(tmp_path / 'tfds')
  with tfds.testing.mock_data(num_examples=16):
    result = train_and_evaluate(config, str(tmp_path / 'run'))
  assert result['step'] == 2 and np.isfinite(result['eval']['loss'])


def test_evaluate_cli_prints_json_metrics_and_translates_a_file(tmp_path, tiny_config):
  workdir = tmp_path / 'run'
  train_and_evaluate(tiny_config('encoder_decoder', steps=2), str(workdir))
  evaluate = [sys.executable, '-m', 'experiments.evaluate', f'--workdir={workdir}']
  out = subprocess.run(evaluate + ['--json'], capture_output=True, text=True, check=True).stdout
  metrics = json.loads(out.strip().splitlines()[-1])
  assert metrics['step'] == 2
  assert {'loss', 'perplexity', 'accuracy', 'bleu', 'exact_match'} <= set(metrics)
  sources = tmp_path / 'sources.txt'
  sources.write_text('12\n345\n6789\n')
  translations = tmp_path / 'out.txt'
  subprocess.run(evaluate + [f'--input={sources}', f'--output={translations}'], check=True)
  assert len(translations.read_text().splitlines()) == 3  # one (untrained) translation per line


# Resumption ---------------------------------------------------------------------------------------
def test_resumed_run_logs_the_same_losses(tmp_path, tiny_config):
  config = tiny_config('causal_lm', steps=6, checkpoint_every=3, eval_every=100)
  config.model.dropout_rate = 0.1  # the dropout RNG stream must continue too
  config.optim.warmup_steps = 2  # within the first 3 steps: a longer one would be cut to that run
  straight = train_and_evaluate(config, str(tmp_path / 'straight'))['train']
  config.train.steps = 3
  first = train_and_evaluate(config, str(tmp_path / 'resumed'))['train']
  config.train.steps = 6
  second = train_and_evaluate(config, str(tmp_path / 'resumed'))['train']
  assert [h['step'] for h in second] == [4, 5, 6]
  resumed = first + second
  for a, b in zip(straight, resumed):
    assert a['step'] == b['step']
    np.testing.assert_allclose(a['loss'], b['loss'], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(a['grad_norm'], b['grad_norm'], rtol=1e-6, atol=1e-6)


# The pure train step ---------------------------------------------------------------------
def _run_and_batch(config, tmp_path):
  run = Run(config, str(tmp_path))
  return run, next(run.task.train_iterator())


def _step_fn(run, accum, dynamic_scale=False, loss_scale_period=2000):
  return jax.jit(
    functools.partial(
      train_step,
      model=run.model,
      family=run.family,
      tx=run.tx,
      schedule=run.schedule,
      label_smoothing=0.1,
      grad_accum_steps=accum,
      dynamic_scale=dynamic_scale,
      loss_scale_period=loss_scale_period,
    )
  )


def test_gradient_accumulation_equals_one_big_batch(tmp_path, tiny_config):
  config = tiny_config('encoder_decoder')
  config.model.dropout_rate = 0.0
  config.optim.warmup_steps = 1  # a large first step, so differences would show
  # Adam's first step is lr * sign(g) for eps << |g|: float rounding would flip the sign of
  # near-zero gradients. A large eps makes the update proportional to the gradient instead.
  config.optim.eps = 1.0
  run, batch = _run_and_batch(config, tmp_path)
  rng = jax.random.PRNGKey(0)
  state = run.init_state()
  big, big_metrics = _step_fn(run, 1)(state, batch, rng=rng)
  accumulated, acc_metrics = _step_fn(run, 4)(run.init_state(), batch, rng=rng)
  np.testing.assert_allclose(acc_metrics['loss'], big_metrics['loss'], rtol=1e-6)
  np.testing.assert_allclose(acc_metrics['grad_norm'], big_metrics['grad_norm'], rtol=1e-5)
  moved = jax.tree_util.tree_map(lambda a, b: np.abs(a - b).max(), big.params, state.params)
  assert max(jax.tree_util.tree_leaves(moved)) > 1e-4  # the step did change the parameters
  jax.tree_util.tree_map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
    accumulated.params,
    big.params,
  )


def test_float16_loss_scale_skips_non_finite_steps(tmp_path, tiny_config):
  config = tiny_config('causal_lm')
  config.model.dtype = 'float16'
  run, batch = _run_and_batch(config, tmp_path)
  step = _step_fn(run, 1, dynamic_scale=True, loss_scale_period=2)
  rng = jax.random.PRNGKey(0)
  state = run.init_state()
  assert float(state.loss_scale) == config.train.loss_scale
  assert all(p.dtype == jnp.float32 for p in jax.tree_util.tree_leaves(state.params))

  # Inject an inf: the step is skipped and the scale halves.
  poisoned = state.params['embedding']['embedding'].at[5, 0].set(jnp.inf)
  params = {**state.params, 'embedding': {'embedding': poisoned}}
  bad = state.replace(params=params)
  kept = jax.tree_util.tree_map(np.asarray, bad.params)
  after, metrics = step(bad, batch, rng=rng)
  assert float(metrics['skipped']) == 1.0
  assert float(after.loss_scale) == config.train.loss_scale / 2
  assert int(after.good_steps) == 0 and int(after.step) == 1
  jax.tree_util.tree_map(np.testing.assert_array_equal, after.params, kept)

  # Finite steps update the parameters; after loss_scale_period=2 of them the scale doubles.
  good = run.init_state()
  one, metrics = step(good, batch, rng=rng)
  assert float(metrics['skipped']) == 0.0 and int(one.good_steps) == 1
  assert float(one.loss_scale) == config.train.loss_scale
  two, _ = step(one, batch, rng=rng)
  assert float(two.loss_scale) == 2 * config.train.loss_scale and int(two.good_steps) == 0


# Bad input: one clear error, nothing in the workdir lost -----------------------------------------
def _snapshot(path):
  return {
    os.path.join(root, f): os.path.getmtime(os.path.join(root, f))
    for root, _, files in os.walk(path)
    for f in files
  }


@pytest.mark.parametrize(
  'change,message',
  [
    (lambda c: c.model.update(num_heads=3), 'num_heads=3 does not divide d_model=32'),
    (lambda c: c.data.update(task='text', train_path='/nonexistent/train.txt'), 'nonexistent'),
    (lambda c: c.data.update(task='tfds', tfds_name='no_such_dataset_xyz'), 'no_such_dataset_xyz'),
    (lambda c: c.train.update(grad_accum_steps=3), 'grad_accum_steps=3'),
  ],
)
def test_bad_config_raises_a_clear_error_before_writing(change, message, tmp_path, tiny_config):
  config = tiny_config('causal_lm')
  change(config)
  with pytest.raises((ValueError, FileNotFoundError), match=message):
    train_and_evaluate(config, str(tmp_path / 'run'))
  assert not os.path.exists(tmp_path / 'run' / 'checkpoints' / '2')


def test_empty_dataset_is_a_clear_error(tmp_path, tiny_config):
  empty = tmp_path / 'empty.txt'
  empty.write_text('\n\n')
  config = tiny_config('causal_lm', task='text')
  config.data.train_path = str(empty)
  with pytest.raises(ValueError, match='empty.txt'):
    train_and_evaluate(config, str(tmp_path / 'run'))


def test_unwritable_workdir_is_a_clear_error(tmp_path, tiny_config):
  blocker = tmp_path / 'file'
  blocker.write_text('not a directory')
  with pytest.raises(ValueError, match='not writable'):
    train_and_evaluate(tiny_config('causal_lm'), str(blocker / 'run'))
  assert blocker.read_text() == 'not a directory'


def test_mismatched_config_refuses_to_resume_and_keeps_the_workdir(tmp_path, tiny_config):
  config = tiny_config('causal_lm', steps=2)
  train_and_evaluate(config, str(tmp_path))
  before = _snapshot(tmp_path)
  config.model.d_model = 64
  with pytest.raises(ValueError, match='model.d_model is 32 there and 64 here'):
    train_and_evaluate(config, str(tmp_path))
  assert _snapshot(tmp_path) == before


def test_a_workdir_from_before_a_new_knob_resumes(tmp_path, tiny_config):
  config = tiny_config('causal_lm', steps=2, checkpoint_every=2, eval_every=100)
  train_and_evaluate(config, str(tmp_path))
  path = tmp_path / 'config.json'
  saved = json.loads(path.read_text())
  del saved['model']['short_conv']  # as an older sparrow, without this knob, wrote it
  path.write_text(json.dumps(saved))
  config.train.steps = 4
  history = train_and_evaluate(config, str(tmp_path))['train']
  assert [h['step'] for h in history] == [3, 4]  # resumed from step 2, not restarted


def test_cli_errors_are_one_line(tmp_path):
  cases = [
    ['--config.model.nmu_heads=3'],
    ['--config.data.task=text', '--config.data.train_path=/nonexistent/file.txt'],
  ]
  for flags in cases:
    proc = subprocess.run(
      [sys.executable, '-m', 'experiments.train', f'--workdir={tmp_path / "w"}', *flags],
      capture_output=True,
      text=True,
    )
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith('error: '), proc.stderr
    assert 'nmu_heads' in lines[0] or '/nonexistent/file.txt' in lines[0]


_HUGE_PAGES_OF_A_BLOCK = """
import ctypes, os
from experiments import cli

def main():  # a 64 MiB malloc block, as XLA:CPU's scratch buffers are: kB of it on huge pages
  libc = ctypes.CDLL(None)
  libc.malloc.restype = ctypes.c_void_p
  block = libc.malloc(64 << 20)
  ctypes.memset(block, 1, 64 << 20)
  huge, inside = 0, False
  for line in open('/proc/self/smaps').read().splitlines():
    head = line.split()[0]
    if '-' in head and not head.endswith(':'):  # a mapping: start-end perms ...
      start, end = (int(x, 16) for x in head.split('-'))
      inside = start <= block < end
    elif inside and head == 'AnonHugePages:':
      huge = int(line.split()[1])
  print(os.environ.get('GLIBC_TUNABLES'), huge)

cli.run(main)
"""


def test_commands_start_again_with_huge_pages_where_the_kernel_has_them_on_request():
  def run(tunables=None):
    env = {k: v for k, v in os.environ.items() if k != 'GLIBC_TUNABLES'}
    env.update({'GLIBC_TUNABLES': tunables} if tunables else {})
    out = subprocess.run(
      [sys.executable, '-c', _HUGE_PAGES_OF_A_BLOCK], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    value, huge_kb = out.stdout.split()
    return value, int(huge_kb)

  # The user's own choice stands (no exec): the block is on 4 KiB pages, so the check can fail.
  assert run('glibc.malloc.hugetlb=0') == ('glibc.malloc.hugetlb=0', 0)
  try:
    on_request = '[madvise]' in open('/sys/kernel/mm/transparent_hugepage/enabled').read()
  except OSError:
    on_request = False
  if not on_request:  # [always] or [never]: nothing to ask for, so no exec
    assert run()[0] == 'None'
    return
  value, huge_kb = run()
  assert value == 'glibc.malloc.hugetlb=1' and huge_kb >= 2048  # one huge page at least
  value, huge_kb = run('glibc.malloc.arena_max=2')  # other tunables are kept
  assert value == 'glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1' and huge_kb >= 2048


@pytest.mark.parametrize('family', ['encoder_decoder', 'bidirectional_lm'])
def test_train_step_compiles_once(family, tmp_path, tiny_config):
  run, _ = _run_and_batch(tiny_config(family), tmp_path)
  state, iterator = run.init_state(), run.task.train_iterator()
  for _ in range(4):
    state, _ = run.train_step(state, run.place(next(iterator)), jax.random.PRNGKey(0))
  assert run.train_step._cache_size() == 1


def test_score_counts_tokens_and_matches_numpy(tmp_path, tiny_config):
  run, _ = _run_and_batch(tiny_config('causal_lm'), tmp_path)
  params = run.init_state().params
  texts = ['hello world', 'a', 'a longer line of text to score']
  scores = run.score(params, texts)
  assert [count for _, count in scores] == [len(run.task.tokenizer.encode(t)) + 1 for t in texts]
  # Independent check: the model's log-softmax at each target, summed in NumPy.
  for text, (total, _) in zip(texts, scores):
    ids = run.task.tokenizer.encode(text)
    inputs = np.asarray([[1] + ids], np.int32)
    logits = np.asarray(run.model.apply({'params': params}, inputs), np.float64)[0]
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))  # [T, V]
    expected = -sum(log_probs[i, t] for i, t in enumerate(ids + [2]))
    np.testing.assert_allclose(total, expected, rtol=1e-4)
