"""The source revision results record, a dirty tree refused, results.jsonl under parallel
writers, and regenerating a results root (with the one table of seeds the README agrees with)."""

import glob
import json
import os
import re
import subprocess
import sys

import pytest

from experiments import regenerate as regenerate_cli
from research import report, spec, sweeps
from research import results as results_lib
from transformer.training import provenance

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_ONE_RUN_SWEEP = """
GPU_SCALE = 2

def get_sweep(scale):
  return dict(
    name='one',
    claim='a 2-step run ends with a finite loss',
    base='configs/gpt_tiny.py',
    overrides={
      'model.d_model': 16, 'model.num_heads': 2, 'model.d_ff': 32, 'model.num_layers': 1,
      'data.tokenizer': 'byte', 'data.max_length': 16, 'data.batch_size': 4,
      'data.eval_batch_size': 4, 'data.num_train_examples': 64, 'data.num_eval_examples': 8,
      'train.steps': 2 * scale, 'train.log_every': 1, 'train.eval_every': 2 * scale,
      'train.checkpoint_every': 2 * scale, 'train.eval_decode_examples': 0,
      'optim.warmup_steps': 1,
    },
    variants={'base': {}},
    rules=[dict(kind='at_most', metric='eval.loss', variants=['base'], value=100.0)],
  )
"""


def _git(repo, *args):
  return subprocess.run(
    ['git', '-C', str(repo), '-c', 'user.name=t', '-c', 'user.email=t@t', *args],
    capture_output=True, text=True, check=True,
  ).stdout.strip()  # fmt: skip


def _repo(path):
  """A git checkout with a committed model.py: (its dir, HEAD sha)."""
  path.mkdir(parents=True)
  _git(path, 'init', '-q')
  (path / 'model.py').write_text('x = 1\n')
  (path / 'docs' / 'results' / 'old').mkdir(parents=True)
  (path / 'docs' / 'results' / 'old' / 'report.md').write_text('old\n')
  _git(path, 'add', '.')
  _git(path, 'commit', '-qm', 'one')
  return str(path), _git(path, 'rev-parse', 'HEAD')


# The revision and the dirty tree ---------------------------------------------------------------
def test_changes_to_the_source_count_and_results_do_not(tmp_path):
  source, sha = _repo(tmp_path / 'repo')
  workdir = os.path.join(source, 'runs', 'mine')
  assert sweeps.checked_revision([workdir], False, source) == sha
  # Regenerating writes under docs/results and the sweep's own workdir: still clean.
  (tmp_path / 'repo' / 'docs' / 'results' / 'old' / 'report.md').write_text('new\n')
  (tmp_path / 'repo' / 'docs' / 'results' / 'new').mkdir()
  (tmp_path / 'repo' / 'docs' / 'results' / 'new' / 'results.jsonl').write_text('{}\n')
  os.makedirs(workdir)
  open(os.path.join(workdir, 'results.jsonl'), 'w').close()
  assert sweeps.source_state([workdir], source) == (sha, [])
  # A changed and an untracked source file are named; --allow_dirty records '<sha>-dirty'.
  (tmp_path / 'repo' / 'model.py').write_text('x = 2\n')
  (tmp_path / 'repo' / 'extra.py').write_text('')
  assert sweeps.source_state([workdir], source) == (sha, ['extra.py', 'model.py'])
  with pytest.raises(ValueError, match=r'uncommitted changes \(extra.py, model.py\); commit'):
    sweeps.checked_revision([workdir], False, source)
  assert sweeps.checked_revision([workdir], True, source) == f'{sha}-dirty'
  # Outside git the revision is unknown: refused too, unless allowed.
  with pytest.raises(ValueError, match='not in a git checkout'):
    sweeps.checked_revision([], False, str(tmp_path))
  assert sweeps.checked_revision([], True, str(tmp_path)) == 'unknown'


