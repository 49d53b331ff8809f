"""The prompt's prefill into a KV cache and the single-token step after it, with the options
that every decoding loop (decode.py's greedy and sampled decoding, beam.py's search) compiles on.

Prompts are right-padded and stay so in the cache: row b's token i sits in slot (and position)
`start[b] + i`, so each row writes its own slot and sees slots <= its position.
Every `params` may also be a variables dict (a batchnorm model's, see `models.variables`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from transformer.data import BOS_ID, EOS_ID, PAD_ID
from transformer.model.attention import CacheMode
from transformer.model.encoder_decoder import EncoderDecoder
from transformer.model.models import variables as models_variables

Array = jax.Array

# step(tokens [R], positions [R], cache) -> (logits float32[R, V], cache)
StepFn = Callable[[Array, Array, Any], tuple[Array, Any]]


class Options(NamedTuple):
  """Static decoding options: one compile per distinct value."""

  length: int  # tokens to generate per row, eos included
  beam_size: int = 1
  sample: bool = False  # temperature > 0
  eos_id: int = EOS_ID  # the token that ends a row (imported HF models have their own)


class Knobs(NamedTuple):
  """Traced decoding options: sweeping them never recompiles."""

  temperature: float = 0.0
  top_k: int = 0  # 0 = no top-k filter
  top_p: float = 1.0  # 1 = no nucleus filter
  alpha: float = 0.6  # GNMT length penalty of beam search


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


def next_logits(i, first, step, token, position, cache):
  """Logits of token i: the prefill's for i = 0, else a step that feeds token i - 1 back.

  With this `lax.cond` the loop starts at token 0, so the search logic is traced only once.
  """
  feed = lambda cache: step(token, position, cache)
  return lax.cond(i == 0, lambda cache: (first, cache), feed, cache)
