"""Test-wide setup, before any test module imports JAX."""

import atexit
import os
import shutil
import tempfile

# configs/, experiments/, research/ and bench/ run from the clone and are not installed: pytest's
# `pythonpath` puts the root on this process's path, and PYTHONPATH on every subprocess's (a
# worker script started as `python tests/x.py` has only tests/ on its path otherwise).
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in os.environ.get('PYTHONPATH', '').split(os.pathsep):
  os.environ['PYTHONPATH'] = os.pathsep.join(p for p in (_ROOT, os.environ.get('PYTHONPATH')) if p)

# XLA:CPU compiles tiny models much faster under tests/xla_flags.py's flags, and the suite is
# mostly compile time on tiny models (every worker and subprocess inherits them).
from xla_flags import fast_compile  # noqa: E402 - no JAX

for _flag in fast_compile().split():
  if _flag not in os.environ.get('XLA_FLAGS', '').split():
    os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' ' + _flag).strip()

# Huge pages for XLA:CPU's per-step scratch buffers (experiments/cli.py, `huge_page_tunables`,
# which every command line does for itself): glibc reads the setting when a process starts, so it
# reaches README's `-n 2` workers and every subprocess, but not a run without -n.
from experiments.cli import huge_page_tunables  # noqa: E402 - absl and ml_collections only

_TUNABLES = huge_page_tunables()
if _TUNABLES is not None:
  os.environ['GLIBC_TUNABLES'] = _TUNABLES

# One persistent compilation cache for the whole run, subprocesses included (they inherit the
# environment): many tests build the same tiny Run, each with its own jit, and its second compile
# is a cache read of well under a second. A fresh directory per run keeps timings honest; set
# JAX_COMPILATION_CACHE_DIR yourself to share one across runs. README's `-n 2` workers inherit
# the directory and share it too. Measured on 2 cores (3.11): shared, 568 and 611 s; one per
# worker, 652 s; shared with JAX's file lock (set by a size limit: each write then scans the
# directory), 944 s. JAX writes an entry in place, so a process could read one half written; it
# then warns and compiles; no such warning appeared in these runs.
# Pallas's GPU interpreter (tests/kernels/test_mosaic_gpu.py) runs each warpgroup of a Mosaic GPU
# kernel as its own XLA:CPU computation on its own Python thread, and these block in barrier
# callbacks while the kernel's callback waits for them all. XLA:CPU runs them on one thread pool
# whose size is the number of cores: with 2 cores the pool can fill with waiting threads and the
# test hangs for good. Pinned to one core (`taskset -c 0`), test_plain_float16_cross_attention
# hung on every try, on jax 0.10 and 0.12; with the pool at 8 it passed in 15 s (0.12) and 44 s
# (0.10). The kernels need at most 4 such threads (the caller, two compute warpgroups and the
# memory warpgroup); PJRT_NPROC sizes the pool.
_CORES = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()
os.environ.setdefault('PJRT_NPROC', str(max(8, _CORES or 1)))

if 'JAX_COMPILATION_CACHE_DIR' not in os.environ:
  _CACHE_DIR = tempfile.mkdtemp(prefix='sparrow-test-jax-cache-')
  atexit.register(shutil.rmtree, _CACHE_DIR, ignore_errors=True)
  os.environ['JAX_COMPILATION_CACHE_DIR'] = _CACHE_DIR
os.environ['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'] = '0'  # default 1 s: most here are less
os.environ['JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES'] = '0'


# The longest test files first (seconds on 2 cores at 3.11, 2026-12-03, `python -m pytest -q -n 2
# --durations=0`, summed per file): README's `-n 2` sends whole files to its two workers in this
# order, so each starts on a long one and the short ones fill in at the end. Without -n the order
# does not matter.
_LONGEST_FIRST = (
  'test_sharding.py',  # 58, two subprocesses at once
  'test_loop.py',  # 118
  'test_models.py',  # 99
  'test_mosaic_gpu.py',  # 89
  'test_fuzz.py',  # 64
  'test_linear_attention.py',  # 63
  'test_faults.py',  # 56
  'test_inspection.py',  # 52
  'test_api.py',  # 50
  'test_hf_llama.py',  # 49
  'test_hooks.py',  # 49
  'test_char_lm.py',  # 47
  'test_attention.py',  # 47
  'test_interventions.py',  # 46
  'test_compressed_attention.py',  # 45
  'test_flash_attention.py',  # 44
)


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep order


