"""Every sweep, report and regenerate command that README, docs/ and the committed reports print
works on a fresh clone: its module and flags exist, the files it names exist, it does not ask
`experiments.sweep` to add runs to a committed folder (which holds runs of another commit, so it
refuses), and the re-render step runs on a copy of a committed folder in seconds."""

import glob
import os
import re
import shutil
import subprocess
import sys

import pytest

from experiments import regenerate as regenerate_cli
from research import report, spec
from research import results as results_lib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# A command may wrap across lines: its flags are whitespace-separated, newlines included.
_COMMAND = re.compile(
  r'python -m\s+experiments\.(sweep|report|regenerate)((?:\s+--[\w.]+(?:=[^\s`]+)?)*)'
)
_COMMITTED = [os.path.basename(os.path.dirname(p)) for p in sorted(glob.glob(
  os.path.join(ROOT, results_lib.RESULT_ROOTS[0], '*', results_lib.SWEEP_JSON)))]  # fmt: skip


def _pages() -> list[str]:
  """README, docs/*.md and every committed report, relative to the root."""
  pages = ['README.md', *sorted(glob.glob('docs/*.md', root_dir=ROOT))]
  return pages + sorted(glob.glob('docs/results*/*/report.md', root_dir=ROOT))


def _commands() -> list[tuple[str, str, dict[str, str]]]:
  """(page, module, {flag: value}) of every sweep, report and regenerate command printed."""
  found = []
  for page in _pages():
    with open(os.path.join(ROOT, page)) as f:
      for module, args in _COMMAND.findall(f.read()):
        flags = dict(a.partition('=')[::2] for a in args.split())
        found.append((page, module, {k.lstrip('-'): v for k, v in flags.items()}))
  return found


def _defined_flags(module: str) -> set[str]:
  """The flags an experiments module defines (read from its source: importing several would
  define the same absl flag twice), and those every entry point has."""
  with open(os.path.join(ROOT, 'experiments', f'{module}.py')) as f:
    names = set(re.findall(r"flags\.DEFINE_\w+\(\s*'(\w+)'", f.read()))
  return names | {'debug', 'help'}


def _placeholder(value: str) -> bool:
  """DIR, NAME, <name>, ... and runs/...: an example the reader fills in or creates."""
  return (
    value.isupper() or '...' in value or '<' in value or not value.startswith(('docs/', 'configs/'))
  )


def test_every_documented_command_names_real_flags_files_and_sweeps(monkeypatch):
  # Checking a sweep file computes its nulls from its generated task (about 2 s a task, 14 tasks);
  # what the nulls are is test_nulls.py's business, so here each null scores a fixed number.
  fixed = {'uniform': 5.0, 'chance': 0.01, 'unigram': 4.0, 'chain': 3.0}
  monkeypatch.setattr(spec, 'task_losses', lambda base, *overrides: dict(fixed))
  commands = _commands()
  modules = {m for _, m, _ in commands}
  assert modules == {'sweep', 'report', 'regenerate'}, modules
  for page, module, flags in commands:
    where = f'{page}: experiments.{module} {flags}'
    unknown = set(flags) - _defined_flags(module)
    assert not unknown, f'{where}: no flag {unknown}'
    if module == 'regenerate':
      for name in (flags.get('only') or '').split(','):
        assert not name or name == 'NAME' or name in regenerate_cli.SEEDS, where
      continue
    workdir = flags.get('workdir', '')
    committed = os.path.dirname(workdir) == results_lib.RESULT_ROOTS[0]
    if module == 'sweep':
      # A committed folder's runs should come from one commit, so its documented command is
      # `experiments.regenerate --only=NAME`; experiments.sweep refuses to add runs of another
      # commit to it without --allow_mixed (the report then lists the commits).
      assert not committed, f'{where}: use experiments.regenerate --only for a committed folder'
      sweep = spec.load_sweep(os.path.join(ROOT, flags['sweep']), int(flags.get('scale', 1)))
      for variant in (flags.get('variants') or '').split(','):
        assert not variant or variant in sweep.all_variants, where
    elif not _placeholder(workdir) and (committed or workdir == results_lib.RESULT_ROOTS[0]):
      # The committed results (a GPU run's folder appears once it has run).
      assert os.path.exists(os.path.join(ROOT, workdir)), f'{where}: no {workdir}'


def test_the_claims_table_reruns_every_sweep_with_its_seeds():
  assert set(regenerate_cli.SEEDS) == {os.path.basename(p)[:-3] for p in spec.available_sweeps()}
  with open(os.path.join(ROOT, 'docs', 'research.md')) as f:
    text = f.read()
  rows = dict(re.findall(r'`python -m experiments\.regenerate --only=(\w+)` \((\d+) seeds?', text))
  for name, plan in regenerate_cli.SEEDS.items():
    if isinstance(plan, int):
      assert rows.get(name) == str(plan), name
    else:  # some variants at more seeds than the rest
      assert f'--only={name}` ({max(plan.values())} seeds of ' in text, name


@pytest.mark.parametrize('name', _COMMITTED)
def test_each_committed_report_prints_commands_that_work_and_its_current_verdict(name):
  workdir = f'{results_lib.RESULT_ROOTS[0]}/{name}'
  with open(os.path.join(ROOT, workdir, 'report.md')) as f:
    text = f.read()
  assert f'python -m experiments.regenerate --only={name}\n' in text
  assert f'python -m experiments.report --workdir={workdir}\n' in text
  # What the re-render step writes from the recorded runs is what the committed report says.
  meta, results = results_lib.load_results(os.path.join(ROOT, workdir))
  _, _, lines = report._verdict_lines(meta, results)
  verdict = next(line for line in lines if line.startswith('**Verdict:'))
  assert verdict in text, f'{workdir}/report.md is stale: rerun its experiments.report command'


def test_the_rerender_command_runs_on_a_copy_of_a_committed_folder(tmp_path):
  source = os.path.join(ROOT, results_lib.RESULT_ROOTS[0], 'emergence')
  workdir = tmp_path / 'emergence'
  shutil.copytree(source, workdir, ignore=shutil.ignore_patterns('*.png', 'report.md'))
  out = subprocess.run(
    [sys.executable, '-m', 'experiments.report', f'--workdir={workdir}'],
    capture_output=True,
    text=True,
    cwd=ROOT,
  )
  assert out.returncode == 0, out.stderr
  written = (workdir / 'report.md').read_text()
  with open(os.path.join(source, 'report.md')) as f:
    committed = f.read()
  verdict = next(line for line in written.splitlines() if line.startswith('**Verdict:'))
  assert verdict in committed
  assert (workdir / 'metrics.png').exists() and (workdir / 'plot_0.png').exists()
  # Outside a results root the command to rerun is the sweep itself, into that folder.
  assert f'--sweep=configs/sweeps/emergence.py --workdir={workdir} --seeds=3' in written
