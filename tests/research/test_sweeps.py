"""Sweeps and reports end to end on tiny configs; rerun skips; bad input; the verdict rules."""

import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from scipy import stats

from research import estimates, report, spec, sweeps, verdicts
from research import results as results_lib
from research import rules as rules_lib

_TINY_SWEEP = """
def get_sweep(scale):
  return dict(
    name='tiny',
    claim='scaled attention logits end with a lower eval loss',
    base='configs/gpt_tiny.py',
    overrides={
      'model.d_model': 16, 'model.num_heads': 2, 'model.d_ff': 32, 'model.num_layers': 1,
      'data.tokenizer': 'byte', 'data.max_length': 16, 'data.batch_size': 4,
      'data.eval_batch_size': 4, 'data.num_train_examples': 64, 'data.num_eval_examples': 8,
      'train.steps': 2 * scale, 'train.log_every': 1, 'train.eval_every': 2,
      'train.checkpoint_every': 2, 'train.eval_decode_examples': 0, 'optim.warmup_steps': 1,
      'train.head_entropy_every': 2, 'train.induction_every': 2,
    },
    variants={'scaled': {}, 'unscaled': {'model.attention_scale': False}},
    metrics=['eval.loss', 'train.loss'],
    rules=[dict(kind='less', metric='eval.loss', a='scaled', b='unscaled', rel_margin=0.0)],
    plots=[dict(kind='scatter', x='params', y='eval.loss', title='loss against parameters')],
  )
"""


def _sweep_file(tmp_path, text=_TINY_SWEEP):
  path = tmp_path / 'tiny_sweep.py'
  path.write_text(text)
  return str(path)


def _git(repo, *args):
  return subprocess.run(
    ['git', '-C', str(repo), '-c', 'user.name=t', '-c', 'user.email=t@t', *args],
    capture_output=True, text=True, check=True,
  ).stdout.strip()  # fmt: skip


def _clean_repo(path):
  """A git checkout with one commit, standing in for the source tree: (its dir, HEAD sha)."""
  path.mkdir(parents=True, exist_ok=True)
  _git(path, 'init', '-q')
  (path / 'model.py').write_text('x = 1\n')
  _git(path, 'add', '.')
  _git(path, 'commit', '-qm', 'one')
  return str(path), _git(path, 'rev-parse', 'HEAD')


def _lines(workdir):
  with open(os.path.join(workdir, 'results.jsonl')) as f:
    return [json.loads(line) for line in f]


# End to end ------------------------------------------------------------------------------------
@pytest.fixture(scope='module')
def finished(tmp_path_factory):
  """A 2-variant, 2-step sweep, run once for the tests below: (sweep file, workdir, results)."""
  tmp_path = tmp_path_factory.mktemp('sweep')
  path = _sweep_file(tmp_path)
  workdir = str(tmp_path / 'out')
  source, sha = _clean_repo(tmp_path / 'source')
  results = sweeps.run_sweep(
    spec.load_sweep(path), workdir, seeds=1, log=lambda _: None, source_dir=source
  )
  return path, workdir, results, sha


def test_two_variant_sweep_writes_results_and_curves(finished):
  _, workdir, results, sha = finished
  assert [(r['variant'], r['seed'], r['status']) for r in results] == [
    ('scaled', 0, 'ok'),
    ('unscaled', 0, 'ok'),
  ]
  lines = _lines(workdir)
  assert [line['metrics'] for line in lines] == [r['metrics'] for r in results]
  for line in lines:
    assert {'variant', 'seed', 'config', 'metrics', 'curve', 'wall_time_s', 'params'} <= set(line)
    assert line['params'] > 0 and line['flops_per_token'] > 0 and line['wall_time_s'] > 0
    assert line['metrics']['params'] == line['params']
    assert line['config']['train']['steps'] == 2
    assert math.isfinite(line['metrics']['eval.loss'])
    assert line['git_revision'] == sha  # the clean source checkout's HEAD
    # The curve is the run's own metrics.jsonl; nothing repeats it or the line.
    assert line['curve'] == os.path.join(line['run_dir'], 'metrics.jsonl')
    curve = results_lib.read_curve(os.path.join(workdir, line['run_dir']))
    assert [h['step'] for h in curve['train']] == [1, 2] and curve['eval'][-1]['step'] == 2
    files = os.listdir(os.path.join(workdir, line['run_dir']))
    assert 'curve.json' not in files and 'result.json' not in files
    assert 'config.json' in files  # resuming needs it; .gitignore keeps it out of docs/results
  # Head entropy went to TensorBoard during training (train.head_entropy_every).
  events = os.path.join(workdir, 'scaled', 'seed_0', 'tensorboard')
  data = b''.join(open(os.path.join(events, name), 'rb').read() for name in os.listdir(events))
  assert b'head_entropy/blocks.0.attn/head_1' in data
  # So did the induction telemetry, also into the run's curve (train.induction_every).
  assert b'telemetry/induction.layer_0.head_1' in data
  probe = results_lib.read_curve(os.path.join(workdir, 'scaled', 'seed_0'))['induction']
  assert [p['step'] for p in probe] == [1, 2]
  assert all(0 <= p[f'{k}.layer_0.head_{h}'] <= 1 for p in probe for k in ('induction',
             'previous_token') for h in (0, 1))  # fmt: skip
  assert all(math.isfinite(p['induction.loss']) for p in probe)
  assert lines[0]['config']['model']['attention_scale'] is True
  assert lines[1]['config']['model']['attention_scale'] is False


