"""Faults in a run: SIGTERM/SIGINT (preemption), non-finite steps, loss spikes, out of memory.

The kill tests run `python -m experiments.train` in subprocesses and compare their losses, read
from workdir/metrics.jsonl, with an uninterrupted run. Every test shares the suite's persistent
compilation cache (tests/conftest.py), so each run after the first compiles from it in about a
second.
"""

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import gpt_tiny
from transformer.data import batching
from transformer.training import faults, loop
from transformer.training.faults import NonFiniteError, OutOfMemoryError, Preempted
from transformer.training.loop import _write_scalars, train_and_evaluate
from transformer.training.run import Run
from transformer.training.workdir import load_run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 120  # of the kill tests' runs: a few seconds on a CPU, so a signal lands mid-run
# The kill tests' config, as overrides of configs/gpt_tiny.py: the same on the command line and
# in this process (the uninterrupted reference).
OVERRIDES = {
  'model.d_model': 32,
  'model.num_heads': 2,
  'model.d_ff': 64,
  'model.num_layers': 1,
  'data.tokenizer': 'byte',
  'data.batch_size': 8,
  'data.eval_batch_size': 8,
  'data.num_train_examples': 200,
  'data.num_eval_examples': 16,
  'data.max_length': 32,
  'train.steps': STEPS,
  'train.log_every': 1,
  'train.eval_every': 1000,
  'train.checkpoint_every': 50,
  'train.eval_decode_examples': 0,
  'optim.schedule': 'rsqrt',
  'optim.warmup_steps': 10,
}


@pytest.fixture(scope='module')
def compile_cache():
  """The environment of this module's subprocesses. They share the suite's persistent compilation
  cache (tests/conftest.py sets it in os.environ), so each run after the first compiles from it."""
  return dict(os.environ, JAX_PLATFORMS='cpu', TF_CPP_MIN_LOG_LEVEL='2')


def kill_config(**train_overrides):
  config = gpt_tiny.get_config()
  config.update_from_flattened_dict(OVERRIDES)
  config.train.update(train_overrides)
  return config


def small_config(**train_overrides):
  """kill_config with few steps, a checkpoint every 2."""
  config = kill_config(steps=8, checkpoint_every=2, keep_checkpoints=10)
  config.train.update(train_overrides)
  return config


@pytest.fixture(scope='module')
def reference(compile_cache, tmp_path_factory):
  """step -> loss of an uninterrupted run of kill_config()."""
  workdir = tmp_path_factory.mktemp('reference')
  history = train_and_evaluate(kill_config(), str(workdir))['train']
  return {h['step']: h['loss'] for h in history}


def read_metrics(workdir, kind='train'):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [entry for entry in map(json.loads, f) if entry['kind'] == kind]


def saved_steps(workdir):
  return sorted(
    int(name) for name in os.listdir(os.path.join(workdir, 'checkpoints')) if name.isdigit()
  )


def assert_same_losses(workdir, reference):
  """metrics.jsonl holds every step once, in order, each loss within 1e-6 of the reference."""
  logged = read_metrics(workdir)
  assert [e['step'] for e in logged] == list(range(1, STEPS + 1))
  for entry in logged:
    np.testing.assert_allclose(entry['loss'], reference[entry['step']], rtol=1e-6, atol=1e-6)


# Injections: test-only, through monkeypatch ------------------------------------------------------
def poison_batches(monkeypatch, calls, how='nan'):
  """Training batch number `calls` (1-based, per run) gets NaN weights, or is dropped ('drop')."""
  original = batching.TrainIterator.__next__
  counter = {'n': 0}

  def patched(self):
    counter['n'] += 1
    if how == 'drop' and counter['n'] in calls:
      original(self)
    batch = original(self)
    if how == 'nan' and counter['n'] in calls:
      batch = {**batch, 'weights': np.full_like(batch['weights'], np.nan)}
    return batch

  monkeypatch.setattr(batching.TrainIterator, '__next__', patched)