# A hung test ends its process with every thread's stack on stderr instead of running into CI's
# limit. The longest test takes about 220 s on 2 cores. faulthandler's watchdog is a C thread, so
# it fires even while the main thread waits inside XLA. It writes to the stderr of before pytest's
# capture, which a `-n 2` worker shares with the command; xdist then reports the crashed test, and
# README's command runs no further test (pyproject.toml: --max-worker-restart=0) rather than
# rerunning the same hang.
import faulthandler  # noqa: E402

import pytest  # noqa: E402

HANG_S = float(os.environ.get('SPARROW_TEST_HANG_S', 600))
_STDERR = pytest.StashKey()


def pytest_configure(config):
  config.stash[_STDERR] = os.fdopen(os.dup(2), 'w')  # capture is not on yet


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  stream = item.config.stash[_STDERR]
  faulthandler.dump_traceback_later(HANG_S, exit=True, file=stream)
  try:
    yield
  finally:
    faulthandler.cancel_dump_traceback_later()


# Shared tiny configs ----------------------------------------------------------------------------
from configs import bert_tiny, gpt_tiny, transformer_tiny  # noqa: E402

_PRESETS = {
  'encoder_decoder': transformer_tiny,
  'causal_lm': gpt_tiny,
  'bidirectional_lm': bert_tiny,
}


def make_tiny_config(family='encoder_decoder', task=None, **train_overrides):
  """The smallest config of `family` that runs every part of a training run (1 layer, d_model
  32, 4 steps of 8 rows, an eval and two checkpoints); `train_overrides` go to config.train."""
  config = _PRESETS[family].get_config()
  m = config.model
  m.d_model, m.num_heads, m.d_ff, m.num_layers = 32, 2, 64, 1
  d = config.data
  d.task = task or ('numbers' if family == 'encoder_decoder' else 'grammar')
  d.tokenizer = 'byte'
  d.batch_size, d.eval_batch_size = 8, 8
  d.num_train_examples, d.num_eval_examples = 200, 16
  d.max_length, d.max_source_length, d.max_target_length = 32, 8, 32
  t = config.train
  t.steps, t.log_every, t.eval_every, t.checkpoint_every = 4, 1, 4, 2
  t.eval_decode_examples, t.max_decode_length, t.num_samples = 4, 8, 1
  config.optim.schedule, config.optim.warmup_steps = 'rsqrt', 10
  t.update(train_overrides)
  return config


@pytest.fixture(scope='session')
def tiny_config():
  """`make_tiny_config`, the factory: tiny_config('causal_lm', steps=8) -> ConfigDict."""
  return make_tiny_config


def make_untrained_workdir(path, family: str, **model) -> str:
  """A workdir as training leaves it (config.json, tokenizer/, a checkpoint at step 0) of the
  tiny config, without training: for tests of loading and using a saved model."""
  from transformer.training import checkpoint, provenance
  from transformer.training.run import Run

  config = make_tiny_config(family)
  config.model.update(model)
  run = Run(config, str(path))
  run.task.tokenizer.save(os.path.join(path, 'tokenizer'))
  provenance.write_run_metadata(str(path), run.config)
  ckpt = checkpoint.Checkpointer(str(path))
  ckpt.save(0, run.init_state(), {})
  ckpt.close()
  return str(path)


@pytest.fixture(scope='session')
def untrained_workdir():
  """`make_untrained_workdir`, the factory: untrained_workdir(path, 'causal_lm') -> path."""
  return make_untrained_workdir
