"""Fuzzing the input boundaries: config overrides, data files and checkpoint files.

Every generated input must succeed legitimately or raise one of DOCUMENTED_ERRORS (see
docs/reliability.md) from sparrow's own code, with a message; none may hang (each case runs under a
deadline) or escape as a raw error from inside JAX, orbax or tensorstore. A damaged checkpoint
must never restore to numbers other than those saved.
"""

import collections
import contextlib
import dataclasses
import faulthandler
import logging
import os
import shutil
import signal
import subprocess
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import base
from transformer import data
from transformer.config import ModelConfig
from transformer.data import sources
from transformer.training import checkpoint

DOCUMENTED_ERRORS = (ValueError, FileNotFoundError)  # and their subclasses, e.g. CheckpointError
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@contextlib.contextmanager
def _deadline(seconds: float):
  """Raises TimeoutError in a case that runs past `seconds`; kills the run if C code hangs."""

  def expire(signum, frame):
    raise TimeoutError(f'no answer within {seconds} s')

  previous = signal.signal(signal.SIGALRM, expire)
  signal.setitimer(signal.ITIMER_REAL, seconds)
  faulthandler.dump_traceback_later(seconds + 60, exit=True)
  try:
    yield
  finally:
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, previous)
    faulthandler.cancel_dump_traceback_later()


def _problem(error: BaseException) -> str | None:
  """Why `error` is not a clear, documented error (None when it is)."""
  if not isinstance(error, DOCUMENTED_ERRORS):
    return f'undocumented {type(error).__name__}: {error}'
  if not str(error).strip():
    return f'{type(error).__name__} without a message'
  origin = traceback.extract_tb(error.__traceback__)[-1].filename
  if f'{os.sep}site-packages{os.sep}' in origin:
    return f'raw {type(error).__name__} from {origin}: {error}'
  return None


def _run_cases(cases, check, seconds: float = 20.0) -> collections.Counter:
  """Runs `check(case)` for each (description, case); fails listing every case that misbehaved.

  Returns how many cases returned each value of `check` (or raised each error type).
  """
  failures, outcomes = [], collections.Counter()
  for description, case in cases:
    try:
      with _deadline(seconds):
        outcomes[check(case)] += 1
    except AssertionError as e:
      failures.append(f'{description}: {e}')
    except BaseException as e:  # noqa: BLE001 - anything else is judged by _problem
      outcomes[type(e).__name__] += 1
      problem = _problem(e)
      if problem:
        failures.append(f'{description}: {problem}')
  assert not failures, f'{len(failures)} of {len(cases)} cases:\n' + '\n'.join(failures[:20])
  return outcomes


# (a) Config overrides ----------------------------------------------------------------------------
_VALUES = [
  'abc',
  '',
  -1,
  0,
  3,
  1.5,
  -0.5,
  float('nan'),
  float('inf'),
  None,
  True,
  False,
  [1, 2],
  (7,),
  (1, 2, 3),
  ('a', 'b'),
  {'a': 1},
  2**70,
  1e30,
  b'bytes',
  'float64',
  'rope',
  'swiglu',
  64,  # and a few values that are valid for some keys
  0.1,
  'xla',
  'pre',
]


def _config_cases(count: int, seed: int):
  rng = np.random.default_rng(seed)
  names = sorted(f.name for f in dataclasses.fields(ModelConfig))
  for index in range(count):
    model = base.get_config().model.to_dict()
    changed = {}
    for _ in range(int(rng.integers(1, 4))):
      if rng.random() < 0.1:
        key = 'x' + ''.join(rng.choice(list('abcdefgh_'), 6))  # a misspelt key
      else:
        key = names[int(rng.integers(len(names)))]
      changed[key] = _VALUES[int(rng.integers(len(_VALUES)))]
    model.update(changed)
    yield f'config case {index} {changed!r}', (model, changed)


def test_fuzz_model_config_overrides():
  def check(case):
    model, changed = case
    try:
      config = ModelConfig.from_config(model)
    except ValueError as e:
      assert any(key in str(e) for key in changed), f'the message names no changed key: {e}'
      raise
    assert config.to_dict()['d_model'] == model['d_model']  # built: a legitimate config
    return 'built'

  outcomes = _run_cases(list(_config_cases(150, seed=0)), check, seconds=10)
  assert outcomes['built'] >= 3 and outcomes['ValueError'] >= 100, outcomes


_CLI_CASES = {  # flags -> a piece of the one error line
  ('--config.model.d_model=abc',): 'flag --config.model.d_model=abc: invalid literal for int()',
  ('--config.model.num_heads=7',): 'num_heads=7 does not divide',
  ('--config.model.norm_eps=nan',): 'norm_eps=nan must be a finite number',
  ('--config.data.bad_lines=maybe',): "bad_lines='maybe' is not valid",
  ('--config.data.task=text', '--config.data.train_path=BINARY'): 'binary.txt:1: invalid UTF-8',
}