def wrap_train_step(monkeypatch, wrapper):
  """Every Run's jitted train_step becomes wrapper(train_step)."""
  original = Run.__init__

  def init(self, *args, **kwargs):
    original(self, *args, **kwargs)
    self.train_step = wrapper(self.train_step)

  monkeypatch.setattr(Run, '__init__', init)


# Preemption: a real process killed with SIGTERM ------------------------------------------------
def _launch(workdir, env, log, flags=(), overrides=OVERRIDES):
  command = [sys.executable, '-m', 'experiments.train', '--config=configs/gpt_tiny.py', *flags]
  command += [f'--workdir={workdir}'] + [f'--config.{k}={v}' for k, v in overrides.items()]
  out = open(f'{log}.out', 'w')
  err = open(f'{log}.err', 'w')
  proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=err, text=True)
  out.close()
  err.close()
  return proc


def _wait_for_step(proc, log, step, timeout=120.0):
  """Waits until the process has printed progress for `step` or later."""
  deadline = time.time() + timeout
  while time.time() < deadline:
    with open(f'{log}.out') as f:
      done = [int(n) for n in re.findall(r'step (\d+)/', f.read())]
    if done and max(done) >= step:
      return
    assert proc.poll() is None, f'exited with {proc.returncode}: {open(f"{log}.err").read()}'
    time.sleep(0.02)
  proc.kill()
  raise AssertionError(f'no progress for step {step} within {timeout} s')


def _finish(proc, log, timeout=120.0):
  """(return code, stderr) of a process that must end within `timeout` seconds."""
  try:
    proc.wait(timeout=timeout)
  except subprocess.TimeoutExpired:
    proc.kill()
    raise
  return proc.returncode, open(f'{log}.err').read()


@pytest.mark.slow  # three training processes; the signal and rollback tests below stay fast
def test_killed_twice_the_same_command_resumes_exactly(compile_cache, reference, tmp_path):
  """SIGTERM at a random step: a checkpoint, exit status 75 and one line. The same command
  resumes, and a second SIGTERM while its checkpoint is written (its temp dir exists) stops it at
  once. The run then finishes (in this process, to save a start-up) with the losses of an
  uninterrupted one."""
  workdir, at = tmp_path / 'run', random.randint(5, 40)
  proc = _launch(workdir, compile_cache, tmp_path / 'first')
  _wait_for_step(proc, tmp_path / 'first', at)
  proc.send_signal(signal.SIGTERM)
  sent = time.time()
  code, err = _finish(proc, tmp_path / 'first', timeout=30)
  assert time.time() - sent < 30
  assert code == faults.EXIT_PREEMPTED, (at, err)
  message = [line for line in err.splitlines() if line.startswith('preempted:')]
  assert len(message) == 1 and 'Traceback' not in err, err
  stopped = int(re.search(r'SIGTERM: saved checkpoint (\d+) ', message[0]).group(1))
  assert at <= stopped < STEPS and 'rerun the same command to resume' in message[0], message
  assert stopped in saved_steps(workdir)

  proc = _launch(workdir, compile_cache, tmp_path / 'second')
  _wait_for_step(proc, tmp_path / 'second', stopped + random.randint(5, 30))
  assert f'resumed from step {stopped}' in open(tmp_path / 'second.out').read()
  proc.send_signal(signal.SIGTERM)
  directory = workdir / 'checkpoints'
  while proc.poll() is None and not any('tmp' in name for name in os.listdir(directory)):
    time.sleep(0.001)
  if proc.poll() is None:
    proc.send_signal(signal.SIGTERM)
  code, err = _finish(proc, tmp_path / 'second', timeout=30)
  # Stopped at once by the second signal, or (rarely) done saving before it came.
  assert code in (-signal.SIGTERM, faults.EXIT_PREEMPTED), err
  if code == -signal.SIGTERM:
    assert 'second SIGTERM: stopping at once' in err

  train_and_evaluate(kill_config(), str(workdir))
  names = os.listdir(directory)
  assert all(name.isdigit() for name in names), names  # no temp dir left, nothing quarantined
  assert_same_losses(workdir, reference)  # metrics.jsonl also lost the steps after a checkpoint


