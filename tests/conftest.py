"""Test-wide setup, before any test module imports JAX."""

import os

# XLA:CPU compiles about twice as fast without LLVM's backend optimisations, and the suite is
# mostly compile time on tiny models. Results stay within every test's tolerance; benchmarks
# (experiments/bench_*.py) never run under this flag.
_FAST_COMPILE = '--xla_backend_optimization_level=0'
if _FAST_COMPILE not in os.environ.get('XLA_FLAGS', ''):
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' ' + _FAST_COMPILE).strip()