def test_report_has_plots_table_and_the_verdict_of_the_rule(finished):
  _, workdir, results, sha = finished
  text = open(report.write_report(workdir)).read()
  for png in ('curves.png', 'metrics.png', 'plot_0.png'):
    assert os.path.getsize(os.path.join(workdir, png)) > 1000
    assert f']({png})' in text  # relative links: readable on GitHub as it is
  assert (
    '| variant | N | d_model | d_ff | h | d_k | P_drop | ε_ls | train steps | PPL (dev) |' in text
  )
  assert '| scaled | 1 | 16 | 32 | 2 | 8 | 0 | 0 | 2 |' in text
  # The verdict is the rule applied to the recorded numbers.
  a, b = (r['metrics']['eval.loss'] for r in results)
  had = verdicts.REPRODUCED if a < b else verdicts.NOT_REPRODUCED
  assert f'**Verdict: {verdicts.INCONCLUSIVE}.**' in text  # one seed: no verdict either way
  assert f'1 seed: a verdict needs 3; had it counted: {had}, ' in text
  assert f'Code: commit `{sha}` (every run).' in text
  assert f'scaled eval.loss = {verdicts.fmt(a)} < unscaled eval.loss = {verdicts.fmt(b)}' in text
  assert report.summary(workdir)['status'] == verdicts.INCONCLUSIVE


def test_rerun_skips_finished_runs(finished):
  path, workdir, results, sha = finished
  before = _lines(workdir)
  messages = []
  # Nothing to run: no tree check (this checkout may be dirty), the lines stay as they are.
  again = sweeps.run_sweep(spec.load_sweep(path), workdir, seeds=1, log=messages.append)
  assert 'sweep tiny: 2 runs, 2 already finished' in messages
  assert [r['metrics'] for r in again] == [r['metrics'] for r in results]
  assert _lines(workdir) == before
  # A finished run of another config is not silently reused.
  with pytest.raises(ValueError, match='holds a finished run scaled seed 0 of another config .*'
                     'train.steps'):  # fmt: skip
    sweeps.run_sweep(spec.load_sweep(path, scale=2), workdir, log=lambda _: None)


def test_interrupted_run_resumes_from_its_checkpoint(finished):
  path, workdir, _, sha = finished
  run = os.path.join(workdir, 'scaled', 'seed_0')
  kept = [r for r in _lines(workdir) if r['variant'] != 'scaled']  # as if stopped at checkpoint 2
  with open(os.path.join(workdir, 'results.jsonl'), 'w') as f:
    f.write(''.join(json.dumps(r) + '\n' for r in kept))
  longer = spec.load_sweep(path, scale=2)  # 4 steps: resumes at step 2
  result = sweeps.execute_run(longer, 'scaled', 0, workdir, revision=sha)
  assert [h['step'] for h in results_lib.read_curve(run)['train']] == [1, 2, 3, 4]
  assert result['status'] == 'ok' and result['config']['train']['steps'] == 4
  assert sorted(os.listdir(os.path.join(run, 'checkpoints'))) == ['2', '4']
  assert sweeps.finished_result(longer, 'scaled', 0, workdir) == result
  lines = results_lib.write_results(workdir)  # sweep order again, one line per run
  assert [(r['variant'], r['config']['train']['steps']) for r in lines] == [
    ('scaled', 4),
    ('unscaled', 2),
  ]


@pytest.mark.slow
def test_parallel_workers_give_the_same_results(tmp_path, finished):
  path, _, results, sha = finished
  workdir = str(tmp_path / 'parallel')
  messages = []
  source, sha = _clean_repo(tmp_path / 'source')
  parallel = sweeps.run_sweep(
    spec.load_sweep(path), workdir, parallel=2, log=messages.append, source_dir=source
  )
  assert [r['git_revision'] for r in parallel] == [sha, sha]
  for line in parallel:  # each worker checked the same source checkout, clean
    with open(os.path.join(workdir, line['run_dir'], 'revisions.jsonl')) as f:
      assert [(r['revision'], r['dirty']) for r in map(json.loads, f)] == [(sha, False)]
  assert sum(m.startswith('started ') for m in messages) == 2
  assert [r['metrics']['eval.loss'] for r in parallel] == pytest.approx(
    [r['metrics']['eval.loss'] for r in results], rel=1e-5
  )
  assert os.path.exists(os.path.join(workdir, 'scaled', 'seed_0', 'log.txt'))


# Bad input -------------------------------------------------------------------------------------
def test_missing_sweep_file_is_one_clear_error(tmp_path):
  with pytest.raises(ValueError, match=r"sweep file .*nope.py' does not exist; available sweeps"):
    spec.load_sweep(str(tmp_path / 'nope.py'))


def test_override_of_a_key_the_base_lacks_is_an_error_before_anything_runs(tmp_path):
  text = _TINY_SWEEP.replace("'model.attention_scale': False", "'model.atention_scale': False")
  with pytest.raises(ValueError, match="overrides 'model.atention_scale', which is not a key"):
    spec.load_sweep(_sweep_file(tmp_path, text))
  text = _TINY_SWEEP.replace("'train.steps'", "'training.steps'")
  with pytest.raises(ValueError, match="the config has no 'training'"):
    spec.load_sweep(_sweep_file(tmp_path, text))
  assert not os.path.exists(tmp_path / 'out')


def test_bad_values_and_rules_are_errors_at_load(tmp_path):
  text = _TINY_SWEEP.replace("'model.num_heads': 2", "'model.num_heads': 3")
  with pytest.raises(ValueError, match='num_heads=3 does not divide d_model=16'):
    spec.load_sweep(_sweep_file(tmp_path, text))
  text = _TINY_SWEEP.replace("b='unscaled'", "b='unscailed'")
  with pytest.raises(ValueError, match="names variant 'unscailed', which the sweep does not have"):
    spec.load_sweep(_sweep_file(tmp_path, text))


