"""The per-run metrics (oscillation, learned, spikes) on hand-built curves; the rule options
`floor` (fit_power_law) and `where` (any rule); inconclusive verdicts (noise, chance,
preconditions) and rules that hold by construction (on a null), on numbers with known answers."""

import json
import math
import re

import numpy as np
import pytest

from research import nulls, verdicts
from research import results as results_lib
from research import rules as rules_lib

R, N, X = verdicts.REPRODUCED, verdicts.NOT_REPRODUCED, verdicts.NOT_RUN
I = verdicts.INCONCLUSIVE  # noqa: E741


def _curve(losses, nll=None, events=()):
  nll = losses if nll is None else nll
  train = [
    {'step': i + 1, 'loss': float(x), 'perplexity': float(np.exp(y))}
    for i, (x, y) in enumerate(zip(losses, nll))
  ]
  return {'train': train, 'eval': [], 'event': list(events)}


# Metrics from a run's curve --------------------------------------------------------------------
def test_oscillation_is_the_std_of_log_loss_changes_over_the_second_half():
  t = np.arange(200)
  a = 0.05
  zigzag = np.exp(-0.01 * t + a * (-1.0) ** t)  # a steady fall times a factor exp(+-a)
  m = results_lib.final_metrics(_curve(zigzag))
  # the 100 points of the second half have 99 changes -0.01 -+ 2a, alternating
  changes = -0.01 + 2 * a * (-1.0) ** (t[101:] + 1)
  assert changes.std(ddof=1) == pytest.approx(2 * a, rel=0.01)
  assert m['train.oscillation'] == pytest.approx(changes.std(ddof=1))
  # about the line of log(loss), the second half is -0.01 t +- a: a std of a (ddof = 2)
  assert m['train.oscillation_detrended'] == pytest.approx(a * math.sqrt(100 / 98), rel=1e-3)
  smooth = results_lib.final_metrics(_curve(np.exp(-0.01 * t)))
  assert smooth['train.oscillation'] == pytest.approx(0.0, abs=1e-9)  # the trend does not count
  assert smooth['train.oscillation_detrended'] == pytest.approx(0.0, abs=1e-9)
  slow = np.exp(0.2 * np.sin(2 * np.pi * t / 50))  # a slow swing: small steps, a large detour
  m = results_lib.final_metrics(_curve(slow))
  assert m['train.oscillation'] < 0.03 < 0.1 < m['train.oscillation_detrended']
  early = np.where(t < 100, zigzag * 3.0 ** ((-1.0) ** t), np.exp(-0.01 * t))
  assert results_lib.final_metrics(_curve(early))['train.oscillation'] < 1e-6  # first half only
  broken = np.exp(-0.01 * t)
  broken[150] = math.inf
  m = results_lib.final_metrics(_curve(broken))
  assert m['train.oscillation'] == m['train.oscillation_detrended'] == math.inf