def test_a_sweep_does_not_start_from_a_dirty_tree(tmp_path):
  source, _ = _repo(tmp_path / 'repo')
  (tmp_path / 'repo' / 'model.py').write_text('x = 2\n')
  path = tmp_path / 'one.py'
  path.write_text(_ONE_RUN_SWEEP)
  workdir = str(tmp_path / 'out')
  with pytest.raises(ValueError, match=r'uncommitted changes \(model.py\)'):
    sweeps.run_sweep(spec.load_sweep(str(path)), workdir, log=lambda _: None, source_dir=source)
  assert not os.path.exists(workdir)  # refused before anything was written


def _revisions(run):
  with open(os.path.join(run, provenance.REVISIONS)) as f:
    return [json.loads(line) for line in f]


def test_a_runs_revision_leaves_out_its_sweeps_output_as_the_sweep_does(tmp_path):
  source, sha = _repo(tmp_path / 'repo')
  path = tmp_path / 'one.py'
  path.write_text(_ONE_RUN_SWEEP)
  # The sweep writes inside the checkout, untracked, beside changes under docs/results.
  workdir = os.path.join(source, 'sweeps', 'one')
  os.makedirs(os.path.join(workdir, 'earlier'))
  open(os.path.join(workdir, 'earlier', 'metrics.jsonl'), 'w').close()
  (tmp_path / 'repo' / 'docs' / 'results' / 'old' / 'report.md').write_text('new\n')
  assert provenance.source_state(source)[1] == [
    'docs/results/old/report.md', 'sweeps/one/earlier/metrics.jsonl'
  ]  # fmt: skip
  sweep = spec.load_sweep(str(path))
  (line,) = sweeps.run_sweep(sweep, workdir, log=lambda _: None, source_dir=source)
  run = os.path.join(workdir, 'base', 'seed_0')
  assert line['git_revision'] == sha
  assert [(r['revision'], r['dirty'], r['start_step']) for r in _revisions(run)] == [
    (sha, False, 0)
  ]  # the run's own check saw only the sweep's output (and its own files): clean
  with open(os.path.join(run, 'git_revision.txt')) as f:
    assert f.read() == sha + '\n'
  # A change elsewhere is a dirty run too (the sweep ran only because it was allowed), and
  # another revision than the folder's results: refused before anything runs, unless mixing
  # is asked for.
  (tmp_path / 'repo' / 'model.py').write_text('x = 2\n')
  with pytest.raises(ValueError, match=f'holds results of revision {sha}, and this checkout is '
                     f'{sha}-dirty: .* --allow_mixed'):  # fmt: skip
    sweeps.run_sweep(sweep, workdir, seeds=2, log=lambda _: None, allow_dirty=True,
                     source_dir=source)  # fmt: skip
  assert not os.path.exists(os.path.join(workdir, 'base', 'seed_1'))
  lines = sweeps.run_sweep(sweep, workdir, seeds=2, log=lambda _: None, allow_dirty=True,
                           source_dir=source, allow_mixed=True)  # fmt: skip
  assert [r['git_revision'] for r in lines] == [sha, f'{sha}-dirty']
  second = _revisions(os.path.join(workdir, 'base', 'seed_1'))
  assert [(r['revision'], r['dirty']) for r in second] == [(sha, True)]


_MEASURED_SWEEP = """
def measure(ctx):
  return {'measured': 1.0}

def get_sweep(scale):
  return dict(
    name='measured',
    claim='every run names its code',
    base='configs/gpt_tiny.py',
    overrides={
      'model.d_model': 16, 'model.num_heads': 2, 'model.d_ff': 32, 'model.num_layers': 1,
      'data.tokenizer': 'byte', 'data.max_length': 16, 'data.batch_size': 4,
      'data.eval_batch_size': 4, 'data.num_train_examples': 64, 'data.num_eval_examples': 8,
      'train.steps': 2, 'train.log_every': 1, 'train.eval_every': 2, 'train.checkpoint_every': 2,
      'train.eval_decode_examples': 0, 'optim.warmup_steps': 1,
    },
    variants={'base': {}},
    eval_variants={'again': {'from': 'base', 'overrides': {}}},
    train=TRAIN,
    measure='measure',
    metrics=['measured'],
  )
"""


