"""Decoding over a KV cache: greedy, temperature / top-k / top-p sampling and beam search.

`translate` (EncoderDecoder) and `generate` (CausalLM) each jit one prefill of the prompt and a
`lax.while_loop` of single-token steps that stops once every row is done. The tests check the
cache against greedy decoding without one, in tests/decode_reference.py.

Prompts are right-padded and stay so in the cache: row b's token i sits in slot (and position)
`start[b] + i`, so each row writes its own slot and sees slots <= its position. Beam search keeps
`[B * W]` cache rows (example-major) and gathers them by parent beam after every step.
Every `params` may also be a variables dict (a batchnorm model's, see `models.variables`).
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from transformer.data import BOS_ID, EOS_ID, PAD_ID
from transformer.model.attention import CacheMode
from transformer.model.bidirectional import BidirectionalLM
from transformer.model.encoder_decoder import EncoderDecoder
from transformer.model.models import CausalLM
from transformer.model.models import variables as models_variables

Array = jax.Array
_NEG_INF = -1.0e9  # score of an impossible hypothesis: finite, so sums never become NaN

# step(tokens [R], positions [R], cache) -> (logits float32[R, V], cache)
StepFn = Callable[[Array, Array, Any], tuple[Array, Any]]


class _Options(NamedTuple):
  """Static decoding options: one compile per distinct value."""

  length: int  # tokens to generate per row, eos included
  beam_size: int = 1
  sample: bool = False  # temperature > 0
  eos_id: int = EOS_ID  # the token that ends a row (imported HF models have their own)


class _Knobs(NamedTuple):
  """Traced decoding options: sweeping them never recompiles."""

  temperature: float = 0.0
  top_k: int = 0  # 0 = no top-k filter
  top_p: float = 1.0  # 1 = no nucleus filter
  alpha: float = 0.6  # GNMT length penalty of beam search


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
    return _beam_search(model, params, tokens, knobs, opts)[0][:, 0]
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
def _slide(model, params, tokens, lengths, rng, knobs: _Knobs, opts: _Options) -> Array:
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
  return _beam_search(model, params, tokens, knobs, opts)


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
  opts = _Options(int(length), int(beam_size), sample=temperature > 0, eos_id=int(eos_id))
  return opts, _Knobs(float(temperature), int(top_k), float(top_p), float(alpha))


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


# Prefill and single-token steps -----------------------------------------------------------------
def prefill(
  model: Any, params: Any, tokens: Array, length: int, rows_per_example: int = 1
) -> tuple[Array, Any, StepFn, Array]:
  """Runs the prompt through the model in one call, filling a fresh KV cache.

  Args:
    tokens: EncoderDecoder source tokens `[B, S]` (the decoder prompt is BOS), or right-padded
      CausalLM prompts `[B, P]`.
    length: tokens to generate; sizes the self-attention cache.
    rows_per_example: `step` runs on `B * rows_per_example` rows, example-major (beams).
  Returns:
    (logits float32 `[B, V]` of generated token 0, cache, step, start int32 `[B]`):
    `step(tokens [R], positions [R], cache) -> (logits float32 [R, V], cache)` feeds one token
    per row, and generated token i of row b goes back in at position `start[b] + i`.
    Call it under `jax.jit`, as `translate` and `generate` do.
  """
  variables = models_variables(params)
  repeat = lambda x: jnp.repeat(x, rows_per_example, axis=0)
  if isinstance(model, EncoderDecoder):
    segments = (tokens != PAD_ID).astype(jnp.int32)  # [B, S]
    encoded = model.apply(variables, tokens, inputs_segments=segments, method=model.encode)
    bos = jnp.full((tokens.shape[0], 1), BOS_ID, jnp.int32)  # [B, 1]
    logits, cache = model.apply(
      variables,
      encoded,
      segments,
      bos,
      targets_segments=jnp.ones_like(bos),
      cache_mode=CacheMode('prefill', length),
      method=model.decode,
      mutable=['cache'],
    )  # [B, 1, V]
    # One copy per beam (R = B * W rows), so step's batch matches the cache's.
    encoded, segments = repeat(encoded), repeat(segments)  # [R, S, D], [R, S]

    def step(token, position, cache):
      token = token[:, None]  # [R, 1]
      logits, cache = model.apply(
        {**variables, 'cache': cache},
        encoded,  # unused: cross attention reads the keys/values cached at prefill
        segments,
        token,
        targets_segments=jnp.ones_like(token),
        targets_positions=position[:, None],
        cache_mode=CacheMode('step', length),
        method=model.decode,
        mutable=['cache'],
      )  # [R, 1, V]
      # float32 for log_softmax, sorting and sampling, whatever the compute dtype.
      return logits[:, 0].astype(jnp.float32), cache.get('cache', {})  # [R, V]

    start = jnp.ones((tokens.shape[0],), jnp.int32)  # slot 0 holds BOS
    return logits[:, 0].astype(jnp.float32), cache.get('cache', {}), step, start  # logits [B, V]

  lengths = jnp.sum(tokens != PAD_ID, axis=1).astype(jnp.int32)  # [B]
  # The cache keeps the prompt's right padding: row b's generated token i goes to slot
  # lengths[b] + i, overwriting a pad slot before any query can see it (visible = slots <= the
  # query's position). So each row's positions stay 0, 1, 2, ... (RoPE and learned positions
  # need no per-row offset), at the cost of P - lengths[b] spare slots.
  cache_length = tokens.shape[1] + length - 1  # the last token is never fed back
  logits, cache = model.apply(
    variables, tokens, cache_mode=CacheMode('prefill', cache_length), mutable=['cache']
  )  # [B, P, V]
  # The next-token logits of row b are at its last real token, not at column P - 1.
  last = jnp.maximum(lengths - 1, 0)[:, None, None]  # [B, 1, 1]; an empty row reads position 0
  first = jnp.take_along_axis(logits, last, axis=1)[:, 0].astype(jnp.float32)  # [B, V]

  def step(token, position, cache):
    token = token[:, None]  # [R, 1]
    logits, cache = model.apply(
      {**variables, 'cache': cache},
      token,
      segments=jnp.ones_like(token),  # the new token is real; the cache slots mask the rest
      positions=position[:, None],  # [R, 1]: also the slot it is written to
      cache_mode=CacheMode('step', cache_length),
      mutable=['cache'],
    )  # [R, 1, V]
    return logits[:, 0].astype(jnp.float32), cache.get('cache', {})  # [R, V]

  return first, cache.get('cache', {}), step, lengths


def _batch_axis(x: Array) -> int:
  """Cache leaves are [B, L, K, H], with a leading layer axis under scan_layers."""
  return x.ndim - 4


def _gather_rows(cache: Any, rows: Array) -> Any:
  """Reorders self-attention cache rows; cross-attention rows are equal within an example."""

  def gather(path, x):
    if 'cross_attention' in jax.tree_util.keystr(path):  # the same source for every beam
      return x
    return jnp.take(x, rows, axis=_batch_axis(x))

  return jax.tree_util.tree_map_with_path(gather, cache)


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


def _choose(logits: Array, rng: Array | None, knobs: _Knobs, sample: bool) -> Array:
  """Next token [R] from logits float32[R, V]: argmax, or a sample of `filter_logits`."""
  if not sample:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = filter_logits(logits, knobs.temperature, knobs.top_k, knobs.top_p)
  return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)


def _next_logits(i, first, step, token, position, cache):
  """Logits of token i: the prefill's for i = 0, else a step that feeds token i - 1 back.

  With this `lax.cond` the loop starts at token 0, so the search logic is traced only once.
  """
  feed = lambda cache: step(token, position, cache)
  return lax.cond(i == 0, lambda cache: (first, cache), feed, cache)


@functools.partial(jax.jit, static_argnums=(0, 5))
def _sample(model, params, tokens, rng, knobs: _Knobs, opts: _Options) -> Array:
  """Greedy or sampled decoding: int32 [B, length]."""
  first, cache, step, start = prefill(model, params, tokens, opts.length)
  B = tokens.shape[0]

  def cond(state):
    i, _, _, done, _ = state
    return (i < opts.length) & ~jnp.all(done)

  def body(state):
    i, out, token, done, cache = state
    # Token i - 1 goes back in at slot start + i - 1 (unused when i = 0: the prefill's logits).
    logits, cache = _next_logits(i, first, step, token, start + i - 1, cache)  # [B, V]
    key = None if rng is None else jax.random.fold_in(rng, i)  # a fresh key per step
    token = jnp.where(done, PAD_ID, _choose(logits, key, knobs, opts.sample))  # [B]
    out = lax.dynamic_update_slice(out, token[:, None], (0, i))  # out[:, i] = token
    return i + 1, out, token, done | (token == opts.eos_id), cache

  out = jnp.full((B, opts.length), PAD_ID, jnp.int32)  # [B, length]
  # (step i, output so far, last token [B], done [B], cache)
  state = (jnp.int32(0), out, jnp.zeros((B,), jnp.int32), jnp.zeros((B,), bool), cache)
  return lax.while_loop(cond, body, state)[1]


# Beam search ------------------------------------------------------------------------------------
class _Beams(NamedTuple):
  alive: Array  # int32[B, W, length] tokens of the live hypotheses, PAD_ID past the last one
  alive_logp: Array  # float32[B, W] summed log-probabilities
  finished: Array  # int32[B, W, length] the best finished hypotheses
  scores: Array  # float32[B, W] their length-penalised scores, best first
  num_finished: Array  # int32[B] hypotheses finished so far (the example is done at W)


def length_penalty(length: Array | int, alpha: float) -> Array:
  """GNMT length penalty ((5 + length) / 6) ** alpha; length counts eos."""
  return ((5.0 + jnp.asarray(length, jnp.float32)) / 6.0) ** alpha


def _expand(beams: _Beams, logp: Array, i: Array, length: int, alpha: Array, eos_id: int):
  """Extends every live beam by token i. logp: float32[B, W, V] of that token.

  Returns the new beams, and for each new live beam its parent beam [B, W] and token [B, W].
  """
  B, W, V = logp.shape
  scores = (beams.alive_logp[:, :, None] + logp).reshape(B, W * V)  # [B, W * V]
  # 2W candidates: even if W of them end in eos, W remain to stay alive.
  top, index = lax.top_k(scores, 2 * W)  # [B, 2W], ranked by summed log-probability
  parent, token = index // V, (index % V).astype(jnp.int32)  # [B, 2W] each
  seqs = jnp.take_along_axis(beams.alive, parent[:, :, None], axis=1)  # [B, 2W, length]
  seqs = lax.dynamic_update_slice(seqs, token[:, :, None], (0, 0, i))  # seqs[:, :, i] = token
  eos = token == eos_id  # [B, 2W]

  # Candidates ranked among the first W finish when they end in eos or reach the length.
  ends = (eos | (i == length - 1)) & (jnp.arange(2 * W) < W)
  ends &= (beams.num_finished < W)[:, None]  # a done example takes no more
  new_scores = jnp.where(ends, top / length_penalty(i + 1, alpha), _NEG_INF)
  pool_scores = jnp.concatenate([beams.scores, new_scores], axis=1)  # [B, 3W]
  pool = jnp.concatenate([beams.finished, seqs], axis=1)  # [B, 3W, length]
  scores, keep = lax.top_k(pool_scores, W)  # [B, W]
  finished = jnp.take_along_axis(pool, keep[:, :, None], axis=1)  # [B, W, length]

  # The W best candidates without eos stay alive (2W candidates hold at most W eos).
  alive_logp, keep = lax.top_k(jnp.where(eos, _NEG_INF, top), W)  # [B, W]
  beams = _Beams(
    jnp.take_along_axis(seqs, keep[:, :, None], axis=1),  # [B, W, length]
    alive_logp,
    finished,
    scores,
    beams.num_finished + ends.sum(axis=1, dtype=jnp.int32),
  )
  return beams, jnp.take_along_axis(parent, keep, 1), jnp.take_along_axis(token, keep, 1)


@functools.partial(jax.jit, static_argnums=(0, 4))
def _beam_search(model, params, tokens, knobs: _Knobs, opts: _Options) -> tuple[Array, Array]:
  """(sequences int32[B, W, length], scores float32[B, W]), best first."""
  W, length = opts.beam_size, opts.length
  first, cache, step, start = prefill(model, params, tokens, length, W)
  B, V = first.shape
  start = jnp.repeat(start, W)  # [B * W]
  empty = jnp.full((B, W, length), PAD_ID, jnp.int32)
  alive_logp = jnp.full((B, W), _NEG_INF).at[:, 0].set(0.0)  # W copies of one empty hypothesis
  beams = _Beams(empty, alive_logp, empty, jnp.full((B, W), _NEG_INF), jnp.zeros((B,), jnp.int32))
  first = jnp.repeat(first, W, axis=0)  # [B * W, V]
  cache = jax.tree.map(lambda x: jnp.repeat(x, W, axis=_batch_axis(x)), cache)  # [B * W] rows

  def cond(state):
    i, beams, _, _ = state
    return (i < length) & jnp.any(beams.num_finished < W)

  def body(state):
    i, beams, token, cache = state
    logits, cache = _next_logits(i, first, step, token, start + i - 1, cache)  # [B * W, V]
    logp = jax.nn.log_softmax(logits).reshape(B, W, V)  # rows are example-major: b * W + w
    beams, parent, token = _expand(beams, logp, i, length, knobs.alpha, opts.eos_id)
    rows = (jnp.arange(B)[:, None] * W + parent).reshape(-1)  # [B * W] parent rows
    # Each surviving beam continues its parent's cache: copy the parent's rows into its slot.
    return i + 1, beams, token.reshape(-1), _gather_rows(cache, rows)

  state = (jnp.int32(0), beams, jnp.zeros((B * W,), jnp.int32), cache)
  _, beams, _, _ = lax.while_loop(cond, body, state)
  return beams.finished, beams.scores