def test_learned_and_learned_early_compare_the_cross_entropy_with_its_first_value():
  steps = 40
  falls = np.geomspace(6.0, 0.2, steps)  # below 6.0 / 4 before half way
  stuck = np.concatenate([[6.0], np.full(steps - 1, 3.1)])  # the plateau of post-LN, never < 1.5
  relapses = np.concatenate([np.linspace(6.0, 1.0, steps // 2), np.full(steps // 2, 3.0)])
  late = np.concatenate([np.full(steps // 2 + 1, 3.0), np.full(steps // 2 - 1, 1.0)])
  late[0] = 6.0
  got = {}
  for name, nll in [('falls', falls), ('stuck', stuck), ('relapses', relapses), ('late', late)]:
    m = results_lib.final_metrics(_curve(nll + 0.8, nll))  # loss: label-smoothed, above the nll
    got[name] = (m['train.learned'], m['train.learned_early'])
  assert got == {
    'falls': (1.0, 1.0),
    'stuck': (0.0, 0.0),
    'relapses': (0.0, 1.0),
    'late': (1.0, 0.0),
  }
  diverged = np.concatenate([np.linspace(6.0, 1.0, steps // 2), np.full(steps // 2, np.nan)])
  m = results_lib.final_metrics(_curve(diverged, diverged))
  assert (m['train.learned'], m['train.learned_early']) == (0.0, 1.0)


def test_spikes_count_the_loss_spike_events_the_loop_writes(tmp_path):
  lines = [
    {'step': 1, 'kind': 'train', 'loss': 3.0, 'perplexity': 20.0},
    {'step': 2, 'kind': 'event', 'event': 'loss_spike', 'loss': 9.0, 'ratio': 3.0},
    {'step': 3, 'kind': 'event', 'event': 'nonfinite'},
    {'step': 4, 'kind': 'event', 'event': 'loss_spike', 'loss': 8.0, 'ratio': 2.5},
    {'step': 4, 'kind': 'train', 'loss': 2.0, 'perplexity': 7.0},
  ]
  (tmp_path / 'metrics.jsonl').write_text(''.join(json.dumps(x) + '\n' for x in lines))
  curve = results_lib.read_curve(str(tmp_path))
  assert [e['step'] for e in curve['event']] == [2, 3, 4]
  assert results_lib.final_metrics(curve)['train.spikes'] == 2.0
  assert results_lib.final_metrics(curve)['train.nonfinite_skipped'] == 1.0
  assert results_lib.final_metrics(_curve([3.0, 2.0]))['train.spikes'] == 0.0
  assert results_lib.final_metrics(_curve([3.0, 2.0]))['train.nonfinite_skipped'] == 0.0


# fit_power_law with a floor --------------------------------------------------------------------
def _floor_table(floor=1.5, alpha=0.3):
  ns = np.geomspace(1e3, 1e6, 8)
  return {f'n{i}': {'n': [n], 'loss': [floor + 20.0 * n**-alpha]} for i, n in enumerate(ns)}


def test_power_law_above_a_fixed_floor_recovers_its_exponent():
  table = _floor_table()
  rule = dict(kind='fit_power_law', x='n', y='loss', slope_sign=-1, min_r2=0.99)
  plain = verdicts.evaluate(rule, table)  # the floor bends the log-log line
  assert plain.numbers['slope'] > -0.3 + 0.05 and plain.numbers['r2'] < 0.999
  fixed = verdicts.evaluate({**rule, 'floor': 1.5}, table)
  assert fixed.status == R and fixed.numbers['slope'] == pytest.approx(-0.3)
  assert fixed.numbers['r2'] == pytest.approx(1.0) and fixed.numbers['floor'] == 1.5
  assert '(loss - 1.5)' in fixed.text
  too_high = verdicts.evaluate({**rule, 'floor': 1.9}, table)  # the largest ns are below it
  assert too_high.status == N and 'not above the floor 1.9' in too_high.text


def test_power_law_with_a_free_floor_finds_it():
  table = _floor_table(floor=1.54, alpha=0.45)
  rule = dict(kind='fit_power_law', x='n', y='loss', slope_sign=-1, min_r2=0.99, floor='free')
  free = verdicts.evaluate(rule, table)
  assert free.status == R
  assert free.numbers['floor'] == pytest.approx(1.54, abs=0.005)
  assert free.numbers['slope'] == pytest.approx(-0.45, abs=0.02)
  assert 'E fitted = 1.54' in free.text
  with pytest.raises(ValueError, match="floor='x' must be a number or 'free'"):
    rules_lib.check_rule({**rule, 'floor': 'x'})


def test_a_flat_loss_is_no_falling_power_law():
  # A model that learns nothing scores the same loss at every size: slope 0 has no sign, with a
  # fixed floor or a fitted one (polyfit's roundoff once gave it one, so the null "held").
  ns = np.geomspace(1e3, 1e6, 7)
  table = {f'n{i}': {'n': [n], 'loss': [4.43]} for i, n in enumerate(ns)}
  rule = dict(kind='fit_power_law', x='n', y='loss', slope_sign=-1, min_r2=0.9)
  for floor in (1.54, 'free'):
    flat = verdicts.evaluate({**rule, 'floor': floor}, table)
    assert flat.status == N and flat.numbers['slope'] == 0.0, flat.text


# where: only the variants that pass a condition ------------------------------------------------
def _lr_table():
  # lr 1e-3: both arms learn at first; lr 1e-2: no_warmup never does
  return {
    'lr1e-3_warmup': {'learned_early': [1.0], 'spikes': [0.0], 'loss': [0.2]},
    'lr1e-3_no_warmup': {'learned_early': [1.0], 'spikes': [3.0], 'loss': [0.3]},
    'lr1e-2_warmup': {'learned_early': [1.0, 1.0], 'spikes': [1.0, 1.0], 'loss': [0.2, 0.2]},
    'lr1e-2_no_warmup': {'learned_early': [0.0, 1.0], 'spikes': [0.0, 0.0], 'loss': [3.1, 0.2]},
  }


def test_where_runs_a_rule_only_when_its_variants_pass():
  table, where = _lr_table(), {'metric': 'learned_early', 'value': 1}
  rule = dict(kind='greater', metric='spikes', a='lr1e-3_no_warmup', b='lr1e-3_warmup')
  verdict = verdicts.evaluate({**rule, 'where': where}, table)
  assert verdict.status == R and verdict.rule['where'] == where
  high = {**rule, 'a': 'lr1e-2_no_warmup', 'b': 'lr1e-2_warmup'}
  assert verdicts.evaluate(high, table).status == N  # without the condition: compared, fails
  skipped = verdicts.evaluate({**high, 'where': where}, table)  # one seed of no_warmup fails it
  assert skipped.status == X
  assert skipped.text == (
    'not compared: lr1e-2_no_warmup fails the condition learned_early = 1 at every seed'
  )
  assert verdicts.overall([verdict, skipped]) == R


def test_where_drops_failing_variants_from_lists():
  table, where = _lr_table(), {'metric': 'learned_early', 'value': 1}
  rule = dict(kind='at_most', metric='loss', variants=list(table), value=0.5)
  assert verdicts.evaluate(rule, table).status == N  # lr1e-2_no_warmup's mean is 1.65
  kept = verdicts.evaluate({**rule, 'where': where}, table)
  assert kept.status == R and set(kept.numbers) == set(table) - {'lr1e-2_no_warmup'}
  worst = dict(kind='worst', metric='loss', expect=['lr1e-2_no_warmup'])
  assert verdicts.evaluate(worst, table).status == R
  assert verdicts.evaluate({**worst, 'where': where}, table).status == N  # no longer among them
  for bad in ({'metric': 'learned_early'}, {'metric': 'm', 'value': 'yes'}, ['m', 1]):
    with pytest.raises(ValueError, match='must be'):
      rules_lib.check_rule({**rule, 'where': bad})


# Inconclusive verdicts -------------------------------------------------------------------------
def test_ordering_with_seeds_is_judged_against_their_noise():
  rule = dict(kind='ordering', metric='acc', variants=['w', 'lin', 'full'])
  clear = {'w': {'acc': [0.1, 0.11, 0.09]}, 'lin': {'acc': [0.5, 0.52, 0.48]},
           'full': {'acc': [0.9, 0.91, 0.89]}}  # fmt: skip
  assert verdicts.evaluate(rule, clear).status == R
  # The audit's case: 0.0376 < 0.0464 < 0.0537 with a std of ~0.005 per arm.
  close = {'w': {'acc': [0.032, 0.0376, 0.043]}, 'lin': {'acc': [0.041, 0.0464, 0.052]},
           'full': {'acc': [0.048, 0.0537, 0.059]}}  # fmt: skip
  verdict = verdicts.evaluate(rule, close)
  assert verdict.status == I and "w to lin is within the seeds' noise" in verdict.text
  backwards = {**clear, 'full': {'acc': [0.3, 0.31, 0.29]}}  # full falls below lin, clearly
  assert verdicts.evaluate(rule, backwards).status == N
  one_seed = {v: {'acc': m['acc'][1:2]} for v, m in close.items()}  # no noise estimate
  assert verdicts.evaluate(rule, one_seed).status == R
  monotone = dict(kind='monotone', variant='w', metrics=['a', 'b'])
  flat = {'w': {'a': [1.0, 1.2, 0.8], 'b': [1.1, 1.3, 0.9]}}
  assert verdicts.evaluate(monotone, flat).status == I


def test_values_at_chance_make_any_rule_inconclusive():
  # Chance is a null's value of the same variant and metric, not one number for all.
  declared = {'guess': {'full': {'acc': 1 / 26}, 'window': {'acc': 1 / 26}}}
  rule = dict(kind='greater', metric='acc', a='full', b='window', rel_margin=0.1, chance='guess')
  both = {'full': {'acc': [0.046]}, 'window': {'acc': [0.0376]}}
  assert verdicts.evaluate(rule, both, declared).status == R  # one seed: 0.046 is beyond 10% of it
  rule['chance_tolerance'] = 0.01  # the binomial standard error of ~400 answers
  verdict = verdicts.evaluate(rule, both, declared)
  assert (
    verdict.status == I
    and "at chance (the null 'guess')" in verdict.text
    and 'had it counted: reproduced' in (verdict.text)
  )
  learned = {'full': {'acc': [0.95]}, 'window': {'acc': [0.0376]}}
  assert verdicts.evaluate(rule, learned, declared).status == R
  # With seeds: within 2 standard errors of chance.
  seeded = {'full': {'acc': [0.03, 0.045, 0.04]}, 'window': {'acc': [0.035, 0.04, 0.037]}}
  assert verdicts.evaluate(rule, seeded, declared).status == I
  wide = {**rule, 'chance_tolerance': 0.2}
  assert verdicts.evaluate(wide, learned, declared).status == R  # 0.95 is still far from chance
  assert verdicts.evaluate({**wide, 'kind': 'less'}, both, declared).status == I
  # A null of its own per variant: full at 0.76 is at its null (elimination) here.
  elimination = {'e': {'full': {'acc': 0.76}, 'window': {'acc': 0.0376}}}
  at_its_null = {'full': {'acc': [0.755]}, 'window': {'acc': [0.0376]}}
  assert verdicts.evaluate({**rule, 'chance': 'e'}, at_its_null, elimination).status == I
  assert verdicts.evaluate(rule, at_its_null, declared).status == R  # far above 1/26
  with pytest.raises(ValueError, match='chance_tolerance needs chance'):
    verdicts.evaluate({'kind': 'less', 'metric': 'acc', 'a': 'x', 'b': 'y',
                       'chance_tolerance': 0.1}, both)  # fmt: skip
  with pytest.raises(ValueError, match="must name one of the sweep's nulls"):
    verdicts.evaluate({**rule, 'chance': 1 / 26}, both, declared)
  with pytest.raises(ValueError, match="chance='gone', which is not one of the sweep's nulls"):
    verdicts.evaluate({**rule, 'chance': 'gone'}, both, declared)


def test_a_rule_that_holds_on_a_null_holds_by_construction():
  table = {'full': {'acc': [1.0, 0.99, 1.0]}, 'lin': {'acc': [0.40, 0.41, 0.39]},
           'w': {'acc': [0.04, 0.05, 0.04]}}  # fmt: skip
  # Elimination (keep the bag of values, drop the answered ones) scores 0.40 without a lookup.
  declared = [
    dict(name='none', reason='sees nothing', values={v: {'acc': 1 / 26} for v in table}),
    dict(name='elim', reason='no lookup', values={v: {'acc': 0.40} for v in table}),
  ]
  window = dict(kind='at_most', metric='acc', variants=['w'], value=0.1)
  gap = dict(kind='greater', metric='acc', a='full', b='lin')
  above = dict(kind='at_least', metric='acc', variants=['lin'], value=0.35)
  _, found = verdicts.judge([window, gap, above], table, nulls=declared)
  assert [v.status for v in found] == [verdicts.BY_CONSTRUCTION, R, verdicts.BY_CONSTRUCTION]
  assert 'none: holds' in found[0].null and 'elim: fails' in found[0].null
  assert 'elim: holds' in found[2].null  # 0.40 >= 0.35 without any lookup
  assert 'none: fails' in found[1].null and 'elim: fails' in found[1].null
  assert verdicts.overall(found) == R  # one rule could have failed and did not
  assert verdicts.overall([found[0], found[2]]) == verdicts.VACUOUS
  assert verdicts.overall([found[0], verdicts.Verdict(N, '', {})]) == N
  # A rule fails on the data: a null that passes does not change that.
  _, (low,) = verdicts.judge([{**above, 'value': 0.5}], table, nulls=[{**declared[1], 'values': {
    'lin': {'acc': 0.6}}}])  # fmt: skip
  assert low.status == N and 'holds' in low.null
  # A null without the compared values says so; a sweep without declared too.
  _, (partial,) = verdicts.judge([gap], table, nulls=[{**declared[1], 'values': {'w': {'acc': 0}}}])
  assert partial.status == R and partial.null == 'no null records the values it compares'
  assert verdicts.judge([gap], table)[1][0].null == 'the sweep declares no null'


def test_nulls_are_checked_before_any_work():
  ok = dict(name='elim', reason='no lookup', values={'a': {'acc': 0.4}})
  nulls.check_nulls([ok], [dict(kind='less', metric='acc', a='a', b='b', chance='elim')],
                       ['a', 'b'], ['acc'])  # fmt: skip
  cases = [
    ([ok, ok], [], 'needs a name'),
    ([{**ok, 'reason': ' '}], [], "needs exactly 'name', 'reason'"),
    ([{**ok, 'values': {'c': {'acc': 0.4}}}], [], "names variant 'c'"),
    ([{**ok, 'values': {'a': {'loss': 0.4}}}], [], "names metric 'loss'"),
    ([{**ok, 'values': {'a': {'acc': 'x'}}}], [], "a acc='x' must be a number"),
    ([ok], [dict(kind='less', metric='acc', a='a', b='b', chance='guess')], 'nulls are: elim'),
  ]
  for declared, rules, message in cases:
    with pytest.raises(ValueError, match=message):
      nulls.check_nulls(declared, rules, ['a', 'b'], ['acc'])


def test_rel_margin_is_the_least_effect_that_counts_at_several_seeds():
  # Seeds agree closely: the effect 0.024 has a 95% interval of about 0.012 to 0.036, which clears
  # 0 but not the 10% of b (0.0401) that the rule may ask for.
  table = {'a': {'acc': [0.42, 0.425, 0.43]}, 'b': {'acc': [0.40, 0.401, 0.402]}}
  rule = dict(kind='greater', metric='acc', a='a', b='b')
  verdict = verdicts.evaluate(rule, table)
  assert verdict.status == R and 0 < verdict.numbers['low'] < 0.024 < verdict.numbers['high']
  verdict = verdicts.evaluate({**rule, 'rel_margin': 0.1}, table)
  assert verdict.status == N and verdict.numbers['margin'] == pytest.approx(0.0401)
  assert 'against a least effect of 10% of b = 0.0401: not above it' in verdict.text


def test_a_failed_precondition_makes_the_rules_that_need_it_inconclusive():
  table = {'full': {'acc': [0.3, 0.32, 0.31], 'loss': [2.0, 2.1, 1.9]},
           'window': {'acc': [0.04, 0.03, 0.05], 'loss': [2.5, 2.6, 2.4]}}  # fmt: skip
  learns = dict(name='full learns', kind='at_least', metric='acc', variants=['full'], value=0.9)
  trains = dict(name='trains', kind='at_most', metric='loss', variants=['full', 'window'],
                value=3.3)  # fmt: skip
  gap = dict(kind='greater', metric='acc', a='full', b='window', requires=['full learns'])
  loss = dict(kind='less', metric='loss', a='full', b='window', requires=['trains'])
  both = dict(kind='less', metric='loss', a='full', b='window')  # needs every precondition
  free = {**both, 'requires': []}  # depends on no precondition
  pre, found = verdicts.judge([gap, loss, both, free], table, [learns, trains])
  assert [v.status for v in pre] == [N, R]
  assert [v.status for v in found] == [I, R, I, R]
  assert "precondition 'full learns' does not hold" in found[0].text
  assert 'had it counted: reproduced' in found[0].text
  assert verdicts.overall(found) == I
  assert verdicts.overall([*found, verdicts.Verdict(N, '', {})]) == N
  pre, found = verdicts.judge([gap], {**table, 'full': {**table['full'], 'acc': [0.95] * 3}},
                              [learns])  # fmt: skip
  assert [v.status for v in pre + found] == [R, R]
  # A precondition that cannot be checked leaves its rules inconclusive too.
  _, found = verdicts.judge([gap], {'window': table['window']}, [learns])
  assert found[0].status == X  # the rule itself cannot run: not run, not inconclusive
  _, found = verdicts.judge([loss], table, [{**trains, 'variants': ['gone']}, learns])
  assert found[0].status == I and 'is not run' in found[0].text


def test_preconditions_are_checked_before_any_work():
  rules = [dict(kind='less', metric='loss', a='a', b='b', requires=['learns'])]
  ok = dict(name='learns', kind='at_least', metric='acc', variants=['a'], value=0.9)
  rules_lib.check_preconditions([ok], rules, ['a', 'b'], ['acc', 'loss'])
  cases = [
    ([{**ok, 'name': None}], rules, 'needs a name'),
    ([ok, ok], rules, "two preconditions are named 'learns'"),
    ([{**ok, 'metric': 'accuracy'}], rules, "names metric 'accuracy', which the sweep"),
    ([{**ok, 'variants': ['c']}], rules, "names variant 'c', which the sweep does not have"),
    ([ok], [{**rules[0], 'requires': ['trains']}], "requires precondition 'trains'"),
    ([ok], [{**rules[0], 'requires': 'learns'}], 'must be a list of precondition names'),
  ]
  for pre, rs, message in cases:
    with pytest.raises(ValueError, match=message):
      rules_lib.check_preconditions(pre, rs, ['a', 'b'], ['acc', 'loss'])


def test_largest_step_tells_a_jump_from_a_smooth_curve():
  sizes = ['s1', 's2', 's3', 's4', 's5']
  jump = dict(kind='largest_step', metric='exact', variants=sizes, at_least_share=0.5,
              min_step=0.3)  # fmt: skip
  smooth = dict(kind='largest_step', metric='nll', variants=sizes, at_most_share=0.5)

  def table(metric, means, noise=0.01):
    return {v: {metric: [m - noise, m, m + noise]} for v, m in zip(sizes, means)}

  # Exact match 0, 0.02, 0.05, 0.85, 0.9: the step s3 -> s4 is 0.8 of 0.9 in all.
  verdict = verdicts.evaluate(jump, table('exact', [0.0, 0.02, 0.05, 0.85, 0.9]))
  assert verdict.status == R and verdict.numbers['at'] == 's4'
  assert verdict.numbers['share'] == pytest.approx(0.8 / 0.9)
  # An even climb has no step above 0.25 of the total: no jump, but smooth.
  even = [0.1, 0.3, 0.5, 0.7, 0.9]
  assert verdicts.evaluate(jump, table('exact', even)).status == N
  assert verdicts.evaluate(smooth, table('nll', even[::-1])).status == R
  assert verdicts.evaluate(smooth, table('nll', [3.0, 2.95, 2.9, 1.0, 0.95])).status == N
  # A jump of the right share but below min_step fails; one inside the seeds' noise is unjudged.
  assert verdicts.evaluate(jump, table('exact', [0.0, 0.0, 0.0, 0.2, 0.2])).status == N
  noisy = table('exact', [0.0, 0.02, 0.05, 0.85, 0.9], noise=0.4)
  assert verdicts.evaluate(jump, noisy).status == I
  # Diminishing returns: the first step up is the largest.
  first = dict(kind='largest_step', metric='nll', variants=sizes, expect_at='s2')
  assert verdicts.evaluate(first, table('nll', [3.0, 2.0, 1.6, 1.5, 1.45])).status == R
  assert verdicts.evaluate(first, table('nll', [3.0, 2.8, 1.6, 1.5, 1.45])).status == N
  with pytest.raises(ValueError, match='needs at_least_share, at_most_share or expect_at'):
    rules_lib.check_rule(dict(kind='largest_step', metric='exact', variants=sizes))
  with pytest.raises(ValueError, match="expect_at='s1'; a step leads to one of s2, s3"):
    rules_lib.check_rule({**first, 'expect_at': 's1'})


def test_largest_step_per_e_fold_and_its_noise_band_judge_a_jump_and_a_smooth_curve_alike():
  sizes = ['s1', 's2', 's3', 's4', 's5']
  smooth = dict(kind='largest_step', metric='nll', variants=sizes, at_most_share=0.4)
  jump = dict(kind='largest_step', metric='nll', variants=sizes, at_least_share=0.5)

  def table(means, noise=0.01, params=(1, 2, 4, 8, 64)):
    return {
      v: {'nll': [m - noise, m, m + noise], 'params': [p] * 3}
      for v, m, p in zip(sizes, means, params)
    }

  # Linear in log params on a grid whose last step spans 3 doublings: the raw steps 1, 1, 1, 3
  # put half the change in the last; per e-fold every step is ln 2 and the share is 1/4.
  line = table([6.0, 5.0, 4.0, 3.0, 0.0])
  assert verdicts.evaluate(smooth, line).numbers['share'] == pytest.approx(0.5)
  assert verdicts.evaluate(smooth, line).status == N
  per_e_fold = verdicts.evaluate({**smooth, 'x': 'params'}, line)
  assert per_e_fold.status == R and per_e_fold.numbers['share'] == pytest.approx(0.25)
  assert per_e_fold.numbers['step'] == pytest.approx(-1 / math.log(2))
  # Steps 0.2, 0.2, 1.0, 0.2 (share 0.625) on an even grid: a clear jump, a clear failed smooth.
  means = [2.0, 1.8, 1.6, 0.6, 0.4]
  even = (1, 2, 4, 8, 16)
  assert verdicts.evaluate(jump, table(means, params=even)).status == R
  smooth_half = {**smooth, 'at_most_share': 0.5}
  assert verdicts.evaluate(smooth_half, table(means, params=even)).status == N
  # Std 0.25 per size: the share's bootstrap interval over seeds lies across 0.5, so neither the
  # jump nor the failed smooth is judged.
  noisy = table(means, noise=0.25, params=even)
  for rule in (jump, smooth_half):
    verdict = verdicts.evaluate(rule, noisy)
    low, high = map(float, re.search(r'interval is ([\d.]+) to ([\d.]+)', verdict.text).groups())
    assert verdict.status == I and low < 0.5 < high
  # Std 0.05: the interval (0.55 to 0.69) is clear of 0.5 again; std 0.1 (0.48 to 0.76) is not.
  assert verdicts.evaluate(smooth_half, table(means, noise=0.05, params=even)).status == N
  assert verdicts.evaluate(smooth_half, table(means, noise=0.1, params=even)).status == I
  # Without the x metric the rule is not run; a null is judged on the variants' own spacing.
  assert verdicts.evaluate({**smooth, 'x': 'flops'}, line).status == X
  null = dict(name='flat', reason='r', values={v: {'nll': 1.0} for v in sizes})
  _, [verdict] = verdicts.judge([{**jump, 'x': 'params'}], table(means, params=even), nulls=[null])
  assert verdict.status == R and 'flat: inconclusive' in verdict.null


def test_a_null_as_recorded_takes_the_runs_own_values_measured_before_training():
  # Measured at step 0, an init's statistics are what an untrained model scores: an ordering of
  # them follows from the init's definition.
  table = {'scaled': {'growth': [1.05, 1.07]}, 'plain': {'growth': [2.1, 2.2]}}
  same = {'growth': nulls.AS_RECORDED}
  at_init = dict(name='at init', reason='step 0', values={'scaled': same, 'plain': same})
  rule = dict(kind='ordering', metric='growth', variants=['scaled', 'plain'])
  _, (verdict,) = verdicts.judge([rule], table, nulls=[at_init])
  assert verdict.status == verdicts.BY_CONSTRUCTION and 'scaled 1.06, plain 2.15' in verdict.null
  resolved = nulls.resolve_null(at_init, {'scaled': table['scaled']})
  assert resolved['values'] == {'scaled': {'growth': pytest.approx(1.06)}}  # plain never ran
  # Uniform attention puts on the gold tokens the share that chance is: another metric's value.
  uniform = dict(name='uniform', reason='r', values={'scaled': {'growth': 'as recorded: chance'}})
  chance = {'scaled': {'chance': [0.2, 0.3]}}
  assert nulls.resolve_null(uniform, chance)['values'] == {'scaled': {'growth': 0.25}}
  nulls.check_nulls([uniform])
  with pytest.raises(ValueError, match="must be a number, 'as recorded', 'as recorded: METRIC'"):
    nulls.check_nulls([{**at_init, 'values': {'scaled': {'growth': 'recorded'}}}])
  # A positive control gives every variant its own value: another variant's, as recorded.
  control = dict(
    name='control', reason='r', values={'scaled': {'growth': 'as recorded: plain growth'}}
  )
  assert nulls.resolve_null(control, table)['values'] == {'scaled': {'growth': pytest.approx(2.15)}}
  nulls.check_nulls([control], variants=['scaled', 'plain'])
  with pytest.raises(ValueError, match="names variant 'large'; the variants are: scaled, plain"):
    bad = {'scaled': {'growth': 'as recorded: large growth'}}
    nulls.check_nulls([{**control, 'values': bad}], variants=['scaled', 'plain'])


def test_a_group_stands_for_its_member_with_the_best_mean():
  table = {
    'full_lr1': {'acc': [0.30, 0.40, 0.35], 'eval.loss': [2.0, 2.2, 2.1]},
    'full_lr2': {'acc': [0.90, 0.96, 0.93], 'eval.loss': [0.5, 0.4, 0.45]},
    'full_lr3': {'acc': [0.95, 0.05, 0.5], 'eval.loss': [0.1, 5.0, 0.1]},  # a seed diverged
    'lin_lr1': {'acc': [0.20, 0.22, 0.21]},
    'lin_lr2': {'acc': [float('nan')]},  # not recorded: does not take part
  }
  groups = {
    'full': {'best_of': ['full_lr1', 'full_lr2', 'full_lr3'], 'metric': 'acc'},
    'full_by_loss': {'best_of': ['full_lr1', 'full_lr2', 'full_lr3'], 'metric': 'eval.loss'},
    'lin': {'best_of': ['lin_lr2', 'lin_lr1'], 'metric': 'acc'},
    'none': {'best_of': ['lin_lr2'], 'metric': 'acc'},
  }
  joined, chosen = verdicts.best_of(table, groups)
  assert chosen == {'full': 'full_lr2', 'full_by_loss': 'full_lr2', 'lin': 'lin_lr1'}
  assert joined['full'] == table['full_lr2'] and 'none' not in joined
  assert set(table) == set(joined) - {'full', 'full_by_loss', 'lin'}  # the input is unchanged
  # Rules compare the groups: the best rate of each arm.
  gap = dict(kind='greater', metric='acc', a='full', b='lin')
  missing = dict(kind='greater', metric='acc', a='full', b='none')
  _, found = verdicts.judge([gap, missing], table, groups=groups)
  assert [v.status for v in found] == [R, verdicts.NOT_RUN]
  assert '0.93' in found[0].text
  assert verdicts.judge([gap], table)[1][0].status == verdicts.NOT_RUN  # no groups: no 'full'
  # A null names the group like a variant: equal values there, so the rule fails on it.
  guess = dict(name='guess', reason='no lookup', values={g: {'acc': 0.1} for g in ('full', 'lin')})
  _, (judged,) = verdicts.judge([gap], table, nulls=[guess], groups=groups)
  assert judged.status == R and judged.null.startswith('guess: fails')


@pytest.mark.parametrize(
  'groups, message',
  [
    ({'a': {'best_of': ['a'], 'metric': 'acc'}}, "group 'a' has the name of a variant"),
    ({'g': {'best_of': ['a']}}, "group 'g' needs exactly 'best_of' .* and 'metric'"),
    ({'g': {'best_of': [], 'metric': 'acc'}}, 'best_of=.* must list variants'),
    ({'g': {'best_of': ['a', 'c'], 'metric': 'acc'}}, "group 'g' names variant 'c'"),
    ({'g': {'best_of': ['a'], 'metric': 'acc', 'grid': 'yes'}}, "may add 'grid': True"),
  ],
)
def test_bad_groups_are_one_clear_error(groups, message):
  with pytest.raises(ValueError, match=message):
    rules_lib.check_groups(groups, ['a', 'b'])


def test_a_grid_group_whose_best_is_at_its_edge_says_so():
  """A group over a grid in order (rates, say) whose best member is the first or the last says
  that a setting beyond the grid may do better; one chosen inside it, or a group that is no
  grid, says nothing of the kind."""
  from research import report

  table = {f'lr{i}': {'acc': [a, a + 0.01, a - 0.01]} for i, a in enumerate((0.2, 0.5, 0.9))}
  table.update({f'mid{i}': {'acc': [a] * 3} for i, a in enumerate((0.2, 0.9, 0.5))})
  groups = {
    'top': {'best_of': ['lr0', 'lr1', 'lr2'], 'metric': 'acc', 'grid': True},
    'inside': {'best_of': ['mid0', 'mid1', 'mid2'], 'metric': 'acc', 'grid': True},
    'plain': {'best_of': ['lr0', 'lr1', 'lr2'], 'metric': 'acc'},
  }
  rules_lib.check_groups(groups, list(table))
  results = [
    {'variant': v, 'seed': s, 'metrics': {'acc': m['acc'][s]}}
    for v, m in table.items()
    for s in range(3)
  ]
  lines = report._group_lines({'groups': groups}, results)
  edge = [line for line in lines if 'edge of its grid' in line]
  assert len(edge) == 1 and edge[0].startswith('- **top** = lr2')
  assert any(line.startswith('- **inside** = mid1') for line in lines)