def test_unknown_variant_requested_is_an_error(tmp_path):
  sweep = spec.load_sweep(_sweep_file(tmp_path))
  with pytest.raises(ValueError, match="unknown variant 'big' of sweep 'tiny'; its variants are"):
    sweeps.run_sweep(sweep, str(tmp_path / 'out'), variants=['big'])
  assert not os.path.exists(tmp_path / 'out')


def test_report_over_an_empty_workdir_is_one_clear_error(tmp_path):
  with pytest.raises(ValueError, match='no results.jsonl in .*: nothing to report'):
    report.write_report(str(tmp_path))


def test_cli_bad_input_prints_one_error_line(tmp_path):
  for module, args, message in [
    ('sweep', [f'--sweep={tmp_path}/none.py', f'--workdir={tmp_path}/w'], "error: sweep file '"),
    ('report', [f'--workdir={tmp_path}'], 'error: no results.jsonl in'),
  ]:
    out = subprocess.run(
      [sys.executable, '-m', f'experiments.{module}', *args], capture_output=True, text=True
    )
    assert out.returncode == 2 and out.stderr.count('error:') == 1, out.stderr
    assert out.stderr.startswith(message), out.stderr


def test_every_committed_sweep_file_loads_and_checks(monkeypatch):
  # The nulls' overrides are still applied to each base config (a bad key fails here); what the
  # generated tasks score is test_nulls.py's business (about 2 s a task), so each scores a number.
  fixed = {'uniform': 5.0, 'chance': 0.01, 'unigram': 4.0, 'chain': 3.0}
  monkeypatch.setattr(spec.nulls, 'task_losses', lambda config: dict(fixed))
  paths = spec.available_sweeps()
  names = {os.path.basename(p)[:-3] for p in paths}
  assert names == {
    'scaling', 'heads', 'positions', 'extrapolation', 'warmup', 'label_smoothing', 'dropout',
    'norm_placement', 'attention_memory', 'remat', 'model_scaling', 'cross_attention_alignment',
    'bidirectional_vs_causal', 'default_recipe', 'long_context', 'rope_scaling_vs_long_training',
    'induction', 'output_init', 'emergence', 'data_repetition', 'ood_generalization',
    'residual_and_norm', 'recall_mqar',
  }  # fmt: skip
  for path in paths:
    sweep = spec.load_sweep(path)  # every key, model, rule and null checked
    assert sweep.rules and sweep.claim
    assert sweep.nulls, f'{path} declares no null: what a model that learns nothing scores'


def test_axes_make_the_product_of_variants(tmp_path):
  text = _TINY_SWEEP.replace(
    "variants={'scaled': {}, 'unscaled': {'model.attention_scale': False}},",
    "axes={'scale': {'scaled': {}, 'unscaled': {'model.attention_scale': False}},"
    " 'norm': {'pre': {}, 'post': {'model.norm_placement': 'post'}}},",
  )
  text = text.replace("a='scaled', b='unscaled'", "a='scaled_pre', b='unscaled_post'")
  sweep = spec.load_sweep(_sweep_file(tmp_path, text))
  assert sweep.all_variants == ['scaled_pre', 'scaled_post', 'unscaled_pre', 'unscaled_post']
  config = spec.resolve_config(sweep, 'unscaled_post', seed=2)
  assert config.model.attention_scale is False and config.model.norm_placement == 'post'
  assert config.seed == 2


def test_final_metrics_of_a_curve():
  losses = [5.0, 4.0, 3.0, 3.5, 2.0, 1.9, 1.8, 1.7, 1.6, 1.5]
  curve = {
    'train': [{'step': i + 1, 'loss': x, 'perplexity': math.exp(x)} for i, x in enumerate(losses)],
    'eval': [{'step': 10, 'loss': 1.4, 'accuracy': 0.5}],
  }
  m = results_lib.final_metrics(curve)
  assert m['train.loss'] == 1.5 and m['train.loss_final'] == 1.5
  assert m['train.nll'] == pytest.approx(1.5)
  assert m['train.loss_rise'] == pytest.approx(0.5)  # 3.0 -> 3.5
  assert m['eval.loss'] == 1.4 and m['eval.accuracy'] == 0.5
  curve['train'][3]['loss'] = math.nan
  assert results_lib.final_metrics(curve)['train.loss_rise'] == math.inf


# Verdict rules on synthetic numbers ------------------------------------------------------------
def _status(rule, table):
  return verdicts.evaluate(rule, table).status


R, N, X = verdicts.REPRODUCED, verdicts.NOT_REPRODUCED, verdicts.NOT_RUN
I = verdicts.INCONCLUSIVE  # noqa: E741