def test_fuzz_cli_flags_give_one_clear_line(tmp_path):
  binary = tmp_path / 'binary.txt'
  binary.write_bytes(bytes(np.random.default_rng(0).integers(128, 256, 500, dtype=np.uint8)))
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  running = []
  for index, (flags, expected) in enumerate(_CLI_CASES.items()):
    flags = [f.replace('BINARY', str(binary)) for f in flags]
    command = [sys.executable, '-m', 'experiments.train', f'--workdir={tmp_path / str(index)}']
    proc = subprocess.Popen(
      command + flags, cwd=_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    running.append((flags, expected, proc))
  for flags, expected, proc in running:  # run side by side: each one mostly imports JAX
    _, stderr = proc.communicate(timeout=120)
    lines = [line for line in stderr.splitlines() if line.strip() and 'WARNING' not in line]
    assert proc.returncode != 0 and 'Traceback' not in stderr, (flags, stderr[-2000:])
    assert lines and lines[0].startswith(('error: ', 'FATAL Flags parsing error')), (flags, stderr)
    assert expected in lines[0], (flags, lines[0])


# (b) Data files ----------------------------------------------------------------------------------
_BAD_BYTES = [b'\xff', b'\xc3\x28', b'\xed\xa0\x80', b'\xf8\x88\x80\x80\x80', b'\xe2\x82', b'\x80']
_NICE = ['hello world', 'größe', '数字 123', 'a', '\x00nul', 'tab\tin', '  spaced  ', '\ufeffbom']


def _data_cases(count: int, seed: int):
  rng = np.random.default_rng(seed)
  kinds = ['random bytes', 'bad utf-8', 'columns', 'huge line', 'blank', 'crlf', 'fine']
  for index in range(count):
    kind = kinds[index % len(kinds)]
    lines = []
    for _ in range(int(rng.integers(0, 12))):
      line = _NICE[int(rng.integers(len(_NICE)))].encode()
      if kind == 'bad utf-8' and rng.random() < 0.4:
        at = int(rng.integers(len(line) + 1))
        line = line[:at] + _BAD_BYTES[int(rng.integers(len(_BAD_BYTES)))] + line[at:]
      if kind == 'columns':
        line = b'\t'.join([line] * int(rng.integers(0, 4)))
      elif rng.random() < 0.7:
        line = line + b'\t' + line
      lines.append(line)
    if kind == 'random bytes':
      content = bytes(rng.integers(0, 256, int(rng.integers(0, 3000)), dtype=np.uint8))
    elif kind == 'huge line':
      lines.insert(
        int(rng.integers(len(lines) + 1)), b'x\t' + b'y' * int(rng.integers(60, 70) * 1024)
      )
      content = b'\n'.join(lines)
    elif kind == 'blank':
      content = b'\n'.join([b'', b'   ', b'\t', *lines[:1]])
    else:
      content = (b'\r\n' if kind == 'crlf' else b'\n').join(lines) + b'\n' * int(rng.integers(2))
    columns, bad_lines = int(rng.integers(1, 3)), ['error', 'skip'][int(rng.integers(2))]
    yield (
      f'data case {index} ({kind}, columns={columns}, {bad_lines})',
      (content, columns, bad_lines),
    )


def test_fuzz_data_lines(tmp_path):
  counter = iter(range(10**6))

  def check(case):
    content, columns, bad_lines = case
    path = tmp_path / f'case{next(counter)}.tsv'
    path.write_bytes(content)
    try:
      examples = sources.read_lines(
        str(path), 'train_path', columns, bad_lines=bad_lines, max_line_bytes=64 * 1024
      )
    except ValueError as e:
      assert str(path) in str(e), f'the message names no file: {e}'
      if bad_lines == 'skip':
        assert 'no usable lines' in str(e), f'skip raised for one line: {e}'
      raise
    assert examples
    for example in examples:
      parts = (example,) if columns == 1 else example
      assert len(parts) == columns and all(isinstance(p, str) and p.strip() for p in parts)
    return 'read'

  outcomes = _run_cases(list(_data_cases(120, seed=1)), check, seconds=10)
  assert outcomes['read'] >= 30 and outcomes['ValueError'] >= 30, outcomes


def test_fuzz_data_files_through_build(tmp_path, caplog):
  counter = iter(range(10**6))

  def check(case):
    content, columns, bad_lines = case
    path = tmp_path / f'case{next(counter)}.tsv'
    path.write_bytes(content)
    cfg = data.default_config()
    cfg.update(dict(task='text' if columns == 1 else 'tsv', train_path=str(path)))
    cfg.update(dict(eval_path=str(path), bad_lines=bad_lines, batch_size=2, eval_batch_size=2))
    cfg.update(dict(max_length=32, max_source_length=16, max_target_length=16))
    family = 'causal_lm' if columns == 1 else 'encoder_decoder'
    task = data.build(cfg, family=family, workdir=None, seed=0)
    batch = next(task.train_iterator())
    assert 0 <= batch['inputs'].min() and batch['inputs'].max() < task.tokenizer.vocab_size
    task.eval_batches()
    return 'built'

  with caplog.at_level(logging.ERROR):  # 'skip' warns per file
    outcomes = _run_cases(list(_data_cases(28, seed=2)), check, seconds=20)
  assert outcomes['built'] >= 10 and outcomes['ValueError'] >= 5, outcomes


# (c) Checkpoint files ----------------------------------------------------------------------------
def _state(step: int) -> dict:
  rng = np.random.default_rng(step)
  return {
    'params': {
      'w': jnp.asarray(rng.standard_normal((16, 32)), jnp.float32),
      'b': jnp.asarray(rng.standard_normal(32), jnp.bfloat16),
    },
    'step': jnp.int32(step),
  }


@pytest.fixture(scope='module')
def saved_workdir(tmp_path_factory):
  """A workdir with checkpoints 1 and 2 of a tiny state, written once for all cases."""
  workdir = tmp_path_factory.mktemp('saved')
  ckpt = checkpoint.Checkpointer(str(workdir))
  for step in (1, 2):
    ckpt.save(step, _state(step), {'position': step, 'epoch': 0})
  ckpt.close()
  return workdir


def _damage(path: str, rng) -> str:
  """Damages the file at `path` in one random way; returns what was done."""
  with open(path, 'rb') as f:
    content = f.read()
  how = ['flip', 'flip', 'flip', 'truncate', 'zero', 'delete', 'append', 'random'][
    int(rng.integers(8))
  ]
  if how == 'delete':
    os.remove(path)
    return how
  if how == 'flip' and content:
    content = bytearray(content)
    for _ in range(int(rng.choice([1, 2, 8]))):
      content[int(rng.integers(len(content)))] ^= 1 << int(rng.integers(8))
  elif how == 'truncate':
    content = content[: int(rng.integers(len(content) + 1))]
  elif how == 'zero':
    content = bytes(len(content))
  elif how == 'append':
    content += bytes(rng.integers(0, 256, 16, dtype=np.uint8))
  elif how == 'random':
    content = bytes(rng.integers(0, 256, len(content), dtype=np.uint8))
  with open(path, 'wb') as f:
    f.write(bytes(content))
  return how


def _files(directory) -> list[str]:
  return sorted(os.path.join(r, n) for r, _, names in os.walk(directory) for n in names)


def _exactly(restored, step: int) -> bool:
  saved = jax.tree.leaves(_state(step))
  if len(jax.tree.leaves(restored)) != len(saved):
    return False
  for a, b in zip(jax.tree.leaves(restored), saved):
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes():
      return False
  return True


def _checkpoint_cases(saved, count: int, seed: int):
  rng = np.random.default_rng(seed)
  for index in range(count):
    damaged_steps = [2] if rng.random() < 0.8 else [1, 2]
    plan = []
    for step in damaged_steps:
      files = _files(saved / 'checkpoints' / str(step))
      for _ in range(int(rng.integers(1, 3))):
        plan.append(os.path.relpath(files[int(rng.integers(len(files)))], saved))
    yield f'checkpoint case {index} {plan}', (plan, int(rng.integers(2**31)))


def test_fuzz_checkpoint_files(saved_workdir, tmp_path):
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), _state(0))
  counter = iter(range(10**6))
  absl_logger = logging.getLogger('absl')
  level = absl_logger.level
  absl_logger.setLevel(logging.CRITICAL)  # orbax logs each unreadable file

  def check(case):
    plan, seed = case
    workdir = tmp_path / f'case{next(counter)}'
    shutil.copytree(saved_workdir, workdir)
    rng = np.random.default_rng(seed)
    for relative in plan:
      if os.path.exists(workdir / relative):
        _damage(str(workdir / relative), rng)
    ckpt = checkpoint.Checkpointer(str(workdir))
    try:
      explicit = 'step 2 intact'
      try:  # an explicit step: exactly what was saved, or CorruptCheckpointError
        restored, data_state, step = ckpt.restore(abstract, step=2)
        assert _exactly(restored, 2) and data_state == {'position': 2, 'epoch': 0}, 'wrong data'
      except checkpoint.CorruptCheckpointError:
        explicit = 'step 2 corrupt'
      except FileNotFoundError:  # the damage removed the step from the listing
        assert 2 not in ckpt.all_steps()
        explicit = 'step 2 unlisted'
      restored, data_state, step = ckpt.restore(abstract)  # the newest good one
      assert step in (1, 2) and _exactly(restored, step), f'step {step} restored wrong numbers'
      assert data_state == {'position': step, 'epoch': 0}, f'step {step}: data {data_state}'
      assert (step == 1) == (explicit != 'step 2 intact'), f'{explicit} but restored {step}'
      return explicit
    except checkpoint.CorruptCheckpointError:
      assert all(s in {1, 2} for s in ckpt.all_steps())  # every one is damaged: one clear error
      raise
    finally:
      ckpt.close()

  try:
    outcomes = _run_cases(list(_checkpoint_cases(saved_workdir, 60, seed=3)), check, seconds=30)
  finally:
    absl_logger.setLevel(level)
  assert outcomes['step 2 corrupt'] >= 20 and outcomes['step 2 intact'] >= 5, outcomes