def _free_port():
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _launch_pair(workdir, env, logs, overrides=OVERRIDES):
  """The 2 processes of one `experiments.train` run (jax.distributed + gloo, 1 device each)."""
  port = _free_port()
  env = dict(env, XLA_FLAGS='--xla_force_host_platform_device_count=1')
  flags = [f'--coordinator_address=127.0.0.1:{port}', '--num_processes=2']
  return [
    _launch(workdir, env, log, [*flags, f'--process_id={i}'], overrides)
    for i, log in enumerate(logs)
  ]


def _end_all(procs):
  for proc in procs:
    if proc.poll() is None:
      proc.kill()
      proc.wait()


@pytest.mark.slow
def test_a_lost_process_ends_the_others_cleanly_and_the_pair_resumes(compile_cache, tmp_path):
  """2 processes of `experiments.train`, a checkpoint every 50 steps, and 4 runs of the pair:
  1. SIGTERM to process 1 only: both save the same step and exit with 75.
  2. SIGKILL to process 1 mid-run: process 0 ends by itself within 60 s, with status 75 and one
     line that names process 1 and the last checkpoint (gloo's error, caught in the loop).
  3. SIGKILL to process 0, the coordinator: the same for process 1 (the coordination service
     aborts it at once; its supervisor turns that into the line).
  4. The pair resumes and finishes: its losses equal those of an uninterrupted pair (run beside
     the first), step by step within 1e-6, and no half-written checkpoint is ever listed.
  """
  workdir, logs = (
    tmp_path / 'run',
    [[tmp_path / f'run{r}_process{i}' for i in range(2)] for r in range(4)],
  )
  reference = _launch_pair(
    tmp_path / 'reference', compile_cache, [tmp_path / f'ref{i}' for i in range(2)]
  )
  procs = _launch_pair(workdir, compile_cache, logs[0])
  try:
    _wait_for_step(procs[1], logs[0][1], random.randint(5, 40), timeout=300)
    procs[1].send_signal(signal.SIGTERM)
    results = [_finish(proc, log, timeout=60) for proc, log in zip(procs, logs[0])]
    steps = []
    for (code, err), expected in zip(results, ['another process got a stop signal', 'SIGTERM']):
      assert code == faults.EXIT_PREEMPTED, err
      steps.append(int(re.search(rf'preempted: {expected}: saved checkpoint (\d+) ', err).group(1)))
    assert steps[0] == steps[1] and saved_steps(workdir) == [steps[0]]
    stopped = steps[0]
    for run, victim in [(1, 1), (2, 0)]:
      procs = _launch_pair(workdir, compile_cache, logs[run])
      survivor = 1 - victim
      _wait_for_step(
        procs[survivor], logs[run][survivor], stopped + random.randint(5, 30), timeout=300
      )
      assert f'resumed from step {stopped}' in open(f'{logs[run][0]}.out').read()
      procs[victim].kill()
      killed = time.time()
      code, err = _finish(procs[survivor], logs[run][survivor], timeout=90)
      took = time.time() - killed
      print(f'process {survivor} ended {took:.1f} s after process {victim} was killed')
      assert code == faults.EXIT_PREEMPTED and took < 60, (took, err)
      lines = [line for line in err.splitlines() if line.startswith('lost peer: ')]
      assert len(lines) == 1, err
      for dump in ['Traceback', 'Fatal Python error', 'Check failure', 'terminate called']:
        assert dump not in err, err
      assert lines[0].startswith(f'lost peer: process {victim} '), lines
      assert lines[0].endswith('; rerun the same command on every host to resume'), lines
      listed = saved_steps(workdir)
      assert f'the last good checkpoint is {max(listed)} in {workdir}/checkpoints;' in lines[0]
      stopped = max(listed)
    procs = _launch_pair(workdir, compile_cache, logs[3])
    for proc, log in zip(procs + reference, logs[3] + [tmp_path / f'ref{i}' for i in range(2)]):
      code, err = _finish(proc, log, timeout=300)
      assert code == 0, err
  finally:
    _end_all(procs + reference)
  assert f'resumed from step {stopped}' in open(f'{logs[3][0]}.out').read()
  assert all(name.isdigit() for name in os.listdir(workdir / 'checkpoints'))
  expected = {entry['step']: entry['loss'] for entry in read_metrics(tmp_path / 'reference')}
  assert_same_losses(workdir, expected)