def test_less_and_greater_judge_the_effects_interval_over_seeds_or_a_relative_margin():
  table = {'a': {'loss': [1.0, 1.1, 0.9]}, 'b': {'loss': [2.0, 2.1, 1.9]}}
  less = dict(kind='less', metric='loss', a='a', b='b')
  assert _status(less, table) == R
  assert _status({**less, 'kind': 'greater'}, table) == N
  noisy = {'a': {'loss': [1.0, 3.0, 0.5]}, 'b': {'loss': [2.0, 2.1, 1.9]}}
  assert _status(less, noisy) == I  # the means differ, but the interval spans 0
  reversed_ = {'a': {'loss': [3.0, 3.1, 2.9]}, 'b': {'loss': [2.0, 2.1, 1.9]}}
  assert _status(less, reversed_) == N  # the other way round, beyond the noise
  # The least effect that counts: 1 +- 0.29 (Welch, df 4) clears 0.5 but not 0.9.
  assert _status({**less, 'rel_margin': 0.25}, table) == R
  assert _status({**less, 'rel_margin': 0.45}, table) == I
  assert _status({**less, 'rel_margin': 0.7}, table) == N  # shown smaller than claimed
  one_seed = {'a': {'loss': [1.95]}, 'b': {'loss': [2.0]}}  # gap 0.05
  assert _status(less, one_seed) == R  # > 2% of 2.0 = 0.04, the default one-seed margin
  assert _status({**less, 'rel_margin': 0.05}, one_seed) == N  # < 5% of 2.0 = 0.1
  diverged = {'a': {'loss': [1.0]}, 'b': {'loss': [math.inf]}}
  assert _status(less, diverged) == R
  verdict = verdicts.evaluate(less, table)
  assert 'a loss = 1 ± 0.1 < b loss = 2 ± 0.1: effect b - a = 1, 95% interval' in verdict.text
  low, high = verdict.numbers['low'], verdict.numbers['high']
  half = stats.t.ppf(0.975, 4) * math.sqrt(2 * 0.01 / 3)  # equal spreads: Welch's df is 4
  assert (low, high) == (pytest.approx(1 - half), pytest.approx(1 + half))
  assert _status(less, {'a': {'loss': [1.0]}}) == X
  # A count that is 0 at every seed of both arms (no spike anywhere): no spread, no verdict; for
  # an exact measurement the tie is a measured absence of the effect.
  none = {'a': {'spikes': [0, 0, 0]}, 'b': {'spikes': [0, 0, 0]}}
  spikes = dict(kind='greater', metric='spikes', a='a', b='b')
  assert _status(spikes, none) == I and _status({**spikes, 'exact': 'counted'}, none) == N


def test_equal_arms_at_three_seeds_pass_less_at_its_one_sided_level():
  """Equal arms at 3 seeds: the interval's lower end clears 0 in about 2.5% of 2000 draws (a
  one-sided test at 2.5%); the band of 2 pooled stds it replaces held in 3.5% of 200,000."""
  rng = np.random.default_rng(1)
  rule = dict(kind='less', metric='m', a='a', b='b')
  held = [
    _status(
      rule, {'a': {'m': list(rng.standard_normal(3))}, 'b': {'m': list(rng.standard_normal(3))}}
    )
    == R
    for _ in range(2000)
  ]
  assert 0.015 <= np.mean(held) <= 0.035


def test_one_seed_relative_margin_boundary():
  table = {'a': {'loss': [1.95]}, 'b': {'loss': [2.0]}}
  verdict = verdicts.evaluate(dict(kind='less', metric='loss', a='a', b='b'), table)
  assert verdict.numbers['margin'] == pytest.approx(0.04) and verdict.status == R


def test_a_verdict_on_fewer_than_three_seeds_is_inconclusive_unless_the_rule_is_exact():
  rule = dict(kind='less', metric='mib', a='full', b='none', text='remat saves memory')
  one = {'full': {'mib': [10.0]}, 'none': {'mib': [20.0]}}
  (verdict,) = verdicts.judge([rule], one)[1]
  assert verdict.status == I and verdict.text.startswith('1 seed: a verdict needs 3; had it ')
  assert 'had it counted: reproduced' in verdict.text
  (verdict,) = verdicts.judge([{**rule, 'b': 'full', 'a': 'none'}], one)[1]
  assert verdict.status == I and 'had it counted: not reproduced' in verdict.text  # either way
  exact = {**rule, 'exact': rules_lib.COMPILED_MEMORY}
  assert verdicts.judge([exact], one)[1][0].status == R
  two = {'full': {'mib': [10.0, 10.0]}, 'none': {'mib': [20.0, 20.0]}}
  assert verdicts.judge([rule], two)[1][0].text.startswith('2 seeds: a verdict needs 3')
  assert verdicts.judge([exact], two)[1][0].status == R
  varies = {'full': {'mib': [10.0, 11.0]}, 'none': {'mib': [20.0, 20.0]}}
  (verdict,) = verdicts.judge([exact], varies)[1]
  assert verdict.status == I and 'marked exact, but its seeds differ' in verdict.text
  three = {'full': {'mib': [10.0, 10.5, 9.5]}, 'none': {'mib': [20.0, 20.5, 19.5]}}
  assert verdicts.judge([rule], three)[1][0].status == R
  with pytest.raises(ValueError, match='exact=True must say why'):
    rules_lib.check_rule({**rule, 'exact': True})


def test_a_gap_that_holds_with_an_interval_wider_than_itself_needs_five_seeds():
  rule = dict(kind='less', metric='m', a='a', b='b')
  wide = {'a': {'m': [1.0, 1.2, 0.8]}, 'b': {'m': [1.6, 2.0, 1.7]}}  # 0.77, interval 0.30-1.23
  assert _status(rule, wide) == R
  (verdict,) = verdicts.judge([rule], wide)[1]
  assert verdict.status == I and verdict.text.startswith(
    'its 95% interval is wider than its effect at 3 seeds: it needs 5; had it counted: reproduced'
  )
  five = {'a': {'m': [1.0, 1.2, 0.8, 1.1, 0.9]}, 'b': {'m': [1.6, 2.0, 1.7, 1.9, 1.8]}}
  assert verdicts.judge([rule], five)[1][0].status == R  # 0.8, interval 0.57-1.03
  narrow = {'a': {'m': [1.0, 1.1, 0.9]}, 'b': {'m': [2.0, 2.1, 1.9]}}  # 1, interval 0.71-1.29
  assert verdicts.judge([rule], narrow)[1][0].status == R
  against = {'a': {'m': [2.0, 2.2, 1.7]}, 'b': {'m': [1.0, 1.2, 0.8]}}  # fails: counts at 3
  assert verdicts.judge([rule], against)[1][0].status == N


