"""Preparation's progress lines: they come on time, carry the phase, MB, MB/s and ETA, and keep
coming while a phase blocks."""

import re
import sys
import time

import numpy as np

from transformer import data
from transformer.data import prepare, progress

_COUNTED = re.compile(r'prepare: (?P<phase>[a-z ]+), (?P<done>[\d.]+)/(?P<total>[\d.]+) MB, '
                      r'(?P<rate>[\d.]+) MB/s, ETA (?P<eta>\S+)')  # fmt: skip


class _Clock:
  def __init__(self):
    self.now = 100.0

  def __call__(self):
    return self.now


def test_a_line_at_start_then_one_each_interval_with_its_fields():
  lines, clock, done = [], _Clock(), [0]
  shown = progress.Progress(lines.append, interval=10, clock=clock, thread=False)
  shown.phase('encoding', 100 * 10**6, done=lambda: done[0])
  assert len(lines) == 1  # at once
  clock.now, done[0] = 109.0, 30 * 10**6
  shown.tick()
  assert len(lines) == 1  # not yet 10 s since the last line
  clock.now, done[0] = 110.0, 40 * 10**6
  shown.tick()
  found = _COUNTED.match(lines[-1]).groupdict()
  assert found == {'phase': 'encoding', 'done': '40.0', 'total': '100.0', 'rate': '4.0',
                   'eta': '15s'}  # fmt: skip
  shown.tick()
  assert len(lines) == 2  # the line just written counts
  shown.phase('encoding', None, done=lambda: done[0])  # a size not known before it is read
  clock.now += 10
  assert lines[-1].startswith('prepare: encoding, 40.0/? MB, ') and shown.line().endswith('ETA ?')


def test_a_phase_without_counters_states_its_size_and_an_estimate():
  lines, clock = [], _Clock()
  shown = progress.Progress(lines.append, interval=5, clock=clock, thread=False)
  shown.phase('training tokenizer', 4 * 10**6, detail=lambda: 'sentencepiece', estimate=80)
  clock.now += 5
  shown.tick()
  assert lines[-1] == 'prepare: training tokenizer, 4.0 MB, 5s so far, ETA ~1m15s (sentencepiece)'
  clock.now += 100
  shown.tick()
  assert lines[-1].endswith('1m45s so far, ETA ? (sentencepiece)')  # past the estimate


def test_the_thread_writes_while_the_caller_blocks():
  lines = []
  with progress.Progress(lines.append, interval=0.05) as shown:
    shown.phase('training tokenizer', 10**6)
    time.sleep(0.6)  # a blocking call
  count = len(lines)
  assert count >= 4 and all(line.startswith('prepare: training tokenizer') for line in lines)
  time.sleep(0.2)
  assert len(lines) == count  # closed: no more lines


def test_lines_reach_stderr_while_sentencepiece_trains(capfd):
  rng = np.random.default_rng(1)
  words = [''.join(rng.choice(list('abcdefgh'), 5)) for _ in range(400)]
  docs = [' '.join(rng.choice(words, 30)) for _ in range(4000)]
  training, written = [False], []

  def write(line):
    written.append(training[0])
    print(line, file=sys.stderr, flush=True)

  with progress.Progress(write, interval=0.005) as shown:
    shown.phase('training tokenizer', 10**6)
    training[0] = True
    data.train_sentencepiece(docs, 300)
    training[0] = False
  lines = capfd.readouterr().err.splitlines()
  # Every line written while it trains reaches fd 2 (SentencePiece's log stream would take it);
  # counted, not timed, so a fast machine cannot fail it.
  assert sum(written) >= 2, written
  assert len(lines) == len(written) and all(line.startswith('prepare: ') for line in lines), lines


def test_duration():
  assert [progress.duration(s) for s in (0, 59.4, 61, 3725, float('inf'))] == [
    '0s', '59s', '1m01s', '1h02m05s', '?',
  ]  # fmt: skip


def test_prepare_reports_every_phase_with_its_fields(tmp_path, monkeypatch):
  rng = np.random.default_rng(0)
  words = ['the', 'cat', 'sat', 'on', 'a', 'mat', 'and', 'dog', 'ran']
  docs = [' '.join(rng.choice(words, int(rng.integers(5, 40)))) for _ in range(3000)]
  (tmp_path / 't.txt').write_text(''.join(d + '\n' for d in docs))
  monkeypatch.setattr(progress, 'INTERVAL', 0.01)
  train = prepare.train_sentencepiece

  def slow(*args, **kwargs):  # a trainer that blocks for several intervals
    time.sleep(0.1)
    return train(*args, **kwargs)

  monkeypatch.setattr(prepare, 'train_sentencepiece', slow)
  cfg = data.default_config()
  cfg.update(dict(task='corpus', train_path=str(tmp_path / 't.txt'), tokenizer='sentencepiece'))
  cfg.update(dict(vocab_size=60, prepare_chunk_mb=1))
  lines = []
  prepare.prepare(cfg, str(tmp_path / 'out'), workers=1, log=lines.append)
  assert all(line.startswith('prepare: ') for line in lines)
  phases = [m.group(1) for m in map(re.compile(r'prepare: ([a-z ]+),').match, lines) if m]
  assert {'sampling', 'training tokenizer', 'encoding'} <= set(phases)
  assert phases.count('training tokenizer') >= 3  # while the trainer blocked
  assert any(_COUNTED.match(line) for line in lines if line.startswith('prepare: encoding'))
  size = (tmp_path / 't.txt').stat().st_size
  sampled = next(line for line in lines if line.startswith('prepare: sampled'))
  assert sampled.startswith(f'prepare: sampled {size / 1e6:.1f} MB (3,000 documents')  # all of it
  assert lines[-1].startswith('prepare: done in ')