def test_when_process_0_cannot_prepare_the_corpus_every_process_ends_with_its_error(
  compile_cache, tmp_path
):
  """Process 0 prepares a corpus whose second jsonl line has no text, while process 1 waits for
  dataset.json: both end within 60 s of process 0's error, status 2, with one line naming it."""
  corpus = tmp_path / 'bad.jsonl'
  corpus.write_text('{"text": "a first document"}\n{"body": "no text field"}\n')
  overrides = {**OVERRIDES, 'data.task': 'corpus', 'data.train_path': str(corpus)}
  logs = [tmp_path / 'p0', tmp_path / 'p1']
  procs = _launch_pair(tmp_path / 'run', compile_cache, logs, overrides)
  ended = [None, None]
  try:
    deadline = time.time() + 180
    while None in ended and time.time() < deadline:
      for i, proc in enumerate(procs):
        if ended[i] is None and proc.poll() is not None:
          ended[i] = time.time()
      time.sleep(0.05)
    results = [_finish(proc, log, timeout=1) for proc, log in zip(procs, logs)]
  finally:
    _end_all(procs)
  assert ended[1] - ended[0] < 60, ended  # bounded by process 0's error, not a timeout
  cause = f"{corpus}:2: no string 'text' field"
  (code0, err0), (code1, err1) = results
  assert code0 == 2 and [line for line in err0.splitlines() if line.startswith('error:')] == [
    f"error: {cause} (found ['body']); each line needs one"
  ], err0
  errors = [line for line in err1.splitlines() if line.startswith('error:')]
  assert code1 == 2 and len(errors) == 1 and 'Traceback' not in err1, err1
  assert errors[0].startswith('error: process 0 could not prepare the corpus in ')
  assert cause in errors[0]


def test_a_process_waiting_for_the_corpus_says_so_and_stops_at_process_0s_error(
  monkeypatch, capsys, tmp_path
):
  """The wait itself, against a key-value store that has no error for 3 polls, then one."""
  from transformer import util
  from transformer.data import prepare

  class Store:
    polls = 0

    def key_value_try_get(self, key):
      assert key == prepare._FAILED_KEY
      Store.polls += 1
      if Store.polls <= 3:
        raise RuntimeError(f'NOT_FOUND: {key}')
      return 'ValueError: the disk is full'

  monkeypatch.setattr(util, 'coordination_client', Store)
  monkeypatch.setattr(prepare, '_WAIT_SECONDS', 0.05)
  monkeypatch.setattr(prepare, '_REPORT_SECONDS', 0.0)
  full = r'process 0 could not prepare .*: ValueError: the disk is full'
  with pytest.raises(ValueError, match=full):
    prepare._wait_for_process_0(str(tmp_path))
  waited = [line for line in capsys.readouterr().err.splitlines() if 'waiting' in line]
  assert len(waited) == 3 and all('for process 0 to prepare the corpus in' in w for w in waited)

  class Gone:
    def key_value_try_get(self, key):
      raise RuntimeError('UNAVAILABLE: failed to connect to all addresses')

  monkeypatch.setattr(util, 'coordination_client', Gone)
  with pytest.raises(ConnectionError, match=r'process 0 \(the coordinator\) was lost'):
    prepare._wait_for_process_0(str(tmp_path))


def _wait_for_a_save(procs, directory, timeout=120.0):
  """Waits until a checkpoint's temp directory (a save under way) appears in `directory`."""
  deadline = time.time() + timeout
  while time.time() < deadline:
    if os.path.isdir(directory) and any('tmp' in name for name in os.listdir(directory)):
      return
    assert all(proc.poll() is None for proc in procs), [proc.returncode for proc in procs]
    time.sleep(0.002)
  raise AssertionError(f'no save began in {directory} within {timeout} s')


