"""Tests of research.numerics: float16 softmax overflow (seed §4.3)."""

import math

import numpy as np

from research import numerics

OVERFLOW = math.log(numerics.FP16_MAX)  # 11.09: exp overflows float16 above it


def test_naive_fp16_softmax_overflows_above_ln_fp16_max_and_sparrow_stays_finite():
  peaks = (8.0, 11.0, 11.5, 12.0)
  got = numerics.softmax_overflow(peaks, batch=1, length=40, heads=2)
  for m in peaks:
    # Every row peaks at m, so above ln(65504) every row's exp(m) is inf and inf / inf is NaN.
    assert got[f'naive_fp16.nonfinite@{m:g}'] == (1.0 if m > OVERFLOW else 0.0), m
    for path in ('stable_fp16', 'xla', 'chunked'):
      assert got[f'{path}.nonfinite@{m:g}'] == got[f'{path}.zero_rows@{m:g}'] == 0.0, (path, m)
    # Float32 softmax inside: no worse than a few roundings of the float16 output.
    floor = got[f'rounding.max_err@{m:g}']
    for path in ('xla', 'chunked'):
      assert got[f'{path}.max_err@{m:g}'] <= 3 * floor, (path, m, floor)
  assert math.isnan(got['naive_fp16.max_err@12'])  # nothing finite left to compare


def test_naive_path_is_right_where_nothing_overflows():
  """The naive path is a real softmax: with small logits it matches float64 to float16 precision."""
  got = numerics.softmax_overflow((2.0,), batch=1, length=16, heads=1)
  assert got['naive_fp16.nonfinite@2'] == 0.0
  assert got['naive_fp16.max_err@2'] < 10 * got['rounding.max_err@2']
  assert np.isfinite(got['naive_fp16.max_err@2'])
