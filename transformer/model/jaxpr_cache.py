"""A traced function run through the compile of an identical program: `hooks.run_jit` with hooks.

Each call traces the function afresh, so its hooks run again and see what they read now; the
compile is kept by the program's text, so the same hook on other arrays reuses it.
"""

from __future__ import annotations

import collections
import functools
import gc
import types
import zlib
from collections.abc import Callable, Iterator, Mapping
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
  check_nothing_kept(given)
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


def check_nothing_kept(given: list) -> None:
  """One error if a hook kept the tracer it was handed: used later, it would fail far away."""
  kept = [name for name, ref, *_ in given if ref() is not None]
  if kept:
    gc.collect()  # a reference cycle may still hold a value nobody kept
    kept = [name for name, ref, *_ in given if ref() is not None]
  if kept:
    raise ValueError(
      f'the hook on {kept[0]} kept the activation it was handed (in a list, a dict or a global). '
      'Hooks run while JAX traces the forward, so that value is a tracer, a placeholder with no '
      "numbers in it. Ask for activations with run_with_cache(names=[...]) (or hooks.run's "
      'names=), or compute what you need in the hook and return it as the activation.'
    )


# Hooks whose numbers are arguments -----------------------------------------------------------
# A loop of run_with_hooks calls whose hooks differ only in Python numbers (a layer, a position,
# a head: `partial(patch, pos=p)`, or a lambda closing over a loop variable) would trace and
# compile once per number. `lift` takes such numbers, and the JAX arrays and activation caches a
# hook is given, out of its hooks as arguments, and keys the compiled forward on what is left: the
# hooks' code, their other arguments and the globals they name (by identity; a NumPy array by its
# contents too, since a callback may write scores into it). The next call with other numbers
# runs the same compile without tracing again. A hook that needs a number to be a Python int
# (a slice bound, a shape, an `if`) fails to trace that way, and that key then goes through
# `traced` at every call, as before.
class _Unliftable(Exception):
  pass


def _is_number(v: Any) -> bool:
  return isinstance(v, int | float) and not isinstance(v, bool)


def _is_cache(v: Any) -> bool:  # inference.cache.ActivationCache, read by duck type
  return hasattr(v, 'cache_dict') and hasattr(v, 'traced_copy')


def _value(v: Any, lifted: list, keep: list) -> tuple:
  """The key of a value a hook holds; numbers, arrays and caches go to `lifted` instead, and an
  object named by its identity to `keep`."""
  if _is_number(v):
    lifted.append(jax.numpy.asarray(v))
    return ('number', type(v))
  if isinstance(v, jax.Array):  # immutable: passed in
    lifted.append(v)
    return ('array', v.shape, str(v.dtype))
  if isinstance(v, np.ndarray):  # may be written in place (by a callback): kept, keyed by content
    keep.append(v)
    return ('ndarray', id(v), v.shape, str(v.dtype), zlib.crc32(np.ascontiguousarray(v).data))
  if _is_cache(v):
    lifted.append(dict(v.cache_dict))
    return ('cache', tuple((n, a.shape, str(a.dtype)) for n, a in v.cache_dict.items()))
  if v is None or isinstance(v, bool | str | bytes):
    return ('static', v)
  keep.append(v)
  return ('object', id(v))  # the same object, whatever it holds


def _fn(fn: Callable, lifted: list, keep: list) -> tuple:
  """The key of a hook function: its code, its bound values and the globals it names."""
  if isinstance(fn, functools.partial):
    func = _fn(fn.func, lifted, keep)
    args = tuple(_value(a, lifted, keep) for a in fn.args)
    keywords = tuple((k, _value(v, lifted, keep)) for k, v in sorted(fn.keywords.items()))
    return ('partial', func, args, keywords)
  code = getattr(fn, '__code__', None)
  if code is None or not hasattr(fn, '__globals__'):
    raise _Unliftable(fn)
  cells = tuple(_value(c.cell_contents, lifted, keep) for c in fn.__closure__ or ())
  # The globals it names: a notebook's loop variables are globals, so their numbers (and arrays)
  # are lifted too; any other global by its identity.
  named = tuple((n, _value(fn.__globals__[n], lifted, keep)) for n in _globals(fn))
  defaults = tuple(_value(d, lifted, keep) for d in fn.__defaults__ or ())
  return ('function', code, cells, named, defaults)


def _globals(fn: Callable) -> list[str]:
  return [n for n in fn.__code__.co_names if n in fn.__globals__]


def _rebuilt(fn: Callable, values: Iterator) -> Callable:
  """`fn` with the values that `_fn` lifted replaced by `values`, taken in the same order."""
  take = lambda v: _take(v, values)
  if isinstance(fn, functools.partial):
    func = _rebuilt(fn.func, values)
    args = [take(a) for a in fn.args]
    keywords = {k: take(v) for k, v in sorted(fn.keywords.items())}
    return functools.partial(func, *args, **keywords)
  cells = tuple(types.CellType(take(c.cell_contents)) for c in fn.__closure__ or ())
  scope = fn.__globals__
  swapped = {n: take(scope[n]) for n in _globals(fn)}
  if any(swapped[n] is not scope[n] for n in swapped):  # a lifted global: in a copy of the scope
    scope = {**scope, **swapped}
  defaults = tuple(take(d) for d in fn.__defaults__ or ()) or None
  out = types.FunctionType(fn.__code__, scope, fn.__name__, defaults, cells or None)
  out.__kwdefaults__ = fn.__kwdefaults__
  return out


def _take(v: Any, values: Iterator) -> Any:
  if _is_number(v) or isinstance(v, jax.Array):
    return next(values)
  if _is_cache(v):
    return v.traced_copy(next(values))
  return v


def lift(hooks: Mapping[str, tuple[Callable, ...]]):
  """(key, lifted values, rebuild, objects the key names by identity) of resolved hooks, or None
  when a hook is not a plain function or partial (a bound method, a callable object): those
  trace at every call."""
  lifted: list = []
  keep: list = []
  try:
    key = tuple((name, tuple(_fn(f, lifted, keep) for f in fns)) for name, fns in hooks.items())
  except _Unliftable:
    return None

  def rebuild(values: list) -> dict:
    it = iter(values)
    return {name: tuple(_rebuilt(f, it) for f in fns) for name, fns in hooks.items()}

  return key, lifted, rebuild, keep
