"""Soak test, run by hand (not in CI): train for a while, SIGTERM the run again and again, check.

  python -m experiments.soak     # 20 minutes, a checkpoint every 30 s, a SIGTERM every 2 minutes
  python -m experiments.soak --minutes=6 --kill_every_seconds=60

Trains configs/gpt_tiny.py through `python -m experiments.train`, checkpointing every
`--checkpoint_seconds`, and sends it SIGTERM every `--kill_every_seconds`; each time the same
command resumes it. An uninterrupted reference run of the same config trains alongside. At the
end it checks that both logged the same losses at the same steps, that every kill exited with the
preemption status within a bound and resumed from the step it saved, that the host RSS of the
training processes stayed flat after warm-up, and that the workdirs hold only the run's files.
It prints a report and writes it into docs/reliability.md under "## Soak".
"""

import datetime
import json
import os
import re
import runpy
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
from absl import app, flags

_MINUTES = flags.DEFINE_float('minutes', 20.0, 'How long to train, kills and restarts included.')
_CHECKPOINT_SECONDS = flags.DEFINE_float('checkpoint_seconds', 30.0, 'Seconds between checkpoints.')
_KILL_EVERY = flags.DEFINE_float('kill_every_seconds', 120.0, 'Seconds between SIGTERMs.')
_WARMUP = flags.DEFINE_float('warmup_seconds', 30.0, 'RSS is compared from this long after step 1.')
_CONFIG = flags.DEFINE_string('config', 'configs/gpt_tiny.py', 'The experiment to train.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Where to train; default a temp dir, then deleted.')
_COMPILE_CACHE = flags.DEFINE_bool(
  'compile_cache', True, 'Share a JAX compilation cache between starts: more training per start.'
)
_REPORT = flags.DEFINE_string('report', 'docs/reliability.md', "Markdown file to write; '' = none.")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXIT_PREEMPTED = 75  # training.faults.EXIT_PREEMPTED (not imported: this process stays light)
RSS_LIMIT = 0.05  # allowed RSS growth after warm-up
JUDGE_SECONDS = 60  # a process's RSS is judged only with this much of it after warm-up
EXPECTED = {
  'checkpoints',
  'config.json',
  'git_revision.txt',
  'metrics.jsonl',
  'revisions.jsonl',
  'tensorboard',
}


class Trainer:
  """One `python -m experiments.train` process of a workdir, with its RSS sampled."""

  def __init__(self, workdir: str, logs: str, name: str):
    self.workdir, self.log = workdir, os.path.join(logs, name)
    env = dict(os.environ)
    if _COMPILE_CACHE.value:
      env['JAX_COMPILATION_CACHE_DIR'] = os.path.join(logs, 'jax_cache')
      env['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'] = '0'
    command = [sys.executable, '-m', 'experiments.train', f'--config={_CONFIG.value}']
    command += [f'--workdir={workdir}', '--config.train.log_every=1']  # every loss is compared
    for key in ('steps', 'eval_every', 'checkpoint_every'):  # never reached: only time counts
      command.append(f'--config.train.{key}=1000000000')
    command += [f'--config.train.checkpoint_every_seconds={_CHECKPOINT_SECONDS.value}']
    with open(f'{self.log}.out', 'w') as out, open(f'{self.log}.err', 'w') as err:
      self.proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=err)
    self.started, self.first_step = time.time(), None
    self.samples = []  # (seconds since the first step, RSS bytes, threads, open fds)

  def sample(self) -> None:
    now = time.time()
    if self.first_step is None and re.search(r'step \d+/', self.output()):
      self.first_step = now
    try:
      with open(f'/proc/{self.proc.pid}/status') as f:
        status = dict(line.split(':', 1) for line in f if ':' in line)
      fds = len(os.listdir(f'/proc/{self.proc.pid}/fd'))
    except OSError:  # it has just exited
      return
    if self.first_step is not None:
      rss = int(status['VmRSS'].split()[0]) * 1024
      self.samples.append((now - self.first_step, rss, int(status['Threads']), fds))

  def stop(self, timeout: float = 120.0) -> tuple[int, float, str]:
    """SIGTERM, then (exit status, seconds to exit, stderr)."""
    sent = time.time()
    self.proc.send_signal(signal.SIGTERM)
    try:
      self.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
      self.proc.kill()
      self.proc.wait()
    with open(f'{self.log}.err') as f:
      return self.proc.returncode, time.time() - sent, f.read()

  def output(self) -> str:
    with open(f'{self.log}.out') as f:
      return f.read()

  def after_warmup(self) -> list[tuple]:
    """Samples from warm-up on: `--warmup_seconds` after step 1, its first checkpoint included."""
    warmup = max(_WARMUP.value, _CHECKPOINT_SECONDS.value + 5)
    return [s for s in self.samples if s[0] >= warmup]


