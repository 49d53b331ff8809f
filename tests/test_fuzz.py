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
import json
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
from transformer.config.experiment import DataConfig, section
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

  outcomes = _run_cases(list(_config_cases(300, seed=0)), check, seconds=10)
  assert outcomes['built'] >= 3 and outcomes['ValueError'] >= 100, outcomes


_CLI_CASES = {  # flags -> a piece of the one error line
  ('--config.model.d_model=abc',): 'flag --config.model.d_model=abc: invalid literal for int()',
  ('--config.model.num_heads=7',): 'num_heads=7 does not divide',
  ('--config.model.norm_eps=nan',): 'norm_eps=nan must be a finite number',
  ('--config.data.bad_lines=maybe',): "bad_lines='maybe' is not valid",
  ('--config.data.task=text', '--config.data.train_path=BINARY'): 'binary.txt:1: invalid UTF-8',
  ('--config.train.eval_every=0',): 'train.eval_every=0 must be an integer >= 1',
  ('--config.data.batch_size=0',): 'data.batch_size=0 must be an integer >= 1',
  ('--config.data.max_length=1',): 'data.max_length=1 must be an integer >= 2',
  (
    '--config=configs/gpt_tiny.py',
    '--config.data.task=corpus',
    '--config.data.train_path=NOTEXT',
  ): ("notext.jsonl:2: no string 'text' field"),
  (
    '--config=configs/gpt_tiny.py',
    '--config.data.task=corpus',
    '--config.data.train_path=SHARD',
    '--config.data.eval_path=SHARD',
  ): ('magic 1 version 1; not a token shard'),
}
# Refused with status 2 and no workdir left behind: bad knobs, and bad corpora met on first use.
_BEFORE_ANY_WORK = ('train.', 'data.batch_size', 'data.max_length', 'notext', 'magic')