@pytest.mark.slow
def test_kills_during_two_process_saves_resume_from_the_last_whole_checkpoint(
  compile_cache, tmp_path
):
  """2 processes of `experiments.train`, the parameters sharded across them (FSDP), save every
  2 steps. 3 times, a few steps after the pair (re)started, one of them (each at least once, in
  a seeded order) is SIGKILLed a seeded moment after a save's temp directory appears. The
  survivor ends as for any lost peer (status 75, one `lost peer:` line); each rerun of the pair
  resumes from the latest listed checkpoint, with no damaged one set aside and no traceback, and
  after the first save never from scratch. The last rerun finishes with the losses of an
  uninterrupted pair."""
  rng = random.Random(43)
  # FSDP over the two processes: each writes its own shards of every checkpoint.
  overrides = {**OVERRIDES, 'train.checkpoint_every': 2, 'train.steps': 40, 'mesh.shape': '(1,2,1)'}
  workdir, directory = tmp_path / 'run', tmp_path / 'run' / 'checkpoints'
  reference_logs = [tmp_path / f'ref{i}' for i in range(2)]
  unsaved = {**overrides, 'train.checkpoint_every': 40}  # saves change no loss, and take time
  reference = _launch_pair(tmp_path / 'reference', compile_cache, reference_logs, unsaved)
  stopped, procs, victims = None, [], [0, 1, rng.randrange(2)]
  rng.shuffle(victims)  # each process is killed at least once
  try:
    for kill, victim in enumerate(victims):
      logs = [tmp_path / f'kill{kill}_process{i}' for i in range(2)]
      procs = _launch_pair(workdir, compile_cache, logs, overrides)
      _wait_for_step(procs[0], logs[0], (stopped or 0) + rng.randint(3, 9), timeout=300)
      out = open(f'{logs[0]}.out').read()
      assert (f'resumed from step {stopped}' in out) if stopped else ('resumed' not in out), out
      _wait_for_a_save(procs, directory)
      time.sleep(rng.uniform(0, 0.1))
      procs[victim].kill()
      code, err = _finish(procs[1 - victim], logs[1 - victim], timeout=90)
      assert code == faults.EXIT_PREEMPTED, err
      lines = [line for line in err.splitlines() if line.startswith('lost peer: ')]
      assert len(lines) == 1 and lines[0].startswith(f'lost peer: process {victim} '), err
      for dump in ['Traceback', 'Fatal Python error', 'Check failure', 'terminate called']:
        assert dump not in err, err
      listed = saved_steps(workdir)
      if listed:  # the line names what the rerun resumes from
        assert f'the last good checkpoint is {max(listed)} in ' in lines[0], (listed, lines)
      assert stopped is None or (listed and max(listed) >= stopped), (listed, stopped)
      stopped = max(listed) if listed else None
    logs = [tmp_path / f'last_process{i}' for i in range(2)]
    procs = _launch_pair(workdir, compile_cache, logs, overrides)
    for proc, log in zip(procs + reference, logs + reference_logs):
      code, err = _finish(proc, log, timeout=300)
      assert code == 0 and 'Traceback' not in err, err
  finally:
    _end_all(procs + reference)
  assert stopped and f'resumed from step {stopped}' in open(f'{logs[0]}.out').read()
  assert all(name.isdigit() for name in os.listdir(directory))  # nothing set aside, no temp dir
  expected = {entry['step']: entry['loss'] for entry in read_metrics(tmp_path / 'reference')}
  logged = read_metrics(workdir)
  assert [e['step'] for e in logged] == list(range(1, 41))
  for entry in logged:
    np.testing.assert_allclose(entry['loss'], expected[entry['step']], rtol=1e-6, atol=1e-6)