def test_variance_greater_is_an_f_test_that_equal_spreads_pass_5_percent_of_the_time():
  """Its null is a generator: two variants of equal spread at 3 seeds each. Over 2000 draws the
  rule holds in 5% of them (the F-test's level), where comparing the two sample stds held in half;
  a spread 20 times larger (400 in variance) holds nearly always, and 3 times (9) is inconclusive
  as often as not."""
  rng = np.random.default_rng(0)

  def rate(scale: float, status: str) -> float:
    hits = 0
    for _ in range(2000):
      table = {
        'a': {'m': list(scale * rng.standard_normal(3))},
        'b': {'m': list(rng.standard_normal(3))},
      }
      hits += _status(dict(kind='variance_greater', metric='m', a='a', b='b'), table) == status
    return hits / 2000

  assert 0.035 <= rate(1.0, R) <= 0.065  # 5% within 3 binomial std of 2000 draws
  draws = rng.standard_normal((2000, 2, 3))
  assert 0.45 <= np.mean(draws[:, 0].std(-1) > draws[:, 1].std(-1)) <= 0.55  # the old rule's
  assert rate(20.0, R) >= 0.95
  assert rate(3.0, I) >= 0.4
  table = {'a': {'m': [1.0, 3.0, 2.0]}, 'b': {'m': [2.5, 2.6, 2.4]}}
  verdict = verdicts.evaluate(dict(kind='variance_greater', metric='m', a='a', b='b'), table)
  assert verdict.numbers['needed'] == pytest.approx(19.0)  # F(0.95; 2, 2) = 0.95 / 0.05
  assert 'variance ratio 100 (95% interval 2.564-3900)' in verdict.text  # 100/39, 100*39


def test_variance_ordering_monotone_and_thresholds():
  table = {
    'a': {'m': [1.0, 3.0, 2.0], 'x1': [1.0], 'x2': [2.0], 'x4': [3.0]},
    'b': {'m': [2.5, 2.6, 2.4]},
    'c': {'m': [5.0]},
  }
  assert _status(dict(kind='variance_greater', metric='m', a='a', b='b'), table) == R
  assert _status(dict(kind='variance_greater', metric='m', a='b', b='a'), table) == N
  assert _status(dict(kind='variance_greater', metric='m', a='c', b='a'), table) == X  # one seed
  assert _status(dict(kind='ordering', metric='m', variants=['a', 'b', 'c']), table) == R
  assert _status(dict(kind='ordering', metric='m', variants=['c', 'b']), table) == N
  assert (
    _status(dict(kind='ordering', metric='m', variants=['c', 'b'], direction='decreasing'), table)
    == R
  )
  assert _status(dict(kind='monotone', variant='a', metrics=['x1', 'x2', 'x4']), table) == R
  assert _status(dict(kind='monotone', variant='a', metrics=['x4', 'x1']), table) == N
  assert _status(dict(kind='at_least', metric='m', variants=['a', 'c'], value=2.0), table) == R
  assert _status(dict(kind='at_most', metric='m', variants=['a', 'c'], value=2.0), table) == N
  # every_seed: the worst seed decides, not the mean (a's seeds are 1, 2, 3: mean 2).
  low = dict(kind='at_least', metric='m', variants=['a'], value=1.5)
  assert _status(low, table) == R and _status({**low, 'every_seed': True}, table) == N
  verdict = verdicts.evaluate({**low, 'every_seed': True, 'value': 1.0}, table)
  assert verdict.status == R and verdict.numbers == {'a': 1.0} and 'lowest m' in verdict.text
  high = dict(kind='at_most', metric='m', variants=['a'], value=2.5, every_seed=True)
  assert _status(high, table) == N and _status({**high, 'value': 3.0}, table) == R


def test_power_law_fit_ratio_best_close_and_no_worse():
  table = {f'v{n}': {'params': [n], 'loss': [10.0 * n**-0.3]} for n in (10, 100, 1000, 10000)}
  fit = dict(kind='fit_power_law', x='params', y='loss', slope_sign=-1)
  verdict = verdicts.evaluate(fit, table)
  assert verdict.status == R and verdict.numbers['slope'] == pytest.approx(-0.3)
  assert verdict.numbers['r2'] == pytest.approx(1.0)
  assert _status({**fit, 'slope_sign': 1}, table) == N
  assert _status({**fit, 'slope_between': (-0.2, 0.0)}, table) == N
  within = {'xla': {f'mib_{t}': [t**2 / 100] for t in (256, 512, 1024)}}
  rule = dict(kind='fit_power_law', variant='xla', xs=[256, 512, 1024],
              metrics=['mib_256', 'mib_512', 'mib_1024'], slope_between=(1.8, 2.2))  # fmt: skip
  assert _status(rule, within) == R
  assert _status({**rule, 'variant': 'pallas'}, within) == X
  times = {'full': {'step_ms': [125.0]}, 'none': {'step_ms': [100.0]}}
  ratio = dict(kind='ratio_between', metric='step_ms', a='full', b='none', low=1.2, high=1.3)
  assert _status(ratio, times) == R
  assert _status({**ratio, 'high': 1.24}, times) == N
  scores = {'h1': {'eval.loss': [2.0], 'eval.bleu': [50.0]}, 'h4': {'eval.loss': [1.0],
            'eval.bleu': [60.0]}}  # fmt: skip
  assert _status(dict(kind='best', metric='eval.loss', expect=['h4']), scores) == R
  assert _status(dict(kind='best', metric='eval.bleu', expect=['h4']), scores) == R  # higher
  assert _status(dict(kind='worst', metric='eval.loss', expect=['h4']), scores) == N
  tie = {'h4': {'eval.loss': [1.0]}, 'h1': {'eval.loss': [1.0]}}  # the expected one listed first
  assert _status(dict(kind='best', metric='eval.loss', expect=['h4']), tie) == N
  assert 'h4 = h1 tie' in verdicts.evaluate(dict(kind='worst', metric='eval.loss', expect=['h4']),
                                            tie).text  # fmt: skip
  close = dict(kind='close', metric='eval.bleu', a='h1', b='h4', tolerance=5.0)
  assert _status(close, scores) == N and _status({**close, 'tolerance': 10.0}, scores) == R
  no_worse = dict(kind='no_worse', metric='eval.bleu', a='h1', b='h4', tolerance=1.0)
  assert _status(no_worse, scores) == N and _status({**no_worse, 'a': 'h4', 'b': 'h1'}, scores) == R