def test_every_run_records_its_code_trained_evaluated_or_measured_only(tmp_path):
  """revisions.jsonl in every run directory: a start of training, and a measure line for a
  measure, an eval variant (no training of its own) and a sweep that does not train."""
  source, sha = _repo(tmp_path / 'repo')
  for train in (True, False):
    path = tmp_path / f'measured_{train}.py'
    text = _MEASURED_SWEEP.replace('TRAIN', str(train))
    path.write_text(text if train else text.replace('    eval_variants=', '    # '))
    workdir = str(tmp_path / f'out_{train}')
    lines = sweeps.run_sweep(spec.load_sweep(str(path)), workdir, log=lambda _: None,
                             source_dir=source)  # fmt: skip
    assert {r['variant'] for r in lines} == ({'base', 'again'} if train else {'base'})
    for line in lines:
      found = _revisions(os.path.join(workdir, line['run_dir']))
      kinds = [
        ('train' if 'start_step' in r else 'measure', r['revision'], r['dirty']) for r in found
      ]
      trained = train and line['variant'] == 'base'
      assert kinds == [('train', sha, False)] * trained + [('measure', sha, False)], line['variant']
    if train:  # a measure line is no start of training
      assert [e['start_step'] for e in provenance.revision_history(workdir + '/base/seed_0')] == [0]


# results.jsonl ---------------------------------------------------------------------------------
_APPEND_MANY = """
import sys
from research import results
workdir, worker, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for i in range(count):  # lines far longer than one write of a pipe or a page
  results.append_result(workdir, {'variant': f'w{worker}', 'seed': i, 'pad': 'x' * 20000})
"""


@pytest.mark.slow  # about 9 s of concurrent processes
def test_parallel_writers_lose_and_interleave_no_line(tmp_path):
  workdir = str(tmp_path)
  with open(tmp_path / 'results.jsonl', 'w') as f:
    f.write('{"variant": "w0", "seed": 99, "pa')  # a line a kill cut short
  # Separate processes (not fork: JAX is multithreaded here), as sweep workers are.
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get('PYTHONPATH', '')]))
  workers = [
    subprocess.Popen([sys.executable, '-c', _APPEND_MANY, workdir, str(w), '40'], env=env)
    for w in range(4)
  ]
  assert [w.wait(timeout=120) for w in workers] == [0] * 4
  lines = results_lib.read_results(workdir)  # the cut line is skipped, every other one whole
  assert sorted((r['variant'], r['seed']) for r in lines) == [
    (f'w{w}', i) for w in range(4) for i in range(40)
  ]
  with open(tmp_path / 'sweep.json', 'w') as f:
    json.dump({'variants': {'w3': {}, 'w1': {}, 'w0': {}, 'w2': {}}}, f)
  results_lib.append_result(workdir, {'variant': 'w1', 'seed': 0, 'pad': 'rerun'})
  ordered = results_lib.write_results(workdir)  # sweep order, the latest line of a run wins
  assert [(r['variant'], r['seed']) for r in ordered][:41] == [('w3', i) for i in range(40)] + [
    ('w1', 0)
  ]
  assert len(ordered) == 160 and ordered[40]['pad'] == 'rerun'
  assert results_lib.read_results(workdir) == ordered


# Reports name the commit -----------------------------------------------------------------------
def test_revision_note_says_plainly_when_runs_disagree_or_are_dirty():
  line = lambda revision: {'git_revision': revision}
  text, clean = report.revision_note([line('abc'), line('abc')])
  assert (text, clean) == ('Code: commit `abc` (every run).', True)
  text, clean = report.revision_note([line('abc-dirty')])
  assert not clean and 'commit `abc` with uncommitted changes' in text
  text, clean = report.revision_note([line('abc'), line('def'), line('def')])
  assert not clean and 'at 2 different revisions**: `abc` (1 run), `def` (2 runs)' in text
  text, clean = report.revision_note([line('abc'), {}])
  assert not clean and '(some dirty)' in text and '`unknown` (1 run)' in text


