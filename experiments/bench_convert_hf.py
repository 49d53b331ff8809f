"""Time and memory of Hugging Face import: python -m experiments.bench_convert_hf [--repeats=3]

Writes random-weights folders (config.json + model.safetensors) under --root: GPT-2 124M in float32
and bfloat16, and a Llama-shaped 0.5B in bfloat16. Then it measures, each in a fresh process,
`experiments.convert_hf` into a new workdir (full TrainState checkpoint) and `transformer.load` of
the folder (in memory), and prints medians with the peak resident memory each adds (sampled every
2 ms) as a ratio to the weights file's size.
"""

import json
import os
import shutil
import subprocess
import sys

from absl import app, flags

_ROOT = flags.DEFINE_string('root', '/tmp/bench_convert_hf', 'Scratch directory (rewritten).')
_REPEATS = flags.DEFINE_integer('repeats', 3, 'Runs per measurement; the table shows the median.')

_CHILD = r"""
import json, os, sys, threading, time
os.environ['HF_HUB_OFFLINE'] = '1'
import jax, numpy as np
from transformer.inference import hf, api
mode, folder, out, dtype = sys.argv[1:5]
page = os.sysconf('SC_PAGE_SIZE')
rss = lambda: int(open('/proc/self/statm').read().split()[1]) * page
base, peak, done = rss(), [0], threading.Event()
def sample():
  while not done.is_set():
    peak[0] = max(peak[0], rss())
    time.sleep(0.002)
thread = threading.Thread(target=sample, daemon=True)
thread.start()
start = time.perf_counter()
if mode == 'convert':
  hf.convert(None, folder, out, param_dtype=dtype)
else:
  m = api.load(folder, param_dtype=dtype)
  jax.block_until_ready(m.params)
seconds = time.perf_counter() - start
done.set()
thread.join()
print(json.dumps({'seconds': seconds, 'added_bytes': max(peak[0], rss()) - base}))
"""


GPT2 = {'model_type': 'gpt2', 'architectures': ['GPT2LMHeadModel']}
# A Llama-shaped 0.5B: its largest tensor (the embedding) is 13% of it, closer to a 7B's share.
LLAMA = {
  'model_type': 'llama',
  'architectures': ['LlamaForCausalLM'],
  'vocab_size': 32000,
  'hidden_size': 2048,
  'num_attention_heads': 16,
  'num_key_value_heads': 4,
  'intermediate_size': 5632,
  'num_hidden_layers': 8,
  'max_position_embeddings': 2048,
}


def _write(folder: str, hf_config: dict, dtype: str) -> int:
  """A folder of `hf_config` with random weights in `dtype`; returns the weights file's size."""
  import numpy as np
  from safetensors.numpy import save_file

  from transformer.config import DTYPES, ModelConfig
  from transformer.inference import hf
  from transformer.model import models

  arch = hf_config['model_type']
  cfg = ModelConfig.from_config(hf.model_fields(arch, hf_config) | {'param_dtype': dtype})
  rng = np.random.default_rng(0)
  shapes = models.param_shapes(cfg.replace(scan_layers=False))
  import jax

  params = jax.tree.map(
    lambda s: (0.02 * rng.standard_normal(s.shape, np.float32)).astype(DTYPES[dtype]), shapes
  )
  os.makedirs(folder, exist_ok=True)
  save_file(hf.params_to_hf(arch, cfg, params), os.path.join(folder, 'model.safetensors'))
  with open(os.path.join(folder, 'config.json'), 'w') as f:
    json.dump(hf.hf_config(arch, cfg), f)
  return os.path.getsize(os.path.join(folder, 'model.safetensors'))


def _measure(mode: str, folder: str, out: str, dtype: str) -> dict:
  shutil.rmtree(out, ignore_errors=True)
  env = dict(os.environ, PYTHONPATH=os.getcwd())
  result = subprocess.run(
    [sys.executable, '-c', _CHILD, mode, folder, out, dtype],
    capture_output=True,
    text=True,
    env=env,
    check=True,
  )
  return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv):
  del argv
  import numpy as np

  root = _ROOT.value
  shutil.rmtree(root, ignore_errors=True)
  rows = []
  cases = [
    ('GPT-2 124M', GPT2, 'float32', 'float32', ('convert', 'load')),
    ('GPT-2 124M', GPT2, 'bfloat16', 'keep', ('convert', 'load')),
    ('Llama-shaped 0.5B', LLAMA, 'bfloat16', 'keep', ('load',)),
  ]
  for model, hf_config, file_dtype, param_dtype, modes in cases:
    folder = os.path.join(root, f'{hf_config["model_type"]}_{file_dtype}')
    size = _write(folder, hf_config, file_dtype)
    for mode in modes:
      runs = [
        _measure(mode, folder, os.path.join(root, 'run'), param_dtype)
        for _ in range(_REPEATS.value)
      ]
      seconds = float(np.median([r['seconds'] for r in runs]))
      added = float(np.median([r['added_bytes'] for r in runs]))
      rows.append((model, mode, file_dtype, param_dtype, size, seconds, added))
    shutil.rmtree(folder)
  print(f'Random weights, {os.cpu_count()} CPUs visible, median of {_REPEATS.value}')
  print('| model | what | file dtype | --param_dtype | file MB | seconds | peak added MB | ratio |')
  print('|---|---|---|---|---|---|---|---|')
  for model, mode, file_dtype, param_dtype, size, seconds, added in rows:
    what = 'convert_hf to a workdir' if mode == 'convert' else 'transformer.load(folder)'
    print(
      f'| {model} | {what} | {file_dtype} | {param_dtype} | {size / 2**20:.0f} | {seconds:.2f} | '
      f'{added / 2**20:.0f} | {added / size:.2f} |'
    )


if __name__ == '__main__':
  app.run(main)
