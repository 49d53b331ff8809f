"""A full disk while preparing a corpus: one error line, nothing that passes for a prepared corpus,
and the same command resumes to the shards a roomy disk gives."""

import errno
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from transformer import data
from transformer.data import prepare, shards

# Imported first by every Python process started with this directory on PYTHONPATH (the command
# and its spawned workers): each process's shard writer fails with ENOSPC after FULL_AFTER bytes.
_SITECUSTOMIZE = """
import errno, os
budget = int(os.environ['FULL_AFTER'])
from transformer.data import shards

add = shards.ShardWriter.add
def full(self, ids, documents):
  global budget
  budget -= len(ids) * self.dtype().itemsize
  if budget < 0:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
  add(self, ids, documents)
shards.ShardWriter.add = full
"""
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_UNITS = {'bytes': 1, 'KiB': 2**10, 'MiB': 2**20, 'GiB': 2**30}


def _corpus(tmp_path) -> str:
  rng = np.random.default_rng(0)
  words = ['größe', 'alpha', 'beta', '数字', 'x', 'and', 'the']
  for part in range(3):  # three pieces of about 0.4 MB
    docs = [' '.join(rng.choice(words, int(rng.integers(1, 60)))) for _ in range(2000)]
    (tmp_path / f't{part}.txt').write_text(''.join(d + '\n' for d in docs), encoding='utf-8')
  return str(tmp_path / 't*.txt')


def _command(train: str, out: str, workers: int) -> list[str]:
  return [
    sys.executable,
    '-m',
    'experiments.prepare_data',
    '--config=configs/gpt_tiny.py',
    f'--config.data.train_path={train}',
    '--config.data.tokenizer=byte',
    '--config.data.prepare_chunk_mb=1',
    f'--out={out}',
    f'--workers={workers}',
  ]


def _shards(out: str) -> dict[str, bytes]:
  return {n: open(os.path.join(out, n), 'rb').read() for n in os.listdir(out) if '.bin' in n}


# Two workers (the parallel writer's own path) is the slow suite's: the one-worker case covers the
# error line and the resume in README's run.
@pytest.mark.parametrize(
  'workers, full_after', [(1, 1_100_000), pytest.param(2, 200_000, marks=pytest.mark.slow)]
)
def test_full_disk_is_one_error_line_and_the_same_command_resumes(tmp_path, workers, full_after):
  train, out = _corpus(tmp_path), str(tmp_path / 'out')
  (tmp_path / 'inject').mkdir()
  (tmp_path / 'inject' / 'sitecustomize.py').write_text(_SITECUSTOMIZE)
  env = dict(os.environ, JAX_PLATFORMS='cpu', FULL_AFTER=str(full_after))
  env['PYTHONPATH'] = os.pathsep.join([str(tmp_path / 'inject'), ROOT])
  command = _command(train, out, workers)
  full = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert full.returncode == 2, full.stderr[-3000:]
  errors = [line for line in full.stderr.splitlines() if not line.startswith('prepare')]
  assert len(errors) == 1 and 'Traceback' not in full.stderr, full.stderr[-3000:]
  line = errors[0]
  assert line.startswith(f'error: no room to prepare the corpus in {out}: No space left on device')
  assert re.search(r'written: \d of 3 pieces \(.+ of shards\), .+ free', line), line
  assert line.endswith('rerun the same command: it resumes with the pieces left'), line
  assert not prepare.is_prepared(out) and not [n for n in os.listdir(out) if n.endswith('.tmp')]
  before = _shards(out)
  assert (len(before) > 0) == (workers == 1)  # the first budget fits a piece, the second none

  del env['FULL_AFTER']  # room again: the same command finishes
  again = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert again.returncode == 0, again.stderr[-3000:]
  roomy = str(tmp_path / 'roomy')
  cfg = data.default_config()
  cfg.update(dict(task='corpus', train_path=train, tokenizer='byte', prepare_chunk_mb=1))
  assert prepare.read_dataset(out) == prepare.prepare(cfg, roomy)
  assert _shards(out) == _shards(roomy)
  # The estimate of the room the pieces left needed, against what they took.
  number, unit = re.search(r'pieces left need about ([\d.]+) (\w+)', line).groups()
  estimate = float(number) * _UNITS[unit]
  took = sum(len(b) for n, b in _shards(out).items() if n not in before)
  assert 0.7 * took <= estimate <= 1.5 * took, (estimate, took)


def test_only_a_lack_of_room_becomes_the_line(tmp_path, monkeypatch):
  cfg = data.default_config()
  cfg.update(dict(task='corpus', train_path=_corpus(tmp_path), tokenizer='byte'))

  def fail(code):
    def raising(*args, **kwargs):
      raise OSError(code, os.strerror(code))

    return raising

  monkeypatch.setattr(os, 'makedirs', fail(errno.EDQUOT))  # not even the directory
  with pytest.raises(ValueError, match=r'^no room to make .*/out: Disk quota exceeded\. Free'):
    prepare.prepare(cfg, str(tmp_path / 'out'))
  monkeypatch.undo()
  monkeypatch.setattr(shards.ShardWriter, 'add', fail(errno.EIO))  # a failing disk stays itself
  with pytest.raises(OSError) as raised:
    prepare.prepare(cfg, str(tmp_path / 'out'))
  assert raised.value.errno == errno.EIO and not (tmp_path / 'out' / prepare.DATASET).exists()


def test_training_on_a_new_workdir_keeps_the_shards_written_before_a_full_disk(
  tmp_path, monkeypatch
):
  from transformer.config.experiment import DataConfig, section
  from transformer.training import loop

  config = data.default_config()
  config.update(dict(task='corpus', train_path=_corpus(tmp_path), tokenizer='byte'))
  config.prepare_chunk_mb = 1
  cfg, workdir = section(DataConfig, config), str(tmp_path / 'run')
  add, written = shards.ShardWriter.add, []

  def full_after_a_piece(self, ids, documents):
    if len(written) > 1 and self.path not in written:
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    written.append(self.path)
    add(self, ids, documents)

  monkeypatch.setattr(shards.ShardWriter, 'add', full_after_a_piece)
  with pytest.raises(prepare.NoRoomError, match='written: 1 of 3 pieces'):
    loop._prepare_corpus(cfg, workdir)
  kept = sorted(os.listdir(os.path.join(workdir, 'corpus')))
  assert 'train_00000.bin' in kept and prepare.DATASET not in kept  # not removed, not ready
  monkeypatch.undo()
  loop._prepare_corpus(cfg, workdir)
  assert prepare.read_dataset(os.path.join(workdir, 'corpus'))['documents'] == 5970