# Regeneration ----------------------------------------------------------------------------------
def test_regenerate_redoes_a_sweep_from_another_commit_and_keeps_one_from_this(tmp_path):
  source, sha = _repo(tmp_path / 'repo')
  sweeps_dir = tmp_path / 'sweeps'
  sweeps_dir.mkdir()
  (sweeps_dir / 'one.py').write_text(_ONE_RUN_SWEEP)
  root = tmp_path / 'results'
  (root / 'one' / 'base' / 'seed_0').mkdir(parents=True)  # as a sweep at an older commit left it
  (root / 'one' / 'sweep.json').write_text(json.dumps({'git_revision': 'abc123', 'scale': 1}))
  old_line = {'variant': 'base', 'seed': 0, 'git_revision': 'abc123'}
  (root / 'one' / 'results.jsonl').write_text(json.dumps(old_line) + '\n')
  messages = []
  kwargs = dict(log=messages.append, sweeps_dir=str(sweeps_dir), source_dir=source)
  index = sweeps.regenerate({'one': 1}, str(root), **kwargs)
  assert (
    f'removing {root}/one: its runs are from revision abc123 at scale 1, not {sha}'
    in ' '.join(messages)
  )
  assert [r['git_revision'] for r in results_lib.read_results(f'{root}/one')] == [sha]
  assert f'Code: commit `{sha}` (all 1 runs).' in open(index).read()
  assert f'Code: commit `{sha}` (every run).' in open(f'{root}/one/report.md').read()
  # At the same commit (after an interruption, say) the finished run is kept, not redone.
  messages.clear()
  sweeps.regenerate({'one': 1}, str(root), **kwargs)
  assert 'sweep one: 1 runs, 1 already finished' in messages
  assert not any(m.startswith('removing') for m in messages)
  # Bad input, each before anything runs.
  with pytest.raises(ValueError, match="unknown sweep 'two'; choose from one"):
    sweeps.regenerate({'one': 1}, str(root), only=['two'], **kwargs)
  (sweeps_dir / 'one.py').write_text(_ONE_RUN_SWEEP.replace('GPU_SCALE = 2', ''))
  with pytest.raises(ValueError, match="one.py' has GPU_SCALE=None; set a module-level"):
    sweeps.regenerate({'one': 1}, str(tmp_path / 'gpu'), gpu=True, **kwargs)
  (tmp_path / 'repo' / 'model.py').write_text('x = 3\n')
  with pytest.raises(ValueError, match=r'uncommitted changes \(model.py\)'):
    sweeps.regenerate({'one': 1}, str(root), **kwargs)
  assert not os.path.exists(tmp_path / 'gpu')


def _readme_and_docs() -> str:
  """README.md and docs/*.md, where the sweep commands are written."""
  pages = [os.path.join(ROOT, 'README.md')] + sorted(glob.glob(os.path.join(ROOT, 'docs', '*.md')))
  text = []
  for page in pages:
    with open(page) as f:
      text.append(f.read())
  return '\n'.join(text)


# Every sweep sets its GPU_SCALE, and must load at that scale.
_GPU_SCALED = tuple(sorted(regenerate_cli.SEEDS))  # fmt: skip


def test_gpu_scale_of_the_sweep_files(monkeypatch):
  # Checking a sweep file at GPU scale builds each task to compute its nulls (about 30 s in all);
  # test_nulls.py checks those, so here each null scores a fixed number.
  fixed = {'uniform': 5.0, 'chance': 0.01, 'unigram': 4.0, 'chain': 3.0}
  monkeypatch.setattr(spec, 'task_losses', lambda base, *overrides: dict(fixed))
  for path in spec.available_sweeps():
    name = os.path.basename(path)[:-3]
    try:
      scale = spec.gpu_scale(path)
    except ValueError:
      assert name not in _GPU_SCALED, f'{name} must set GPU_SCALE'
      continue
    assert spec.load_sweep(path, scale).scale == scale  # every key, model and rule checked


