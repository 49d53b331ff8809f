"""The XLA flags that the suite and its worker processes compile under. Imports no JAX.

Tests compile hundreds of tiny models, so compile time is most of the suite. Two flags cut it:
  - LLVM's backend optimisations off (about half of XLA:CPU's compile time);
  - on jaxlib 0.10, XLA:CPU's loop emitters instead of its fusion emitters: tests/model/
    test_models.py and test_parts.py took 81 s instead of 103 s on 2 cores. Newer jaxlibs (0.12
    checked) have only the fusion emitters, compile as fast with them, and refuse the flag.
Results stay within every test's tolerance. Benchmarks and README's figures never run under them.
"""

import importlib.metadata

OPTIMIZATION = '--xla_backend_optimization_level=0'
LOOP_EMITTERS = '--xla_cpu_use_fusion_emitters=false'


def fast_compile() -> str:
  """The flags for the installed jaxlib, space-separated."""
  flags = [OPTIMIZATION]
  try:
    major, minor = (int(part) for part in importlib.metadata.version('jaxlib').split('.')[:2])
  except (importlib.metadata.PackageNotFoundError, ValueError):
    return ' '.join(flags)
  if (major, minor) <= (0, 10):  # where the flag is known; an unknown flag aborts XLA
    flags.append(LOOP_EMITTERS)
  return ' '.join(flags)


def without_fast_compile(flags: str) -> str:
  """`flags` without any of the flags above (a subprocess that must run as a user's would)."""
  return ' '.join(f for f in flags.split() if f not in (OPTIMIZATION, LOOP_EMITTERS))
