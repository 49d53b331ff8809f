"""Tests of configs/sweeps/recall_mqar.py: its variants, groups and nulls, and which of its rules
could have failed (all but the two against a window that reaches no pair)."""

import os

import pytest

from research import spec, verdicts

_PATH = os.path.join('configs', 'sweeps', 'recall_mqar.py')


@pytest.fixture(scope='module')
def sweep():
  return spec.load_sweep(_PATH)  # every key, model, rule, group and null checked


def test_each_arm_has_its_rate_grid_in_order_and_linear_its_state_sizes(sweep):
  """Three rates, widened for the arms whose best lay at an edge; a group lists its
  rates in increasing order, so that the report can tell a best at the edge."""
  assert sorted(int(g.split('_')[0][1:]) for g in sweep.groups if g.endswith('_full')) == [4, 8]
  wider = {'full': {3e-2}, 'linear': {3e-2, 1e-1}, 'compressed': {1e-4, 3e-4}}
  for name, group in sweep.groups.items():
    assert group['metric'] == 'train.loss' and group['grid'] is True
    rates = [sweep.variants[v]['optim.learning_rate'] for v in group['best_of']]
    arm = name.split('_')[1]
    assert rates == sorted({1e-3, 3e-3, 1e-2} | wider.get(arm, set()))
    assert all(v.startswith(name + '_lr') for v in group['best_of'])
  states = sorted(g for g in sweep.groups if '_linear' in g)
  assert states == ['p4_linear', 'p8_linear', 'p8_linear_h32', 'p8_linear_h64', 'p8_linear_h8']
  assert sweep.variants['p8_linear_h64_lr1e-3']['model.head_dim'] == 64
  assert len(sweep.variants) == 2 * 4 * 3 + 3 * 3 + 2 * 1 + 5 * 2 + 2 * 2  # + the wider rates


def test_every_seed_draws_its_own_disjoint_data_from_a_large_vocabulary(sweep):
  one, two = (spec.resolve_config(sweep, 'p8_full_lr3e-3', seed) for seed in (0, 1))
  for config in (one, two):
    d = config.data
    assert (d.recall_seed, d.recall_disjoint, d.recall_vocab, d.tokenizer) == (
      None, True, 512, 'char'
    )  # fmt: skip
    assert (d.recall_pairs, d.recall_queries) == (8, 2)  # a quarter of the keys asked
  assert one.seed != two.seed  # and recall_seed=None makes the data follow it (test_recall)


def test_the_nulls_are_one_over_the_values_and_about_one_over_the_pairs(sweep):
  nulls = {n['name']: n['values'] for n in sweep.nulls}
  assert set(nulls['no pairs']) == set(nulls['elimination']) == set(sweep.groups)
  for group, row in nulls['elimination'].items():
    pairs = int(group.split('_')[0][1:])
    assert 1 / pairs <= row['recall.accuracy'] < 1.15 / pairs
    assert nulls['no pairs'][group]['recall.accuracy'] == 1 / 512


def test_every_rule_can_hold_and_fails_on_the_nulls_but_the_window_ones(sweep):
  # Arms as the claim says, at three seeds: full attention exact, the rest lower, and linear
  # attention better with each larger state.
  state = {'p8_linear_h8': 0.2, 'p8_linear': 0.3, 'p8_linear_h32': 0.5, 'p8_linear_h64': 0.7}
  means = {g: state.get(g, 1.0 if g.endswith('_full') else 0.3) for g in sweep.groups}
  table = {g: {'recall.accuracy': [x - 0.01, x, x + 0.01]} for g, x in means.items()}
  _, found = verdicts.judge(list(sweep.rules), table, sweep.preconditions, sweep.nulls)
  assert len(found) == 6  # window and blocks at 4 and 8 pairs, linear at 8, the state ordering
  for verdict in found:
    assert verdict.null.count(': fails') >= 2, verdict.null  # 'no pairs' and 'elimination'
    if 'local window' in verdict.rule['text']:  # the window reaches no pair: it cannot fail
      assert verdict.status == verdicts.BY_CONSTRUCTION and 'out of reach: holds' in verdict.null
    else:
      assert verdict.status == verdicts.REPRODUCED, verdict.text


def test_the_gpu_scale_adds_zoologys_range():
  gpu = spec.load_sweep(_PATH, spec.gpu_scale(_PATH))
  assert {g for g in gpu.groups if g.endswith('_full')} == {
    f'p{n}_full' for n in (4, 8, 16, 32, 64)
  }
  assert 'p16_linear_h64' in gpu.groups and 'p8_linear_h64' not in gpu.groups
  assert len(gpu.rules) == 5 * 2 + 3 + 1  # and linear at 16, 32 and 64 pairs
  config = spec.resolve_config(gpu, 'p64_full_lr1e-3')
  assert config.data.recall_vocab == 8192 and config.model.max_length >= config.data.max_length