def test_no_worse_with_seeds_asks_the_interval_to_clear_the_tolerance():
  """With 3 seeds a side, no_worse is a non-inferiority test on Welch's 95% interval: arms whose
  spread is much larger than the tolerance are inconclusive (equal arms hold in under 5% of 500
  draws), a clearly better A holds, a clearly worse one fails."""
  rule = dict(kind='no_worse', metric='eval.loss', a='a', b='b', tolerance=0.02)
  noisy = {'a': {'eval.loss': [2.1, 2.3, 2.5]}, 'b': {'eval.loss': [2.2, 2.4, 2.6]}}
  assert _status(rule, noisy) == I  # a's mean is lower, but by less than the noise
  precise = {'a': {'eval.loss': [2.30, 2.31, 2.29]}, 'b': {'eval.loss': [2.40, 2.41, 2.39]}}
  assert _status(rule, precise) == R
  assert _status({**rule, 'a': 'b', 'b': 'a'}, precise) == N
  verdict = verdicts.evaluate(rule, precise)
  low, high = estimates.welch_interval([2.30, 2.31, 2.29], [2.40, 2.41, 2.39])
  half = 2.776 * 0.01 * math.sqrt(2 / 3)  # t(0.975; 4 df, Welch's for equal spreads) x the se
  assert (low, high) == pytest.approx((-0.1 - half, -0.1 + half), abs=1e-3)
  assert '95% interval' in verdict.text and verdict.numbers['high'] == pytest.approx(high)
  rng = np.random.default_rng(1)
  held = [
    _status(rule, {'a': {'eval.loss': list(2 + 0.1 * rng.standard_normal(3))},
                   'b': {'eval.loss': list(2 + 0.1 * rng.standard_normal(3))}}) == R
    for _ in range(500)
  ]  # fmt: skip
  assert np.mean(held) < 0.05  # equal arms, spread 0.1: the tolerance 0.02 is never shown


def test_a_generator_null_gives_a_rules_false_positive_rate_and_a_loose_rule_does_not_count():
  """A null that draws random decreasing curves at the recorded sizes: a power-law fit with
  r2 >= 0.9 holds on a real power law and on many of the draws too (so it holds by
  construction); a rule asking for the law's own slope holds on few draws and counts."""
  from research import nulls

  sizes = [f'd{w}' for w in (8, 16, 32, 64, 128, 256, 512)]
  table = {
    v: {'params': [float(w * w)] * 3, 'loss': [1.5 + 2 * (w * w) ** -0.5] * 3}
    for v, w in zip(sizes, (8, 16, 32, 64, 128, 256, 512), strict=True)
  }  # 3 seeds; fmt: skip
  null = dict(
    name='random decreasing',
    reason='curves that only fall',
    draws=200,
    generator='decreasing_curves',
    args={'metric': 'loss', 'variants': sizes},
  )
  nulls.check_nulls([null], [], sizes, ['loss', 'params'])
  loose = dict(kind='fit_power_law', x='params', y='loss', slope_sign=-1, floor=1.5, min_r2=0.9)
  strict = {**loose, 'slope_between': (-0.52, -0.48), 'min_r2': 0.999}
  _, (held, counted) = verdicts.judge([loose, strict], table, nulls=[null])
  assert held.status == verdicts.BY_CONSTRUCTION and 'of 200 draws (more than 5%' in held.null
  assert counted.status == R and 'of 200 draws (at most 5%: it counts)' in counted.null
  assert verdicts.false_positive_rate(strict, table, null) <= 0.05
  for bad, message in [({'generator': 'nope'}, 'is not one of decreasing_curves'),
                       ({'draws': 10}, 'must be an int >= 100')]:  # fmt: skip
    with pytest.raises(ValueError, match=message):
      nulls.check_nulls([{**null, **bad}], [], sizes, ['loss', 'params'])


def test_overall_status_and_rule_checks():
  assert verdicts.overall([]) == X
  make = lambda s: verdicts.Verdict(s, '', {})
  assert verdicts.overall([make(R), make(X)]) == R
  assert verdicts.overall([make(R), make(N)]) == N
  with pytest.raises(ValueError, match="rule kind='lesser' is not valid; choose one of less"):
    rules_lib.check_rule({'kind': 'lesser'})
  with pytest.raises(ValueError, match="needs the key 'b'"):
    rules_lib.check_rule({'kind': 'less', 'metric': 'm', 'a': 'x'})
  with pytest.raises(ValueError, match="unknown key 'margin'"):
    rules_lib.check_rule({'kind': 'less', 'metric': 'm', 'a': 'x', 'b': 'y', 'margin': 1})


def _three_seeds(rows):
  """Recorded results of each (variant, metrics) at seeds 0-2, every number 1% apart."""
  return [
    {'variant': v, 'seed': k, 'status': 'ok', 'metrics': {m: x * (1 + 0.01 * (k - 1))
                                                          for m, x in metrics.items()}}
    for v, metrics in rows
    for k in range(3)
  ]  # fmt: skip