@pytest.mark.slow  # ~20 s of processes that mostly import JAX; test_loop's CLI errors stay fast
def test_fuzz_cli_flags_give_one_clear_line(tmp_path):
  binary = tmp_path / 'binary.txt'
  binary.write_bytes(bytes(np.random.default_rng(0).integers(128, 256, 500, dtype=np.uint8)))
  inputs = {'NOTEXT': tmp_path / 'notext.jsonl'}
  inputs['NOTEXT'].write_text('{"text": "a"}\n{"body": "b"}\n')
  inputs['SHARD'] = tmp_path / 'train_000000.bin'  # llm.c's header with a wrong magic
  inputs['SHARD'].write_bytes(np.array([1, 1, 0] + [0] * 253, np.int32).tobytes())
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  running = []
  for index, (flags, expected) in enumerate(_CLI_CASES.items()):
    flags = [f.replace('BINARY', str(binary)) for f in flags]
    for name, path in inputs.items():
      flags = [f.replace(name, str(path)) for f in flags]
    workdir = tmp_path / str(index)
    command = [sys.executable, '-m', 'experiments.train', f'--workdir={workdir}']
    proc = subprocess.Popen(
      command + flags, cwd=_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    running.append((flags, expected, proc, workdir))
  for flags, expected, proc, workdir in running:  # run side by side: each one mostly imports JAX
    _, stderr = proc.communicate(timeout=120)
    lines = [line for line in stderr.splitlines() if line.strip() and 'WARNING' not in line]
    lines = [line for line in lines if not line.startswith('prepare: ')]  # progress, not errors
    assert proc.returncode != 0 and 'Traceback' not in stderr, (flags, stderr[-2000:])
    assert lines and lines[0].startswith(('error: ', 'FATAL Flags parsing error')), (flags, stderr)
    assert expected in lines[0], (flags, lines[0])
    if expected.startswith(_BEFORE_ANY_WORK):
      assert proc.returncode == 2, (flags, proc.returncode)
      assert not workdir.exists(), f'{flags} wrote {sorted(os.listdir(workdir))}'


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
    cfg.text_format = 'lines'  # lines and columns are what this fuzzes
    cfg.update(dict(eval_path=str(path), bad_lines=bad_lines, batch_size=2, eval_batch_size=2))
    cfg.update(dict(max_length=32, max_source_length=16, max_target_length=16))
    family = 'causal_lm' if columns == 1 else 'encoder_decoder'
    task = data.build(section(DataConfig, cfg), family=family, workdir=None, seed=0)
    batch = next(task.train_iterator())
    assert 0 <= batch['inputs'].min() and batch['inputs'].max() < task.tokenizer.vocab_size
    task.eval_batches()
    return 'built'

  with caplog.at_level(logging.ERROR):  # 'skip' warns per file
    outcomes = _run_cases(list(_data_cases(28, seed=2)), check, seconds=20)
  assert outcomes['built'] >= 10 and outcomes['ValueError'] >= 5, outcomes


# (b2) Token shards and corpora for task='corpus' ----------------------------------------------
def _shard_bytes(rng) -> bytes:
  """llm.c's layout (256 int32s: magic, version, count; then uint16 tokens), often damaged."""
  tokens = rng.integers(0, 500, int(rng.integers(0, 400))).astype(np.uint16)
  header = np.zeros(256, np.int32)
  header[:3] = 20240520, 1, len(tokens)
  kinds = ['fine', 'fine', 'magic', 'version', 'count', 'cut', 'header only', 'bytes', 'ids']
  how = kinds[int(rng.integers(len(kinds)))]
  if how == 'ids' and len(tokens):
    tokens[int(rng.integers(len(tokens)))] = int(rng.integers(500, 2**16))  # another vocabulary
  if how == 'magic':
    header[0] = int(rng.integers(-(2**31), 2**31))
  elif how == 'version':
    header[1] = int(rng.integers(-5, 10))
  elif how == 'count':
    header[2] = int(rng.integers(-(2**31), 2**31))
  content = header.tobytes() + tokens.tobytes()
  if how == 'cut':
    content = content[: int(rng.integers(len(content) + 1))]
  elif how == 'header only':
    content = content[:1024]
  elif how == 'bytes':
    content = bytes(rng.integers(0, 256, int(rng.integers(0, 3000)), dtype=np.uint8))
  return content


def test_fuzz_token_shards_through_build(tmp_path):
  """Damaged llm.c shards: a task that streams in-vocabulary tokens, or one clear error."""
  rng, counter = np.random.default_rng(3), iter(range(10**6))

  def check(content):
    directory = tmp_path / f'case{next(counter)}'
    directory.mkdir()
    (directory / 'train_000000.bin').write_bytes(content)
    val = np.zeros(256 + 50, np.int32)
    val[:3] = 20240520, 1, 100  # 100 uint16 tokens in the 50 int32s
    (directory / 'val_000000.bin').write_bytes(val.tobytes())
    cfg = data.default_config()
    cfg.update(dict(task='corpus', train_path=str(directory / 'train_*.bin'), vocab_size=500))
    cfg.update(dict(eval_path=str(directory / 'val_*.bin'), batch_size=2, eval_batch_size=2))
    cfg.update(dict(max_length=16, pack=True, eval_batches=2))
    task = data.build(section(DataConfig, cfg), family='causal_lm', workdir=None, seed=0)
    for _ in range(3):
      batch = next(task.train_iterator())
      assert batch['targets'].max() < 500 and batch['weights'].all()
    return 'built'

  cases = [(f'shard case {i}', _shard_bytes(rng)) for i in range(60)]
  outcomes = _run_cases(cases, check, seconds=10)
  assert outcomes['built'] >= 3 and outcomes['ValueError'] >= 30, outcomes


def _jsonl_cases(count: int, seed: int):
  rng = np.random.default_rng(seed)
  records = ['{"text": "TEXT"}', '{"text": ""}', '{"body": "TEXT"}', '{"text": 3}', '[1, 2]', '{']
  records += ['{"text": "TEXT", "id": 7}', '"TEXT"', '', '   ', '{"text": null}']
  for index in range(count):
    lines, bad = [], [0.0, 0.01, 0.1][index % 3]
    for _ in range(int(rng.integers(0, 300))):
      record = records[int(rng.integers(len(records)))] if rng.random() < bad else records[0]
      nice = json.dumps(_NICE[int(rng.integers(len(_NICE)))])[1:-1]  # escaped for JSON
      lines.append(record.replace('TEXT', nice))
    content = '\n'.join(lines).encode()
    if rng.random() < 0.2:
      at = int(rng.integers(len(content) + 1))
      content = content[:at] + _BAD_BYTES[int(rng.integers(len(_BAD_BYTES)))] + content[at:]
    yield f'jsonl case {index}', content


def test_fuzz_jsonl_corpora_through_prepare(tmp_path):
  """Random jsonl corpora: prepared and streamed, or one error naming the file; a corpus that
  fails leaves no output directory behind."""
  counter = iter(range(10**6))

  def check(content):
    case = tmp_path / f'case{next(counter)}'
    case.mkdir()
    (case / 'c.jsonl').write_bytes(content)
    cfg = data.default_config()
    cfg.update(dict(task='corpus', train_path=str(case / 'c.jsonl'), prepared_dir=str(case / 'o')))
    cfg.eval_path = cfg.train_path  # no held-out documents needed
    cfg.update(dict(batch_size=2, eval_batch_size=2, max_length=16))
    try:
      task = data.build(section(DataConfig, cfg), family='causal_lm', workdir=None, seed=0)
    except ValueError as e:
      assert 'c.jsonl' in str(e), f'the message names no file: {e}'
      assert not (case / 'o').exists(), 'a failed prepare left its directory'
      raise
    next(task.train_iterator())
    return 'built'

  outcomes = _run_cases(list(_jsonl_cases(40, seed=4)), check, seconds=20)
  assert outcomes['built'] >= 5 and outcomes['ValueError'] >= 10, outcomes


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


# (e) What a user hands to a trained model ------------------------------------------------------
_FAMILIES = ('causal_lm', 'encoder_decoder', 'bidirectional_lm')


@pytest.fixture(scope='module')
def trained(tmp_path_factory, untrained_workdir):
  """family -> (workdir, Model) of a saved tiny-config workdir (its step-0 parameters: the calls
  and loads under test do not depend on training, and a run costs compiles)."""
  import transformer

  out = {}
  for family in _FAMILIES:
    workdir = untrained_workdir(tmp_path_factory.mktemp(family), family)
    out[family] = (workdir, transformer.load(workdir))
  return out


_IDS = [  # token arrays: (description, value); the tiny vocabulary is 261 (bytes + 5 specials)
  ('ok', [[2, 40, 41, 42]]),
  ('ok two rows', [[2, 40, 41, 0], [2, 50, 0, 0]]),
  ('negative', [[2, -1, 41]]),
  ('vocab size', [[2, 261, 41]]),
  ('2**40', np.array([[2, 2**40]], np.int64)),
  ('2**32 + 40 (wraps to 40 in int32)', np.array([[2, 2**32 + 40]], np.int64)),
  ('float', [[2.0, 40.0]]),
  ('float nan', [[2.0, float('nan')]]),
  ('bool', [[True, False]]),
  ('strings', [['a', 'b']]),
  ('1-D', [2, 40, 41]),
  ('3-D', [[[2, 40]]]),
  ('scalar', 7),
  ('empty rows', np.zeros((0, 4), np.int32)),
  ('empty columns', np.zeros((1, 0), np.int32)),
  ('ragged', [[2, 40], [2]]),
  ('None', None),
  ('uint8', np.array([[2, 40]], np.uint8)),
  ('too long', np.full((1, 600), 40, np.int32)),
]
_TEXTS = [
  ('ok', 'the cat'),
  ('ok list', ['the cat', 'a dog sat']),
  ('empty string', ''),
  ('empty list', []),
  ('int', 7),
  ('None', None),
  ('list with an int', ['a', 3]),
  ('nested list', [['a']]),
  ('bytes', b'the cat'),
  ('unicode', 'caf\u00e9 \u2603 \U0001f600'),
  ('control characters', '\x00\x01\n\t'),
  ('huge', 'word ' * 20_000),
  ('many rows', ['a'] * 300),
]
_NUMBERS = [0, 1, 3, -1, -5, 2.5, float('nan'), float('inf'), -float('inf'), None, '3', True, 10**9]
_PROBABILITIES = [1.0, 0.5, 0.0, -0.1, 1.5, float('nan'), None, '0.5']


def _ndim(x) -> int:
  try:
    return np.ndim(x)
  except ValueError:  # ragged
    return -1


def _rand(rng, options):
  return options[int(rng.integers(len(options)))]


def _check_ids(model, ids):
  """logits of valid ids: float32 [B, T, V], finite, and equal to a second, 1-row call."""
  out = model.logits(ids)
  tokens = np.asarray(ids)
  assert out.shape == tokens.shape + (model.cfg.vocab_size,) and out.dtype == np.float32
  assert np.isfinite(out).all()
  return 'ok'


def _check_texts(texts, out):
  texts = [texts] if isinstance(texts, str) else texts
  assert isinstance(out, list) and len(out) == len(texts), out
  return out


def _model_cases(trained, count: int, seed: int):
  """(description, thunk) cases over Model.generate/translate/score/fill_mask/logits."""
  rng = np.random.default_rng(seed)
  gpt, ed, bert = (trained[f][1] for f in _FAMILIES)
  for index in range(count):
    kind = _rand(rng, ['logits', 'generate', 'translate', 'score', 'fill_mask'])
    name, text = _rand(rng, _TEXTS)
    if kind == 'logits':
      model = _rand(rng, [gpt, bert, ed])
      name, ids = _rand(rng, _IDS)
      extra = {'decoder_tokens': [[2, 40]]} if model is ed else {}
      if rng.random() < 0.3:
        mask_name = _rand(rng, ['ones', 'wrong shape', 'halves', 'twos'])
        shape = np.shape(ids) if _ndim(ids) == 2 else (1, 1)
        extra['mask'] = {
          'ones': np.ones(shape, int),
          'wrong shape': [[1]],
          'halves': np.full(shape, 0.5),
          'twos': np.full(shape, 2),
        }[mask_name]
        name += f', mask {mask_name}'

      def case(model=model, ids=ids, extra=extra):
        if _ndim(ids) == 2 and np.asarray(ids).dtype.kind == 'i' and 'mask' not in extra:
          if model is not ed and np.size(ids):
            return _check_ids(model, ids)
        out = model.logits(ids, **extra)
        assert np.isfinite(out).all() and out.shape[-1] == model.cfg.vocab_size
        return 'ok'

      yield f'{index} {model.cfg.family}.logits({name}, {sorted(extra)})', case
    elif kind in ('generate', 'translate'):
      model = gpt if kind == 'generate' else ed
      knobs = {}
      for knob, values in [
        ('temperature', _NUMBERS),
        ('top_k', _NUMBERS + [261, 10_000]),
        ('top_p', _PROBABILITIES),
        ('beam_size', _NUMBERS + [262, 300, 10**6]),
        ('alpha', _NUMBERS),
        ('seed', _NUMBERS + [2**70]),
      ]:
        if rng.random() < 0.15:
          knobs[knob] = _rand(rng, values)
      length = 'max_new_tokens' if kind == 'generate' else 'max_length'
      if rng.random() < 0.5:
        knobs[length] = _rand(rng, _NUMBERS + [32, 500])
      if knobs.get('temperature', 0) == 0 and knobs.get('beam_size', 1) == 1:
        knobs.setdefault(length, 3)  # greedy cases that pass the checks stay short

      def case(model=model, kind=kind, text=text, knobs=knobs):
        out = _check_texts(text, getattr(model, kind)(text, **knobs))
        assert all(isinstance(o, str) for o in out), out
        return 'ok'

      yield f'{index} {kind}({name}, {knobs})', case
    elif kind == 'score':
      model = _rand(rng, [gpt, ed, bert])
      sources = _rand(rng, [None, text, ['x'], 5]) if model is ed else None

      def case(model=model, text=text, sources=sources):
        out = _check_texts(text, model.score(text, sources=sources))
        for row in out:
          assert len(row['tokens']) == len(row['log_probs']) and max(row['log_probs']) <= 0
          np.testing.assert_allclose(row['nll'], -sum(row['log_probs']), rtol=1e-5)
          np.testing.assert_allclose(
            row['perplexity'], np.exp(row['nll'] / len(row['tokens'])), rtol=1e-5
          )
        return 'ok'

      yield f'{index} {model.cfg.family}.score({name}, sources={sources!r:.40})', case
    else:
      model = _rand(rng, [bert, bert, gpt])
      masked = _rand(rng, [text, 'the [MASK] sat', '[MASK]', '[MASK][MASK] x [MASK]', '[mask]'])
      top_k = _rand(rng, [1, 1, 3, 0, -1, 261, 262, 2.5, None])

      def case(model=model, masked=masked, top_k=top_k):
        out = _check_texts(masked, model.fill_mask(masked, top_k=top_k))
        for row, given in zip(out, [masked] if isinstance(masked, str) else masked):
          assert len(row['candidates']) == given.count('[MASK]') and '[MASK]' not in row['text']
          for pairs in row['candidates']:
            probs = [p for _, p in pairs]
            assert len(pairs) == top_k and probs == sorted(probs, reverse=True)
            assert all(0 <= p <= 1 for p in probs)
        return 'ok'

      yield f'{index} {model.cfg.family}.fill_mask({masked!r:.40}, top_k={top_k!r})', case


def test_fuzz_model_calls(trained):
  """160 random calls of a trained model's methods with bad and good arguments (with the 44
  damaged workdirs below, 204 cases)."""
  outcomes = _run_cases(list(_model_cases(trained, 160, seed=18)), lambda case: case(), seconds=30)
  assert outcomes['ok'] >= 20 and outcomes['ValueError'] >= 60, outcomes


def _damage_workdir(source: str, target: str, how: str) -> None:
  shutil.copytree(source, target)
  config, tokenizer = os.path.join(target, 'config.json'), os.path.join(target, 'tokenizer')
  text = open(config).read()
  edits = {
    'config truncated': lambda: open(config, 'w').write(text[: len(text) // 2]),
    'config empty': lambda: open(config, 'w').write(''),
    'config not json': lambda: open(config, 'w').write('model = {}'),
    'config a list': lambda: open(config, 'w').write('[1, 2]'),
    'config without model': lambda: open(config, 'w').write('{"data": {}}'),
    'config model a string': lambda: open(config, 'w').write('{"model": "gpt"}'),
    'config bad d_model': lambda: open(config, 'w').write(
      text.replace('"d_model": 32', '"d_model": "x"')
    ),
    'config bad family': lambda: open(config, 'w').write(
      text.replace('"family": "', '"family": "x')
    ),
    'config bad vocab': lambda: open(config, 'w').write(
      text.replace('"vocab_size": 261', '"vocab_size": -3')
    ),
    'config other vocab': lambda: open(config, 'w').write(
      text.replace('"vocab_size": 261', '"vocab_size": 300')
    ),
    'config binary': lambda: open(config, 'wb').write(os.urandom(200)),
    'config a directory': lambda: (os.remove(config), os.mkdir(config)),
    'tokenizer json truncated': lambda: _rewrite(tokenizer, lambda t: t[: len(t) // 2]),
    'tokenizer json empty': lambda: _rewrite(tokenizer, lambda t: ''),
    'tokenizer kind unknown': lambda: _rewrite(tokenizer, lambda t: t.replace('"byte"', '"zip"')),
    'tokenizer without kind': lambda: _rewrite(tokenizer, lambda t: '{"vocab_size": 261}'),
    'tokenizer a list': lambda: _rewrite(tokenizer, lambda t: '[]'),
    'tokenizer sentencepiece without model': lambda: _rewrite(
      tokenizer, lambda t: '{"kind": "sentencepiece", "model_file": "nope.model"}'
    ),
    'tokenizer dir removed': lambda: shutil.rmtree(tokenizer),
    'tokenizer json removed': lambda: [
      os.remove(os.path.join(tokenizer, n)) for n in os.listdir(tokenizer)
    ],
    'checkpoints removed': lambda: shutil.rmtree(os.path.join(target, 'checkpoints')),
    'not a directory': lambda: (shutil.rmtree(target), open(target, 'w').write('x')),
  }
  edits[how]()


def _rewrite(tokenizer_dir: str, change) -> None:
  for name in os.listdir(tokenizer_dir):
    if name.endswith('.json'):
      path = os.path.join(tokenizer_dir, name)
      text = open(path).read()
      open(path, 'w').write(change(text))


_DAMAGE = [
  'config truncated',
  'config empty',
  'config not json',
  'config a list',
  'config without model',
  'config model a string',
  'config bad d_model',
  'config bad family',
  'config bad vocab',
  'config other vocab',
  'config binary',
  'config a directory',
  'tokenizer json truncated',
  'tokenizer json empty',
  'tokenizer kind unknown',
  'tokenizer without kind',
  'tokenizer a list',
  'tokenizer sentencepiece without model',
  'tokenizer dir removed',
  'tokenizer json removed',
  'checkpoints removed',
  'not a directory',
]


def test_fuzz_load_of_damaged_workdirs(trained, tmp_path):
  """transformer.load of a trained workdir with a damaged config.json, tokenizer or checkpoint
  directory: one clear error naming the workdir, or (tokenizer/ gone) a model that gives logits."""
  import transformer

  def check(case):
    family, how = case
    target = str(tmp_path / f'{family}_{how.replace(" ", "_")}')
    _damage_workdir(trained[family][0], target, how)
    try:
      model = transformer.load(target)
    except DOCUMENTED_ERRORS as error:
      assert target in str(error) or 'config.json' in str(error), error
      raise
    model.logits(
      np.array([[2, 40, 41]], np.int32),
      **({'decoder_tokens': np.array([[2, 40]], np.int32)} if family == 'encoder_decoder' else {}),
    )
    return 'loaded'

  cases = []  # each damage in two of the three families, in turn
  for index, how in enumerate(_DAMAGE):
    for family in (_FAMILIES[index % 3], _FAMILIES[(index + 1) % 3]):
      cases.append((f'{family} {how}', (family, how)))
  outcomes = _run_cases(cases, check)
  assert sum(outcomes.values()) == len(cases) == 44 and outcomes['loaded'] >= 2, outcomes
