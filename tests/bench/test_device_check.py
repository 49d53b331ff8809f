"""experiments.gpu_check on CPU (--smoke): every part runs and both files are written.

The smoke run is a dozen tiny compiles (two of them training steps): ~30 s on 2 cores.
"""

import json
import subprocess
import sys

import pytest

from bench import device_check


@pytest.mark.slow  # about 25 s: every part of the GPU check, end to end on the CPU
def test_smoke_run_writes_json_and_markdown(tmp_path):
  out = subprocess.run(
    [sys.executable, '-m', 'experiments.gpu_check', f'--out={tmp_path}', '--smoke'],
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert out.returncode == 0, out.stderr[-2000:]
  report = json.loads((tmp_path / 'gpu_check.json').read_text())
  assert report['versions']['backend'] == 'cpu' and report['versions']['jax']
  checked = [r for r in report['correctness'] if 'ok' in r]
  assert {r['implementation'] for r in checked} == {'xla', 'chunked'}
  assert all(r['ok'] for r in checked), checked  # float32 vs float64 within 1e-4
  skipped = {r['implementation']: r['error'] for r in report['correctness'] if 'ok' not in r}
  assert set(skipped) == {'cudnn', 'pallas_triton', 'pallas_mosaic'}  # each says why
  timed = [r for r in report['attention'] if 'fwd_ms' in r]
  assert timed and all(r['fwd_ms'] > 0 and r['fwdbwd_tflops'] > 0 for r in timed)
  assert [r['config'] for r in report['training']] == ['gpt2_small', 'gpt_1b']
  assert all(r['tokens_per_s'] > 0 and 0 < r['mfu_vs_matmul'] for r in report['training'])
  text = (tmp_path / 'gpu_check.md').read_text()
  for section in ('Correctness vs float64', 'Attention speed', 'Training step', 'Targets'):
    assert f'## {section}' in text


def test_targets_compare_against_the_issue_thresholds():
  row = dict(implementation='pallas_mosaic', T=4096, head_dim=128, causal=False, fwd_ms=1.0)
  row |= dict(fwd_vs_matmul=0.8, fwd_vs_cudnn=0.9, fwdbwd_vs_matmul=0.61)
  training = [{'config': 'gpt_1b', 'mfu_vs_989': 0.44}, {'config': 'gpt2_small', 'error': 'x'}]
  got = {t['target']: t['met'] for t in device_check.targets([row], training)}
  assert got == {
    'fwd >= 0.75x matmul (T=4096 causal=False)': True,
    'fwd >= 1.0x cuDNN (T=4096 causal=False)': False,
    'fwd+bwd >= 0.6x matmul (T=4096 causal=False)': True,
    'gpt_1b MFU >= 45% of 989': False,
  }
