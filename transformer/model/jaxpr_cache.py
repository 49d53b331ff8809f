"""A traced function run through the compile of an identical program: `hooks.run_jit` with hooks.

Each call traces the function afresh, so its hooks run again and see what they read now; the
compile is kept by the program's text, so the same hook on other arrays reuses it.
"""

from __future__ import annotations

import collections
import functools
import gc
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

# Compiled programs by the text of their jaxpr and their folded constants, most recently used
# last. The jaxpr holds a hook's Python numbers as literals; its array constants are passed in
# as arguments, so a program that differs only in those arrays' values is one compile. Small
# NumPy constants (the model's own tables, such as ALiBi's slopes) stay in the program, where
# XLA folds them as under a plain jax.jit, so the numbers match it bit for bit.
_PROGRAMS: collections.OrderedDict = collections.OrderedDict()
_PROGRAMS_KEPT = 16
_FOLDED = 4096  # NumPy constants of at most this many elements are folded into the program


def traced(fn: Callable, params: Any, inputs: Mapping[str, Any], given: list):
  """fn(params, inputs) traced now and run through the compile of an identical program;
  `given` fills with weak references to what fn's hooks were handed."""
  closed, shapes = jax.make_jaxpr(fn, return_shape=True)(params, inputs)
  _check_nothing_kept(given)
  fold = [isinstance(c, np.ndarray) and c.size <= _FOLDED for c in closed.consts]
  folded = [c for c, f in zip(closed.consts, fold) if f]
  passed = [c for c, f in zip(closed.consts, fold) if not f]
  key = (str(closed.jaxpr), tuple(fold), tuple((c.dtype.str, c.shape, c.tobytes()) for c in folded))
  program = _PROGRAMS.pop(key, None) or jax.jit(
    functools.partial(_evaluate, closed.jaxpr, fold, folded)
  )
  _PROGRAMS[key] = program
  if len(_PROGRAMS) > _PROGRAMS_KEPT:
    _PROGRAMS.popitem(last=False)
  flat = program(passed, *jax.tree.leaves((params, inputs)))
  return jax.tree.unflatten(jax.tree.structure(shapes), flat)


def _evaluate(jaxpr, fold: list[bool], folded: list, passed: list, *args) -> list:
  """The jaxpr on its constants (the folded ones and those passed in, in order) and args."""
  folded, passed = iter(folded), iter(passed)
  consts = [next(folded) if f else next(passed) for f in fold]
  return jax.core.eval_jaxpr(jaxpr, consts, *args)


def _check_nothing_kept(given: list) -> None:
  """One error if a hook kept the tracer it was handed: used later, it would fail far away."""
  kept = [name for name, ref in given if ref() is not None]
  if kept:
    gc.collect()  # a reference cycle may still hold a value nobody kept
    kept = [name for name, ref in given if ref() is not None]
  if kept:
    raise ValueError(
      f'the hook on {kept[0]} kept the activation it was handed (in a list, a dict or a global). '
      'Hooks run while JAX traces the forward, so that value is a tracer, a placeholder with no '
      "numbers in it. Ask for activations with run_with_cache(names=[...]) (or hooks.run's "
      'names=), or compute what you need in the hook and return it as the activation.'
    )
