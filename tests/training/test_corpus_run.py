"""Training on llm.c shards with configs/gpt2_speedrun.py (shrunk): it trains, validates on the
val shards, and a run resumed from its checkpoint matches an uninterrupted one step for step."""

import json
import os
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest

from configs import gpt2_speedrun
from transformer.training.loop import train_and_evaluate

VOCAB = 50257  # GPT-2's ids, as in the speedrun's shards
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_WORKER = os.path.join(_ROOT, 'tests', 'corpus_worker.py')


def _shard(path, tokens):
  header = np.zeros(256, np.int32)
  header[:3] = 20240520, 1, len(tokens)  # llm.c's magic, version and token count
  with open(path, 'wb') as f:
    f.write(header.tobytes() + np.asarray(tokens, np.uint16).tobytes())


@pytest.fixture(scope='module')
def shard_dir(tmp_path_factory):
  directory = tmp_path_factory.mktemp('fineweb')
  rng = np.random.default_rng(0)
  for split, count in (('train', 2), ('val', 1)):
    for i in range(count):
      tokens = rng.integers(0, 1000, 3000)
      tokens[::50] = VOCAB - 1  # <|endoftext|>
      _shard(directory / f'fineweb_{split}_{i:06d}.bin', tokens)
  return directory


def _config(shard_dir, steps):
  config = gpt2_speedrun.get_config()
  m, d, t = config.model, config.data, config.train
  m.d_model, m.num_heads, m.d_ff, m.num_layers, m.max_length = 32, 2, 64, 1, 32
  m.dtype = 'float32'
  d.train_path = str(shard_dir / 'fineweb_train_*.bin')
  d.eval_path = str(shard_dir / 'fineweb_val_*.bin')
  d.max_length, d.batch_size, d.eval_batch_size, d.eval_batches = 32, 4, 4, 2
  t.steps, t.grad_accum_steps, t.log_every, t.eval_every, t.checkpoint_every = steps, 1, 1, 2, 2
  config.optim.warmup_steps = 1
  return config


@pytest.mark.slow  # about 20 s; test_train_prepares_a_text_corpus_on_first_use is the fast one
def test_speedrun_preset_trains_validates_and_resumes_exactly(shard_dir, tmp_path):
  whole = train_and_evaluate(_config(shard_dir, 4), str(tmp_path / 'whole'))
  assert np.isfinite(whole['eval']['loss']) and whole['eval']['loss'] < 1.5 * np.log(VOCAB)
  cut = str(tmp_path / 'cut')
  train_and_evaluate(_config(shard_dir, 2), cut)
  resumed = train_and_evaluate(_config(shard_dir, 4), cut)
  losses = lambda result: [h['loss'] for h in result['train'] if h['step'] > 2]
  np.testing.assert_allclose(losses(resumed), losses(whole), rtol=1e-5)
  assert [h['step'] for h in resumed['train']] == [3, 4]
  assert resumed['eval']['loss'] == pytest.approx(whole['eval']['loss'], rel=1e-5)
  assert os.path.exists(os.path.join(cut, 'tokenizer', 'tokenizer.json'))  # the ids 'tokenizer'


def test_train_prepares_a_text_corpus_on_first_use(tmp_path):
  from configs import gpt_tiny

  docs = [f'document {i}: ' + 'the river runs ' * (i % 40) for i in range(400)]
  (tmp_path / 'c.txt').write_text(''.join(d + '\n' for d in docs))
  config = gpt_tiny.get_config()
  d, t = config.data, config.train
  d.task, d.train_path, d.tokenizer = 'corpus', str(tmp_path / 'c.txt'), 'byte'
  d.max_length, d.batch_size, d.eval_batch_size, d.eval_batches = 32, 4, 4, 1
  config.model.d_model, config.model.num_layers, config.model.max_length = 32, 1, 32
  t.steps, t.eval_every, t.checkpoint_every, t.eval_decode_examples = 2, 2, 2, 2
  t.max_decode_length = 8  # the prompt (half a row) and its continuation fit 32 positions
  workdir = str(tmp_path / 'run')
  result = train_and_evaluate(config, workdir)
  meta = json.load(open(os.path.join(workdir, 'corpus', 'dataset.json')))
  assert meta['documents'] == 398 and meta['tokenizer'] == 'byte'  # 2 of 400 held out
  assert np.isfinite(result['eval']['loss']) and result['step'] == 2
  assert os.path.exists(os.path.join(workdir, 'checkpoints', '2'))


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _start(args):
  return subprocess.Popen(
    [sys.executable, '-u', _WORKER, *map(str, args)],
    cwd=_ROOT,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    env={**os.environ, 'PYTHONPATH': _ROOT},  # this checkout's packages, not an installed copy
    start_new_session=True,  # its own process group: a timeout kills it and its children
  )


def _wait(procs, timeout=300):
  try:
    for proc in procs:
      out, _ = proc.communicate(timeout=timeout)
      assert proc.returncode == 0, out[-3000:]
  finally:
    for proc in procs:
      if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.slow
def test_two_processes_then_one_see_the_tokens_of_one_uninterrupted_run(shard_dir, tmp_path):
  """Steps 1-2 on 2 processes (4 devices each), resumed for steps 3-4 on 1 process (8 devices):
  the same losses as 4 steps on 1 process, so every process read the same next tokens."""
  whole, cut = tmp_path / 'whole', tmp_path / 'cut'
  reference = _start(['single', shard_dir, whole, 4, tmp_path / 'whole.json'])
  port = _free_port()
  first = [_start(['host', i, port, shard_dir, cut, 2, tmp_path / 'a.json']) for i in range(2)]
  _wait([reference, *first])
  _wait([_start(['single', shard_dir, cut, 4, tmp_path / 'b.json'])])
  losses = json.loads((tmp_path / 'a.json').read_text())
  second = json.loads((tmp_path / 'b.json').read_text())
  assert sorted(losses) == ['1', '2'] and sorted(second) == ['3', '4']
  losses.update(second)
  expected = json.loads((tmp_path / 'whole.json').read_text())
  for step in expected:
    np.testing.assert_allclose(losses[step], expected[step], rtol=1e-5)