def _losses(workdir: str) -> list[tuple[int, float]]:
  """(step, loss) of each train line of the workdir's metrics.jsonl, in file order."""
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    entries = [json.loads(line) for line in f]
  return [(e['step'], e['loss']) for e in entries if e['kind'] == 'train']


def _strays(workdir: str, keep: int) -> list[str]:
  """What a workdir holds beyond its run's files: temp files and dirs, extra checkpoints."""
  strays = [n for n in os.listdir(workdir) if n not in EXPECTED | {'tokenizer'}]
  checkpoints = os.listdir(os.path.join(workdir, 'checkpoints'))
  strays += [f'checkpoints/{n}' for n in checkpoints if not n.isdigit()]
  if sum(n.isdigit() for n in checkpoints) > keep:
    strays.append(f'{sum(n.isdigit() for n in checkpoints)} checkpoints (keep={keep})')
  events = os.listdir(os.path.join(workdir, 'tensorboard'))
  strays += [f'tensorboard/{n}' for n in events if not n.startswith('events.out.tfevents.')]
  return strays


def _growth(trainers: list[Trainer]) -> tuple[float | None, str]:
  """The largest RSS growth after warm-up over `trainers` (None: none ran long enough), in words.

  RSS swings by about 10% from second to second (allocator, checkpoint buffers), so growth is the
  90th percentile of the second half of a process's samples after warm-up against that of the
  first half. Only processes with at least JUDGE_SECONDS of samples after warm-up are judged.
  """
  worst, words, short = None, [], 0
  for trainer in trainers:
    samples = trainer.after_warmup()
    if not samples or samples[-1][0] - samples[0][0] < JUDGE_SECONDS:
      short += 1
      continue
    half = len(samples) // 2
    first = float(np.percentile([s[1] for s in samples[:half]], 90))
    second = float(np.percentile([s[1] for s in samples[half:]], 90))
    growth = second / first - 1
    if worst is None or growth > worst:
      worst = growth
      words = [
        f'{first / 2**20:.0f} MiB then {second / 2**20:.0f} MiB (90th percentiles of each half of '
        f'{samples[-1][0] - samples[0][0]:.0f} s after warm-up)'
      ]
  if short:
    words.append(f'{short} of {len(trainers)} processes too short to judge (< {JUDGE_SECONDS} s)')
  return worst, '; '.join(words)


def _flat(trainers: list[Trainer], column: int) -> str:
  values = [s[column] for t in trainers for s in t.after_warmup()]
  return f'{min(values)}-{max(values)}' if values else '?'