def test_sigint_stops_like_sigterm_and_restores_the_handlers(reference, monkeypatch, tmp_path):
  """In-process: the loop sends itself SIGINT while it fetches batch 20 (during step 19)."""
  original = batching.TrainIterator.__next__
  counter = {'n': 0}

  def next_and_interrupt(self):
    counter['n'] += 1
    if counter['n'] == 20:
      os.kill(os.getpid(), signal.SIGINT)
    return original(self)

  handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
  monkeypatch.setattr(batching.TrainIterator, '__next__', next_and_interrupt)
  with pytest.raises(Preempted, match='SIGINT: saved checkpoint 19 ') as stop:
    train_and_evaluate(kill_config(), str(tmp_path))
  assert stop.value.step == 19 and stop.value.signal_name == 'SIGINT'
  assert {s: signal.getsignal(s) for s in handlers} == handlers
  assert saved_steps(tmp_path) == [19]
  monkeypatch.undo()
  train_and_evaluate(kill_config(), str(tmp_path))
  assert_same_losses(tmp_path, reference)


def test_a_signal_during_set_up_stops_before_the_first_step(compile_cache, monkeypatch, tmp_path):
  original = Run.__init__

  def init_then_signal(self, *args, **kwargs):
    original(self, *args, **kwargs)
    os.kill(os.getpid(), signal.SIGTERM)  # e.g. while the tokenizer trains or data loads

  monkeypatch.setattr(Run, '__init__', init_then_signal)
  expected = (
    'SIGTERM: stopped before the first step, so there is nothing new to save (no checkpoint'
  )
  with pytest.raises(Preempted, match=re.escape(expected)):
    train_and_evaluate(small_config(), str(tmp_path))
  assert saved_steps(tmp_path) == []


# Non-finite steps ------------------------------------------------------------------------------
def test_nonfinite_skip_leaves_the_state_and_goes_on(compile_cache, monkeypatch, tmp_path, capsys):
  poison_batches(monkeypatch, {3})
  config = small_config(nonfinite='skip', checkpoint_every=1)
  result = train_and_evaluate(config, str(tmp_path))
  assert result['step'] == 8 and [h['step'] for h in result['train']] == list(range(1, 9))
  assert np.isnan(result['train'][2]['loss'])
  assert all(np.isfinite(h['loss']) for h in result['train'] if h['step'] != 3)
  assert result['train'][-1]['nonfinite_steps'] == 1
  assert 'step 3: loss nan' in capsys.readouterr().out
  events = read_metrics(tmp_path, 'event')
  assert [(e['step'], e['event']) for e in events] == [(3, 'nonfinite')]
  # Step 3 changed neither parameters nor optimizer state, but its counter advanced.
  _, before, _ = load_run(str(tmp_path), 2)
  _, after, _ = load_run(str(tmp_path), 3)
  assert int(after.step) == 3
  jax.tree_util.tree_map(
    np.testing.assert_array_equal,
    (before.params, before.opt_state),
    (after.params, after.opt_state),
  )


def test_skipped_nonfinite_steps_reach_the_sweeps_metrics(compile_cache, monkeypatch, tmp_path):
  """research.results.final_metrics counts the skipped steps from the run's own metrics.jsonl."""
  from research import results as results_lib

  poison_batches(monkeypatch, {2, 5})
  train_and_evaluate(small_config(nonfinite='skip'), str(tmp_path))
  metrics = results_lib.final_metrics(results_lib.read_curve(str(tmp_path)))
  assert metrics['train.nonfinite_skipped'] == 2.0
  assert metrics['train.loss_rise'] == float('inf')  # the logged NaN losses of steps 2 and 5


def test_nonfinite_halt_names_the_tensor_and_keeps_the_last_good_checkpoint(
  compile_cache, monkeypatch, tmp_path
):
  poison_batches(monkeypatch, {3})
  expected = r"step 3: batch\['weights'\] is non-finite \(256 NaN, 0 Inf\)\. Stopped by "
  with pytest.raises(NonFiniteError, match=expected) as error:
    train_and_evaluate(small_config(), str(tmp_path))  # 'auto' is 'halt' in float32
  assert f'the last good one is checkpoint 2 in {tmp_path}' in str(error.value)
  assert saved_steps(tmp_path) == [2]