def test_a_claim_that_fails_one_rule_still_names_the_rules_that_held():
  results = _three_seeds([('a', {'eval.loss': 1.0}), ('b', {'eval.loss': 2.0})])
  rules = [
    dict(kind='less', metric='eval.loss', a='a', b='b', text='a ends better'),
    dict(kind='less', metric='eval.loss', a='b', b='a', text='b ends better'),
  ]
  status, note, lines = report._verdict_lines({'claim': 'c', 'rules': rules}, results)
  assert status == verdicts.NOT_REPRODUCED
  assert note == '1 of 2 rules held: a ends better'
  assert lines[2] == f'**Verdict: {verdicts.NOT_REPRODUCED}.** {note} (see below).'
  status, note, _ = report._verdict_lines({'claim': 'c', 'rules': rules[:1]}, results)
  assert (status, note) == (verdicts.REPRODUCED, '')


def test_a_rule_that_its_condition_filters_out_is_not_called_one_that_could_not_run():
  """A `where` that leaves out an arm (the data exist) and a variant that was never recorded get
  their own notes: 'not compared' and 'could not run here'."""
  results = _three_seeds([('warm', {'loss': 0.5}), ('cold', {'loss': 2.9})])
  for r in results:
    r['metrics']['learned'] = int(r['variant'] == 'warm')
  learned = {'metric': 'learned', 'value': 1}
  rules = [
    dict(kind='less', metric='loss', a='warm', b='cold', where=learned, text='filtered'),
    dict(kind='greater', metric='loss', a='cold', b='warm', text='cold fails to learn'),
    dict(kind='less', metric='loss', a='warm', b='absent', text='never run'),
  ]
  status, note, lines = report._verdict_lines({'claim': 'c', 'rules': rules}, results)
  assert status == verdicts.REPRODUCED
  assert note == (
    '1 of 3 rules could not run here: no verdict on them; 1 of 3 rules not compared: an arm '
    "they name fails the rule's condition at every seed, so no verdict on them"
  )
  assert any(line.startswith('1. **not run**') and 'not compared: cold' in line for line in lines)


def test_the_report_shows_each_rules_null_and_calls_a_sweep_vacuous_without_a_counted_rule():
  results = _three_seeds([('full', {'acc': 1.0}), ('window', {'acc': 0.04})])
  rules = [
    dict(kind='at_most', metric='acc', variants=['window'], value=0.1, text='window at chance'),
    dict(kind='greater', metric='acc', a='full', b='window', text='full recalls more'),
  ]
  guess = dict(name='guess', reason='sees no pair', values={'full': {'acc': 0.04},
                                                            'window': {'acc': 0.04}})  # fmt: skip
  meta = {'claim': 'c', 'rules': rules, 'nulls': [guess]}
  status, note, lines = report._verdict_lines(meta, results)
  assert (status, note) == (
    verdicts.REPRODUCED,
    '1 of 2 rules hold by construction and do not count',
  )
  assert '- **guess**: sees no pair' in lines
  held = 'Null: guess: holds, acc <= 0.1 for each of window 0.04.'
  assert any(line.startswith('1. **holds by construction**') and held in line for line in lines)
  assert any(
    line.startswith('2. **reproduced**') and 'Null: guess: fails' in line for line in lines
  )
  status, note, _ = report._verdict_lines({**meta, 'rules': rules[:1]}, results)
  assert status == verdicts.VACUOUS
  _, _, lines = report._verdict_lines({'claim': 'c', 'rules': rules}, results)
  assert 'The sweep declares no null: no rule is checked against one that learns nothing.' in lines


def test_preconditions_load_with_the_sweep_and_show_in_the_report(tmp_path):
  pre = (
    "    preconditions=[dict(name='learns', kind='at_most', metric='eval.loss', "
    "variants=['scaled'], value=1.5)],\n"
  )
  text = _TINY_SWEEP.replace('    plots=[', pre + '    plots=[')
  sweep = spec.load_sweep(_sweep_file(tmp_path, text))
  assert sweep.preconditions[0]['name'] == 'learns'
  for bad, message in (
    ("metric='eval.loss', variants", "names metric 'eval.acc', which the sweep does not record"),
    ("variants=['scaled']", "names variant 'big', which the sweep does not have"),
  ):
    wrong = "metric='eval.acc', variants" if 'metric' in bad else "variants=['big']"
    with pytest.raises(ValueError, match=message):
      spec.load_sweep(_sweep_file(tmp_path, text.replace(bad, wrong)))
  results = [
    {'variant': v, 'seed': s, 'status': 'ok', 'metrics': {'eval.loss': x + 0.01 * s}}
    for v, x in (('scaled', 2.0), ('unscaled', 3.0))
    for s in range(3)
  ]
  meta = {'claim': 'c', 'rules': list(sweep.rules), 'preconditions': list(sweep.preconditions)}
  status, note, lines = report._verdict_lines(meta, results)
  assert status == verdicts.INCONCLUSIVE  # scaled < unscaled, but the model never learned
  assert note.startswith('precondition not met: learns')
  assert any(line.startswith('- **learns: fails**') for line in lines)
  assert any("1. **inconclusive at this budget**: precondition 'learns' does not hold" in line
             for line in lines)  # fmt: skip
  meta['preconditions'][0]['value'] = 2.5
  assert report._verdict_lines(meta, results)[0] == verdicts.REPRODUCED


def _rejudgeable_copy(finished, tmp_path):
  """(the sweep file, a copy of the finished runs, a sweep-file path the copy's sweep.json
  names): rejudging the copy reads whatever the test writes at that path."""
  original, done, _, _ = finished
  workdir, path = tmp_path / 'runs', str(tmp_path / 'tiny_sweep.py')
  shutil.copytree(done, workdir)
  meta = json.loads((workdir / 'sweep.json').read_text())
  (workdir / 'sweep.json').write_text(json.dumps({**meta, 'path': path}))
  return original, workdir, path