def soak(workdir: str) -> tuple[str, bool]:
  logs = os.path.join(os.path.dirname(workdir), os.path.basename(workdir) + '_logs')
  os.makedirs(logs, exist_ok=True)
  run, reference = os.path.join(workdir, 'run'), os.path.join(workdir, 'reference')
  began, load = time.time(), os.getloadavg()[0]
  end = began + 60 * _MINUTES.value
  ref = Trainer(reference, logs, 'reference')
  trainers = [Trainer(run, logs, 'run_0')]
  kills, crashed = [], None
  while time.time() < end:
    time.sleep(1.0)
    for trainer in (ref, trainers[-1]):
      trainer.sample()
    current = trainers[-1]
    if current.proc.poll() is not None or ref.proc.poll() is not None:
      crashed = current if current.proc.poll() is not None else ref
      break
    if time.time() - current.started >= _KILL_EVERY.value and time.time() < end - 5:
      kills.append((current, *current.stop()))
      trainers.append(Trainer(run, logs, f'run_{len(trainers)}'))
  if crashed is None:
    kills.append((trainers[-1], *trainers[-1].stop()))
  ref_code, _, ref_err = ref.stop()
  minutes = (time.time() - began) / 60
  with open(os.path.join(logs, 'samples.json'), 'w') as f:  # (s after step 1, RSS, threads, fds)
    json.dump({t.log: t.samples for t in trainers + [ref]}, f)

  # Checks ------------------------------------------------------------------------------------
  checks = []
  saved = []  # the step each SIGTERM saved (or, when it came during start-up, left the latest)
  for *_, err in kills:
    match = re.search(r'preempted: SIGTERM: saved checkpoint (\d+) ', err) or re.search(
      r'preempted: SIGTERM: stopped before the first step.*checkpoint (\d+) in ', err
    )
    saved.append(int(match.group(1)) if match else None)
  good = [
    code == EXIT_PREEMPTED and step is not None for (_, code, _, _), step in zip(kills, saved)
  ]
  resumed = [
    f'resumed from step {step} ' in trainers[i + 1].output()
    for i, step in enumerate(saved[: len(trainers) - 1])
  ]
  seconds = [k[2] for k in kills]
  checks.append(
    (
      'preemption',
      all(good) and all(resumed) and crashed is None,
      f'{sum(good)} of {len(kills)} SIGTERMs exited with status {EXIT_PREEMPTED} after saving, '
      f'in at most {max(seconds):.1f} s (median {statistics.median(seconds):.1f} s); '
      f'{sum(resumed)} of {len(resumed)} restarts resumed from the step saved'
      + (f'; CRASH: {crashed.log} exited with {crashed.proc.returncode}' if crashed else ''),
    )
  )
  logged = _losses(run)
  ours, theirs = dict(logged), dict(_losses(reference))
  common = sorted(set(ours) & set(theirs))
  diff = max((abs(ours[s] - theirs[s]) for s in common), default=float('nan'))
  once = [s for s, _ in logged] == list(range(1, max(ours, default=0) + 1))
  checks.append(
    (
      'losses',
      bool(common) and diff <= 1e-6 and once,
      f'{len(common)} steps in common (1-{common[-1] if common else 0}): '
      f'largest difference {diff:.3g} (limit 1e-6); '
      + ('each step logged once' if once else 'NOT each step logged exactly once'),
    )
  )
  judged = 0
  for name, group in [('RSS of the killed runs', trainers), ('RSS of the reference run', [ref])]:
    growth, words = _growth(group)
    judged += growth is not None
    shown = 'not judged' if growth is None else f'{growth:+.1%} (limit +5%)'
    checks.append((name, growth is None or growth <= RSS_LIMIT, f'{shown}: {words}'))
  if not judged:
    checks.append(('RSS', False, f'no process ran {JUDGE_SECONDS} s after warm-up: run longer'))
  checks.append(
    (
      'threads, open files',
      True,
      f'after warm-up: {_flat(trainers + [ref], 2)} threads, {_flat(trainers + [ref], 3)} open '
      'files (reported, not checked)',
    )
  )
  keep = runpy.run_path(os.path.join(ROOT, _CONFIG.value))['get_config']().train.keep_checkpoints
  strays = _strays(run, keep) + _strays(reference, keep)
  listing = sorted(os.listdir(run))
  steps = sorted(int(n) for n in os.listdir(os.path.join(run, 'checkpoints')))
  events = len(os.listdir(os.path.join(run, 'tensorboard')))
  checks.append(
    (
      'workdir',
      not strays,
      f'{", ".join(listing)}; checkpoints {steps}; {events} event files for {len(trainers)} '
      f'starts' + (f'; STRAY: {strays}' if strays else ''),
    )
  )

  # Report ------------------------------------------------------------------------------------
  passed = all(ok for _, ok, _ in checks)
  ref_steps = max(theirs) if theirs else 0
  shown = [a for a in sys.argv[1:] if not a.startswith(('--workdir', '--report'))]
  command = ' '.join(['python -m experiments.soak'] + shown)
  revision = subprocess.run(
    ['git', 'rev-parse', '--short', 'HEAD'], cwd=ROOT, capture_output=True, text=True
  ).stdout.strip()
  lines = [
    '## Soak',
    '',
    f'`{command}`, {datetime.date.today()}, commit {revision or "?"} plus the working tree, '
    f'{os.cpu_count()} CPU cores shared with other work (load average {load:.1f} at the start, '
    f'{os.getloadavg()[0]:.1f} at the end). {minutes:.1f} minutes of {_CONFIG.value} '
    f'(a checkpoint every {_CHECKPOINT_SECONDS.value:.0f} s'
    + ('; the starts share a JAX compilation cache' if _COMPILE_CACHE.value else '')
    + f'): {len(trainers)} starts reached '
    f'step {max(ours) if ours else 0}; the reference run, never stopped until the end (status '
    f'{ref_code}), reached step {ref_steps}.',
    '',
    '| check | result | |',
    '|---|---|---|',
  ]
  lines += [f'| {name} | {words} | {"pass" if ok else "FAIL"} |' for name, ok, words in checks]
  lines += ['', f'Verdict: {"PASS" if passed else "FAIL"}.']
  if ref_code != EXIT_PREEMPTED:
    lines += [f'The reference run ended with status {ref_code}: {ref_err[-500:]!r}']
  return '\n'.join(lines) + '\n', passed