def test_the_halt_report_finds_the_layer_and_the_parameter(compile_cache, tmp_path):
  run = Run(small_config(), None)
  state, host_batch = run.init_state(), next(run.task.train_iterator())
  rng = run.replicate(jax.random.PRNGKey(1))
  describe = lambda params, scale=1.0: faults.describe_nonfinite(
    run, params, host_batch, rng, step=1, scale=scale
  )
  wi = ('decoder', 'stack', 'layer_0', 'mlp', 'wi', 'kernel')

  def with_wi(value):
    params = jax.tree_util.tree_map(lambda x: x, state.params)
    layer = params['decoder']['stack']['layer_0']['mlp']['wi']
    layer['kernel'] = layer['kernel'].at[:, 0].set(value)
    return params

  assert describe(with_wi(jnp.nan)).startswith(f'parameter {"/".join(wi)} is non-finite (32 NaN')
  # A huge weight overflows the layer's output: the first non-finite tensor of the forward pass.
  report = describe(with_wi(3e38))
  assert report.startswith('the output of decoder/stack/layer_0/mlp/wi is non-finite'), report
  # Huge but finite gradients whose norm overflows.
  params = jax.tree_util.tree_map(lambda x: x, state.params)
  norm = params['decoder']['stack']['final_norm']
  norm['scale'] = norm['scale'] * 3e36
  report = describe(params)
  assert re.match(r'every gradient is finite but their norm overflows: the largest entry, ', report)
  assert 'recomputing the step gave finite values' in describe(state.params)


@jax.custom_vjp
def _nan_gradient(x):
  return x


_nan_gradient.defvjp(lambda x: (x, None), lambda _, g: (g * jnp.nan,))