def test_rejudge_applies_the_sweep_files_current_rules_to_recorded_runs(finished, tmp_path):
  original, workdir, path = _rejudgeable_copy(finished, tmp_path)
  shutil.copy(original, path)
  numbers = [r['metrics'] for r in results_lib.read_results(str(workdir))]
  text = open(report.write_report(str(workdir))).read()
  assert '--rejudge' not in text
  # The sweep file now requires a loss no 2-step run reaches: the same runs become
  # inconclusive, and the report names the revision of the rules.
  pre = (
    "    preconditions=[dict(name='learns', kind='at_most', metric='eval.loss', "
    "variants=['scaled'], value=0.01)],\n"
  )
  text = _TINY_SWEEP.replace('    plots=[', pre + '    plots=[')
  text = text.replace("metrics=['eval.loss', 'train.loss'],", "metrics=['eval.loss'],")
  with open(path, 'w') as f:
    f.write(text)
  revision = sweeps.rejudge(str(workdir), allow_dirty=True)
  meta = json.loads((workdir / 'sweep.json').read_text())
  assert meta['preconditions'][0]['name'] == 'learns' and meta['rules_revision'] == revision
  assert meta['metrics'] == ['eval.loss']  # the compared columns follow the file too
  text = open(report.write_report(str(workdir))).read()
  assert f'**Verdict: {verdicts.INCONCLUSIVE}.**' in text
  assert f'applies the rules of `{path}` at revision `{revision}`' in text
  assert [r['metrics'] for r in results_lib.read_results(str(workdir))] == numbers


def test_rejudge_takes_new_plots_and_a_lines_plot_draws_one_line_per_arm(finished, tmp_path):
  original, workdir, path = _rejudgeable_copy(finished, tmp_path)
  lines = (
    "dict(kind='lines', metric='eval.loss', x=[1, 2], "
    "lines={'both': ['scaled', 'unscaled'], 'gap': ['scaled', 'missing']}), "
  )
  with open(path, 'w') as f:
    f.write(_TINY_SWEEP.replace('    plots=[', '    plots=[' + lines))
  sweeps.rejudge(str(workdir), allow_dirty=True)
  assert [p['kind'] for p in json.loads((workdir / 'sweep.json').read_text())['plots']] == [
    'lines',
    'scatter',
  ]
  text = open(report.write_report(str(workdir))).read()
  assert '](plot_0.png)' in text and '](plot_1.png)' in text
  assert os.path.getsize(workdir / 'plot_0.png') > 1000
  with pytest.raises(ValueError, match=r"lines plot: 'a' has 1 variants for \[1, 2\]"):
    report.check_plots([dict(kind='lines', metric='m', x=[1, 2], lines={'a': ['v']})])


def test_groups_load_with_the_sweep_and_the_report_names_each_ones_pick(tmp_path):
  group = "    groups={'best': {'best_of': ['scaled', 'unscaled'], 'metric': 'eval.loss'}},\n"
  rule = "dict(kind='less', metric='eval.loss', a='best', b='unscaled', rel_margin=0.0)"
  text = _TINY_SWEEP.replace('    plots=[', group + '    plots=[')
  text = text.replace('rules=[', f'rules=[{rule}, ')
  sweep = spec.load_sweep(_sweep_file(tmp_path, text))
  assert sweep.groups == {'best': {'best_of': ['scaled', 'unscaled'], 'metric': 'eval.loss'}}
  assert sweeps.sweep_metadata(sweep, 1)['groups'] == sweep.groups
  with pytest.raises(ValueError, match="group 'best' names variant 'big'"):
    spec.load_sweep(_sweep_file(tmp_path, text.replace("['scaled', 'unscaled']", "['big']")))
  with pytest.raises(ValueError, match="names variant 'worst'"):  # a rule names no group
    spec.load_sweep(_sweep_file(tmp_path, text.replace("a='best'", "a='worst'")))
  results = _three_seeds([('scaled', {'eval.loss': 2.0}), ('unscaled', {'eval.loss': 3.0})])
  meta = {'claim': 'c', 'rules': list(sweep.rules), 'groups': sweep.groups}
  status, _, lines = report._verdict_lines(meta, results)
  assert '- **best** = scaled: best eval.loss of scaled, unscaled' in lines
  assert status == verdicts.REPRODUCED


def test_a_threshold_on_the_interval_of_the_mean_holds_fails_or_is_inconclusive():
  # Ratios over 3 seeds: mean 1.25 with a 95% interval of 1.25 +- 4.30 * 0.01 / sqrt(3).
  table = {'full': {'ratio': [1.24, 1.25, 1.26]}, 'wide': {'ratio': [1.1, 1.25, 1.4]}}
  floor = dict(kind='at_least', metric='ratio', variants=['full'], value=1.2, interval=True)
  cap = {**floor, 'kind': 'at_most', 'value': 1.3}
  assert _status(floor, table) == R and _status(cap, table) == R
  assert _status({**floor, 'value': 1.3}, table) == N  # the whole interval is below 1.3
  assert _status({**cap, 'value': 1.2}, table) == N
  assert _status({**floor, 'variants': ['wide']}, table) == I  # 0.88 to 1.62: across 1.2
  verdict = verdicts.evaluate(floor, table)
  assert verdict.numbers == {'full': pytest.approx(1.25)}
  half = stats.t.ppf(0.975, 2) * 0.01 / math.sqrt(3)
  assert f'full {verdicts.fmt(1.25 - half)} to {verdicts.fmt(1.25 + half)}' in verdict.text