def _write_report(path: str, report: str, note: str) -> None:
  with open(path) as f:
    text = f.read()
  section = report.rstrip('\n') + '\n\n' + note + '\n'
  match = re.search(r'^## Soak\n.*?(?=^## |\Z)', text, flags=re.M | re.S)
  if match:
    text = (
      text[: match.start()]
      + section
      + ('\n' if match.end() < len(text) else '')
      + text[match.end() :]
    )
  else:
    text = text.rstrip('\n') + '\n\n' + section
  with open(path, 'w') as f:
    f.write(text)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  workdir = _WORKDIR.value or tempfile.mkdtemp(prefix='sparrow_soak_')
  report, passed = soak(os.path.abspath(workdir))
  print(report)
  if _REPORT.value:
    note = (
      'What it checks: every SIGTERM ends the run with status 75 after its checkpoint, and the '
      "next start resumes from that step; the loss of every step equals the reference run's "
      '(within 1e-6); VmRSS, sampled every second, grows by at most 5% after warm-up (35 s after '
      'the first step, past the first checkpoint): the 90th percentile of the second half of the '
      'samples against that of the first half, for processes with 60 s or more of them; the '
      'workdirs hold only config.json, git_revision.txt, revisions.jsonl, metrics.jsonl, '
      'tokenizer/, tensorboard/ (event files) and checkpoints/ (the kept steps, no temp dirs).'
    )
    if _MINUTES.value < 20:
      note += (
        f'\n\nThis was a short run ({_MINUTES.value:g} minutes, a SIGTERM every '
        f'{_KILL_EVERY.value:g} s) on a shared machine. The full soak, run by hand and not in CI, '
        'is `python -m experiments.soak`: 20 minutes with a SIGTERM every 2 minutes. It rewrites '
        'this section.'
      )
    else:
      note += '\n\nIt is run by hand, not in CI, and rewrites this section.'
    _write_report(os.path.join(ROOT, _REPORT.value), report, note)
  if not _WORKDIR.value:
    shutil.rmtree(workdir, ignore_errors=True)
    shutil.rmtree(workdir + '_logs', ignore_errors=True)
  sys.exit(0 if passed else 1)


if __name__ == '__main__':
  app.run(main)
