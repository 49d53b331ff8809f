"""Decoding over a KV cache: greedy, temperature / top-k / top-p sampling and beam search.

`translate` (EncoderDecoder) and `generate` (CausalLM) each jit one prefill of the prompt and a
`lax.while_loop` of single-token steps that stops once every row is done. The tests check the
cache against greedy decoding without one, in tests/decode_reference.py.

The prefill, the single-token step and the options every loop compiles on are in prefill.py
(prompts stay right-padded in the cache), beam search in beam.py; this module checks the
arguments and runs greedy and sampled decoding.
Every `params` may also be a variables dict (a batchnorm model's, see `models.variables`).
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from transformer.data import EOS_ID, PAD_ID
from transformer.model.beam import (
  length_penalty,  # noqa: F401  (public here too)
  search,
)
from transformer.model.bidirectional import BidirectionalLM
from transformer.model.encoder_decoder import EncoderDecoder
from transformer.model.models import CausalLM
from transformer.model.models import variables as models_variables
from transformer.model.prefill import (
  Knobs,
  Options,
  StepFn,  # noqa: F401  (public here too)
  next_logits,
  prefill,
)

Array = jax.Array


# Public API -----------------------------------------------------------------------------------
def translate(
  model: EncoderDecoder,
  params: Any,
  inputs: Array,
  *,
  max_length: int,
  beam_size: int = 1,
  alpha: float = 0.6,
  temperature: float = 0.0,
  top_k: int = 0,
  top_p: float = 1.0,
  rng: Array | None = None,
  eos_id: int = EOS_ID,
) -> Array:
  """Translates source tokens with an EncoderDecoder; the decoder starts from BOS_ID.

  Args:
    inputs: source tokens `[B, S]` (0 = padding).
    max_length: tokens to generate, eos included.
    beam_size: > 1 runs beam search (GNMT length penalty with `alpha`) and returns the best beam.
    temperature: 0 = greedy; > 0 samples from softmax(logits / temperature), after keeping the
      `top_k` most likely tokens (0 = all) and the smallest set of mass >= `top_p` (nucleus).
    rng: PRNG key, needed when sampling.
    eos_id: the token that ends a row (sparrow's EOS_ID; a Hugging Face model's own).
  Returns:
    int32 `[B, max_length]`; after eos every token is PAD_ID.
  """
  args = (max_length, beam_size, alpha, temperature, top_k, top_p, rng, eos_id)
  return _decode(model, params, inputs, 'translate', *args)


def generate(
  model: CausalLM,
  params: Any,
  prompt: Array,
  *,
  max_new_tokens: int,
  beam_size: int = 1,
  alpha: float = 0.6,
  temperature: float = 0.0,
  top_k: int = 0,
  top_p: float = 1.0,
  rng: Array | None = None,
  eos_id: int = EOS_ID,
) -> Array:
  """Continues right-padded CausalLM prompts (each starting with BOS_ID).

  Args:
    prompt: `[B, P]` tokens, right-padded with PAD_ID (0); rows may differ in length.
    max_new_tokens: tokens to generate, eos included.
    beam_size, alpha, temperature, top_k, top_p, rng, eos_id: as in `translate`.
  Returns:
    int32 `[B, max_new_tokens]`; after eos every token is PAD_ID.
  """
  args = (max_new_tokens, beam_size, alpha, temperature, top_k, top_p, rng, eos_id)
  return _decode(model, params, prompt, 'generate', *args)


def _decode(model, params, tokens, name, length, beam_size, alpha, temp, top_k, top_p, rng, eos_id):
  """`translate` or `generate` (`name`)."""
  opts, knobs = _options(model, name, length, beam_size, alpha, temp, top_k, top_p, rng, eos_id)
  _check_tokens(tokens, 'inputs' if name == 'translate' else 'prompt')
  _check_learned_positions(model, tokens, length)
  if beam_size > 1:
    return search(model, params, tokens, knobs, opts)[0][:, 0]
  return _sample(model, params, tokens, rng, knobs, opts)


def generate_sliding(
  model: CausalLM,
  params: Any,
  tokens: Array,
  lengths: Array,
  *,
  max_new_tokens: int,
  temperature: float = 0.0,
  top_k: int = 0,
  top_p: float = 1.0,
  rng: Array | None = None,
  eos_id: int = EOS_ID,
) -> Array:
  """Continues rows past the model's context as nanoGPT does: each new token is predicted from
  the last `max_length` tokens of its row, run afresh (positions 0 .. max_length - 1).

  Args:
    tokens: `[B, N]` right-padded rows; row b holds `lengths[b]` real tokens (at least 1).
    lengths: int32 `[B]`.
    max_new_tokens, temperature, top_k, top_p, rng, eos_id: as in `generate`.
  Returns:
    int32 `[B, max_new_tokens]`; after eos every token is PAD_ID.
  """
  opts, knobs = _options(
    model, 'generate', max_new_tokens, 1, 0.6, temperature, top_k, top_p, rng, eos_id
  )
  _check_tokens(tokens, 'tokens')
  return _slide(model, params, tokens, jnp.asarray(lengths, jnp.int32), rng, knobs, opts)


@functools.partial(jax.jit, static_argnums=(0, 6))
def _slide(model, params, tokens, lengths, rng, knobs: Knobs, opts: Options) -> Array:
  """The loop of `generate_sliding`: one uncached forward over a [B, T] window per new token."""
  B, context = tokens.shape[0], model.cfg.max_length
  seq = jnp.concatenate([tokens, jnp.full((B, opts.length), PAD_ID, jnp.int32)], axis=1)
  seq = jnp.pad(seq, ((0, 0), (0, max(0, context - seq.shape[1]))))  # at least one window wide
  columns = jnp.arange(context)

  def cond(state):
    i, _, _, done = state
    return (i < opts.length) & ~jnp.all(done)

  def body(state):
    i, seq, lengths, done = state
    begin = jnp.maximum(lengths - context, 0)  # [B]: the window's first token
    window = jax.vmap(lambda row, b: lax.dynamic_slice(row, (b,), (context,)))(seq, begin)
    seen = lengths - begin  # [B] real tokens in the window
    segments = (columns[None] < seen[:, None]).astype(jnp.int32)  # [B, T]
    logits = model.apply(models_variables(params), window, segments=segments)  # [B, T, V]
    last = jnp.take_along_axis(logits, (seen - 1)[:, None, None], axis=1)[:, 0]  # [B, V]
    key = None if rng is None else jax.random.fold_in(rng, i)
    token = _choose(last.astype(jnp.float32), key, knobs, opts.sample)  # [B]
    token = jnp.where(done, PAD_ID, token)
    seq = jax.vmap(lambda row, at, t: lax.dynamic_update_slice(row, t[None], (at,)))(
      seq, lengths, token
    )
    return i + 1, seq, lengths + (~done).astype(jnp.int32), done | (token == opts.eos_id)

  state = (jnp.int32(0), seq, lengths, jnp.zeros((B,), bool))
  _, seq, _, _ = lax.while_loop(cond, body, state)
  start = lengths  # each row's new tokens begin at its own length
  return jax.vmap(lambda row, b: lax.dynamic_slice(row, (b,), (opts.length,)))(seq, start)


def beam_search(
  model: EncoderDecoder | CausalLM,
  params: Any,
  tokens: Array,
  *,
  length: int,
  beam_size: int = 4,
  alpha: float = 0.6,
) -> tuple[Array, Array]:
  """All `beam_size` finished hypotheses with their scores, best first.

  A hypothesis of n tokens (eos included) with summed log-probability s scores
  s / ((5 + n) / 6) ** alpha (GNMT, Wu et al. 2016). At each step the 2W best continuations are
  ranked by s; those among the first W that end in eos, or reach `length`, finish; the W best
  without eos stay alive. An example stops once W hypotheses have finished, so beam_size=1 is
  exactly greedy.

  Args:
    tokens: EncoderDecoder source tokens `[B, S]`, or right-padded CausalLM prompts `[B, P]`.
    length: tokens to generate, eos included.
  Returns:
    (sequences int32 `[B, W, length]` with PAD_ID after eos, scores float32 `[B, W]`).
  """
  name = 'translate' if isinstance(model, EncoderDecoder) else 'generate'
  opts, knobs = _options(model, name, length, beam_size, alpha, 0.0, 0, 1.0, None)
  _check_tokens(tokens, 'tokens')
  _check_learned_positions(model, tokens, length)
  return search(model, params, tokens, knobs, opts)


def greedy_translate(model: Any, params: Any, inputs: Array, max_length: int) -> Array:
  """EncoderDecoder greedy decoding over the KV cache: `translate` with its defaults."""
  return translate(model, params, inputs, max_length=max_length)


def greedy_continue(model: Any, params: Any, prompt: Array, max_new_tokens: int) -> Array:
  """CausalLM greedy continuation over the KV cache: `generate` with its defaults."""
  return generate(model, params, prompt, max_new_tokens=max_new_tokens)


# Argument checks ------------------------------------------------------------------------------
def _options(model, name, length, beam_size, alpha, temperature, top_k, top_p, rng, eos_id=EOS_ID):
  """Validates the arguments of `translate`/`generate`; raises one ValueError on the first."""
  length_name = 'max_length' if name == 'translate' else 'max_new_tokens'
  if isinstance(model, BidirectionalLM):
    raise ValueError(
      'a BidirectionalLM cannot generate text (it has no causal decoder); '
      'use an EncoderDecoder with translate or a CausalLM with generate'
    )
  want, other = (EncoderDecoder, 'generate') if name == 'translate' else (CausalLM, 'translate')
  if not isinstance(model, want):
    raise ValueError(
      f'{name} needs {"an" if want is EncoderDecoder else "a"} {want.__name__} model, got '
      f'{type(model).__name__}; use decode.{other} for it'
    )
  if not _is_int(length) or length < 1:
    raise ValueError(f'{length_name}={length!r} must be a positive int')
  if not _is_int(beam_size) or beam_size < 1:
    raise ValueError(f'beam_size={beam_size!r} must be an int >= 1 (1 = greedy or sampling)')
  if not _is_real(alpha) or not 0 <= alpha < math.inf:
    raise ValueError(f'alpha={alpha!r} must be >= 0 and finite (the GNMT length penalty; 0 = none)')
  if not _is_real(temperature) or not 0 <= temperature < math.inf:
    raise ValueError(
      f'temperature={temperature!r} must be >= 0 and finite (0 = greedy, > 0 = sampling)'
    )
  if not _is_int(top_k) or top_k < 0:
    raise ValueError(f'top_k={top_k!r} must be an int >= 0 (0 = no top-k filter)')
  if not _is_real(top_p) or not 0.0 < top_p <= 1.0:
    raise ValueError(f'top_p={top_p!r} must be in (0, 1] (a number; 1 = no nucleus filter)')
  if beam_size > 1 and temperature > 0:
    raise ValueError(
      f'beam_size={beam_size} searches deterministically; set temperature=0 (got {temperature}) '
      'or beam_size=1 to sample'
    )
  if temperature == 0 and (top_k or top_p < 1.0):
    raise ValueError(
      f'top_k={top_k} and top_p={top_p} filter sampling, which needs temperature > 0 '
      '(temperature=0 is greedy)'
    )
  if temperature > 0 and rng is None:
    raise ValueError(f'temperature={temperature} samples and needs rng=jax.random.PRNGKey(seed)')
  opts = Options(int(length), int(beam_size), sample=temperature > 0, eos_id=int(eos_id))
  return opts, Knobs(float(temperature), int(top_k), float(top_p), float(alpha))


def _is_int(x) -> bool:
  return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
  return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _check_tokens(tokens, name: str) -> None:
  if getattr(tokens, 'ndim', None) != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
    shape = getattr(tokens, 'shape', None)
    raise ValueError(f'{name} must be integer tokens [B, length]; got shape {shape}')


def _check_learned_positions(model, tokens, length: int) -> None:
  """Generating `length` tokens after `tokens` (a CausalLM's prompt, or an EncoderDecoder's
  source, which takes no decoder positions) must stay within learned positions."""
  cfg = model.cfg
  slots = length if isinstance(model, EncoderDecoder) else tokens.shape[1] + length - 1
  if cfg.position == 'learned' and slots > cfg.max_length:
    raise ValueError(
      f'decoding needs {slots} positions but learned positions stop at max_length='
      f'{cfg.max_length}; generate fewer tokens or use a shorter prompt'
    )


# Greedy and sampling ----------------------------------------------------------------------------
def filter_logits(
  logits: Array, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
) -> Array:
  """The logits that sampling draws from: divided by temperature, filtered to -inf.

  Keeps the top_k most likely tokens (0 = all), then of those the most likely ones until their
  renormalised mass reaches top_p (the token that crosses top_p is kept; ties are all kept).

  Args:
    logits: float32 `[R, V]`; temperature > 0; top_k, top_p may be traced.
  Returns:
    float32 `[R, V]`.
  """
  logits = logits / temperature  # [R, V]
  V = logits.shape[-1]
  ordered = -jnp.sort(-logits, axis=-1)  # [R, V], descending
  # jnp.where, not Python `if`: top_k and top_p are traced, so sweeping them never recompiles.
  k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
  keep = jnp.arange(V) < k  # [V], in sorted order
  probs = jax.nn.softmax(jnp.where(keep, ordered, -jnp.inf), axis=-1)
  before = jnp.cumsum(probs, axis=-1) - probs  # mass of the more likely kept tokens
  keep = keep & ((before < top_p) | (top_p >= 1.0))  # [R, V]
  # Filter by value, not by rank, so tokens tied with the last kept one are kept too.
  cutoff = jnp.min(jnp.where(keep, ordered, jnp.inf), axis=-1, keepdims=True)  # [R, 1]
  return jnp.where(logits < cutoff, -jnp.inf, logits)  # [R, V]


def _choose(logits: Array, rng: Array | None, knobs: Knobs, sample: bool) -> Array:
  """Next token [R] from logits float32[R, V]: argmax, or a sample of `filter_logits`."""
  if not sample:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = filter_logits(logits, knobs.temperature, knobs.top_k, knobs.top_p)
  return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnums=(0, 5))
def _sample(model, params, tokens, rng, knobs: Knobs, opts: Options) -> Array:
  """Greedy or sampled decoding: int32 [B, length]."""
  first, cache, step, start = prefill(model, params, tokens, opts.length)
  B = tokens.shape[0]

  def cond(state):
    i, _, _, done, _ = state
    return (i < opts.length) & ~jnp.all(done)

  def body(state):
    i, out, token, done, cache = state
    # Token i - 1 goes back in at slot start + i - 1 (unused when i = 0: the prefill's logits).
    logits, cache = next_logits(i, first, step, token, start + i - 1, cache)  # [B, V]
    key = None if rng is None else jax.random.fold_in(rng, i)  # a fresh key per step
    token = jnp.where(done, PAD_ID, _choose(logits, key, knobs, opts.sample))  # [B]
    out = lax.dynamic_update_slice(out, token[:, None], (0, i))  # out[:, i] = token
    return i + 1, out, token, done | (token == opts.eos_id), cache

  out = jnp.full((B, opts.length), PAD_ID, jnp.int32)  # [B, length]
  # (step i, output so far, last token [B], done [B], cache)
  state = (jnp.int32(0), out, jnp.zeros((B,), jnp.int32), jnp.zeros((B,), bool), cache)
  return lax.while_loop(cond, body, state)[1]