def test_the_readme_gpu_commands_use_each_sweeps_gpu_scale():
  readme = _readme_and_docs()
  pattern = (
    r'--sweep=(configs/sweeps/(\w+)\.py) --workdir=docs/results_gpu/(\w+) --seeds=(\d+) '
    r'--scale=(\d+)'
  )
  found = re.findall(pattern, readme)
  assert {name for _, name, *_ in found} >= set(_GPU_SCALED)
  for path, name, workdir, seeds, scale in found:
    plan = regenerate_cli.SEEDS[name]
    assert workdir == name
    assert int(seeds) in (plan.values() if isinstance(plan, dict) else [plan]), name
    assert int(scale) == spec.gpu_scale(os.path.join(ROOT, path)), name


def test_seed_passes_give_named_variants_more_seeds_and_the_rest_the_default():
  sweep = spec.load_sweep(os.path.join(ROOT, 'configs', 'sweeps', 'default_recipe.py'))
  assert sweeps.seed_passes(sweep, 3) == [(None, 3)]
  rest = [v for v in sweep.all_variants if v not in ('cos3e-3_w100', 'rsqrt')]
  assert rest  # the screened candidates
  plan = {'cos3e-3_w100': 5, 'rsqrt': 5, '*': 1}
  assert sweeps.seed_passes(sweep, plan) == [(rest, 1), (['cos3e-3_w100', 'rsqrt'], 5)]
  with pytest.raises(ValueError, match="unknown variant 'nope'"):
    sweeps.seed_passes(sweep, {'nope': 2})


def test_the_source_revision_is_that_of_the_checkout_holding_research():
  # A clone's own root: the revision a sweep records is that of the code that ran.
  assert os.path.samefile(sweeps.SOURCE_DIR, ROOT)
  head = subprocess.run(['git', '-C', ROOT, 'rev-parse', 'HEAD'], capture_output=True, text=True)
  assert sweeps.source_state()[0] == head.stdout.strip()


_TWO_VARIANT_SWEEP = _ONE_RUN_SWEEP.replace(
  "variants={'base': {}},",
  """variants={'base': {}, 'bad': {}},
    measure='measure_or_fail',""",
).replace(
  'GPU_SCALE = 2',
  """GPU_SCALE = 2

def measure_or_fail(ctx):
  if ctx.variant == 'bad':
    raise RuntimeError('this measurement broke')
  return {'measured': 1.0}""",
)


def test_preflight_runs_every_variant_a_few_steps_and_names_each_that_fails(tmp_path):
  (tmp_path / 'two.py').write_text(_TWO_VARIANT_SWEEP.replace("name='one'", "name='two'"))
  messages = []
  failed = sweeps.preflight([str(tmp_path / 'two.py')], str(tmp_path / 'w'), steps=3,
                            log=messages.append)  # fmt: skip
  assert failed == [('two', 'bad', 'RuntimeError: this measurement broke')]
  assert [m.split(':')[0] for m in messages] == ['two base', 'two bad']
  assert messages[0].startswith('two base: ok in ')
  assert messages[1].endswith('RuntimeError: this measurement broke')
  # Cut short: 3 steps (the file asks for 2 * scale), each logged, the last one evaluated.
  (line,) = results_lib.read_results(str(tmp_path / 'w' / 'two'))
  assert line['config']['train']['steps'] == 3 and line['metrics']['measured'] == 1.0
  curve = [json.loads(x) for x in open(tmp_path / 'w' / 'two' / line['curve'])]
  assert [r['step'] for r in curve if r['kind'] == 'train'] == [1, 2, 3]
  assert [r['step'] for r in curve if r['kind'] == 'eval'] == [3]
  # A name that is not a sweep is one error line before anything runs.
  out = subprocess.run(
    [sys.executable, '-m', 'experiments.regenerate', '--preflight', '--only=nope'],
    cwd=ROOT, capture_output=True, text=True, timeout=120,
  )  # fmt: skip
  assert out.returncode == 2 and out.stderr.strip().startswith("error: unknown sweep 'nope'")