def test_the_halt_report_names_the_deepest_non_finite_gradient(compile_cache):
  """A backward pass that turns non-finite at the output of layer_0/mlp/wi, forward intact."""
  run = Run(small_config(), None)
  state, host_batch = run.init_state(), next(run.task.train_iterator())
  rng = run.replicate(jax.random.PRNGKey(1))

  def poison(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    at_wi = context.module.path == ('decoder', 'stack', 'layer_0', 'mlp', 'wi')
    return _nan_gradient(out) if at_wi and context.method_name == '__call__' else out

  with nn.intercept_methods(poison):
    report = faults.describe_nonfinite(run, state.params, host_batch, rng, step=1, scale=1.0)
  expected = (
    r'gradient of decoder/stack/layer_0/mlp/wi/(kernel|bias) is non-finite \(\d+ NaN, 0 Inf\), '
  )
  assert re.match(expected + r'the deepest of \d+ non-finite gradients', report), report
  assert re.search(r'the loss \(5\.\d+\) and every activation are finite$', report), report


def test_nonfinite_rollback_restores_the_checkpoint_and_skips_the_batch(
  compile_cache, monkeypatch, tmp_path, capsys
):
  poison_batches(monkeypatch, {5})
  result = train_and_evaluate(small_config(nonfinite='rollback'), str(tmp_path / 'a'))
  assert 'step 5: loss nan' in capsys.readouterr().out
  assert [h['step'] for h in result['train']] == list(range(1, 9))
  events = read_metrics(tmp_path / 'a', 'event')
  assert [(e['step'], e['event'], e['to_step']) for e in events] == [(5, 'rollback', 4)]
  # The same as a run that never saw batch 5: back to step 4's state, then batches 6, 7, ...
  monkeypatch.undo()
  poison_batches(monkeypatch, {5}, how='drop')
  skipped = train_and_evaluate(small_config(), str(tmp_path / 'b'))
  assert [h['step'] for h in read_metrics(tmp_path / 'a')] == list(range(1, 9))
  for a, b in zip(result['train'], skipped['train']):
    np.testing.assert_allclose(a['loss'], b['loss'], rtol=1e-6, atol=1e-6)


# Loss spikes -------------------------------------------------------------------------------------
def _spike_at(step, factor=50.0):
  """A train_step whose `step`-th call reports its loss `factor` times too high."""

  def wrapper(train_step):
    calls = {'n': 0}

    def spiky(*args):
      state, metrics = train_step(*args)
      calls['n'] += 1
      if calls['n'] == step:
        metrics = {**metrics, 'loss': metrics['loss'] * factor}
      return state, metrics

    return spiky

  return wrapper


@pytest.mark.parametrize('rollback', [False, True])
def test_loss_spikes_are_logged_and_can_roll_back(
  rollback, compile_cache, monkeypatch, tmp_path, capsys
):
  wrap_train_step(monkeypatch, _spike_at(6))
  scalars, write = [], _write_scalars

  def record(writer, step, values, prefix):
    scalars.extend((step, prefix, name) for name in values)
    write(writer, step, values, prefix)

  monkeypatch.setattr(loop, '_write_scalars', record)
  config = small_config(spike_factor=5.0, spike_window=4, spike_rollback=rollback)
  result = train_and_evaluate(config, str(tmp_path))
  out = capsys.readouterr().out
  assert re.search(r'step 6: loss spike: [\d.]+ is \d+\.\dx the median of the last 4 losses', out)
  assert (6, 'train/', 'loss_spike') in scalars  # TensorBoard
  events = [(e['step'], e['event']) for e in read_metrics(tmp_path, 'event')]
  losses = [h['loss'] for h in result['train']]
  assert [h['step'] for h in result['train']] == list(range(1, 9))
  if rollback:
    assert events == [(6, 'rollback')] and 'rolled back to checkpoint 4' in out
    assert max(losses) < 10  # the spiked step was done again with the next batch
  else:
    assert events == [(6, 'loss_spike')] and losses[5] > 5 * np.median(losses[1:5])


# Out of memory -------------------------------------------------------------------------------
class _OutOfMemory:
  """A jitted train_step whose calls fail as XLA does when the device is full."""

  def __init__(self, jitted, lower_too=False):
    self.jitted, self.lower_too = jitted, lower_too

  def __call__(self, *args):
    raise jax.errors.JaxRuntimeError(
      'RESOURCE_EXHAUSTED: Out of memory while trying to allocate 68719476736 bytes.'
    )

  def lower(self, *args):
    if self.lower_too:
      self(*args)
    return self.jitted.lower(*args)


@pytest.mark.parametrize('estimate', [True, False])
def test_out_of_memory_is_one_clear_error_with_the_estimate_and_the_knobs(
  estimate, compile_cache, monkeypatch, tmp_path
):
  wrap_train_step(monkeypatch, lambda jitted: _OutOfMemory(jitted, lower_too=not estimate))
  with pytest.raises(OutOfMemoryError) as error:
    train_and_evaluate(small_config(), str(tmp_path))
  message = str(error.value)
  assert message.startswith('the train step does not fit in device memory: ')
  if estimate:
    assert re.search(r'XLA estimates \d+\.\d\d GiB per device \(arguments ', message)
  else:
    assert 'XLA gave no estimate' in message
  assert 'XLA said: RESOURCE_EXHAUSTED: Out of memory while trying to allocate' in message
  for knob in ['data.batch_size=8', 'train.grad_accum_steps=1', "model.remat='save_matmuls'"]:
    assert knob in message
  assert 'data.max_length=32' in message
  assert isinstance(error.value.__cause__, jax.errors.JaxRuntimeError)


def test_fault_knobs_are_checked_before_anything_is_written(tmp_path):
  for change, text in [
    ({'nonfinite': 'ignore'}, "train.nonfinite='ignore' is not one of auto | skip | halt"),
    ({'spike_factor': 0.5}, 'train.spike_factor=0.5 must be 0 (off) or a number > 1'),
    ({'checkpoint_every_seconds': -1.0}, 'train.checkpoint_every_seconds=-1.0 must be >= 0'),
  ]:
    with pytest.raises(ValueError, match=re.escape(text)):
      train_and_evaluate(small_config(**change), str(tmp_path / 'run'))
  assert not os.path.exists(tmp_path / 'run')
