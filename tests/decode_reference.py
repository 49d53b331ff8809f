"""Greedy decoding without a KV cache: the decoder reruns over the whole prefix at every step.

Slow and simple, the reference that the tests hold `transformer.model.decode`'s cached decoding to.
"""

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from transformer.data import BOS_ID, EOS_ID, PAD_ID
from transformer.model import models

Array = jax.Array


def greedy_uncached_translate(model: Any, params: Any, inputs: Array, max_length: int) -> Array:
  """EncoderDecoder greedy decoding that reruns the decoder on the whole prefix at every step.

  Args:
    inputs: source tokens [B, S] (0 = padding).
    max_length: tokens to generate, eos included.
  Returns:
    [B, max_length] generated tokens; after eos everything is PAD_ID.
  """
  variables = models.variables(params)
  segments = (inputs != PAD_ID).astype(jnp.int32)
  encoded = model.apply(variables, inputs, inputs_segments=segments, method=model.encode)
  batch = inputs.shape[0]
  # [B, 1 + max_length]: BOS, then the generated tokens; the decoder reads all but the last.
  buffer = jnp.full((batch, max_length + 1), PAD_ID, jnp.int32).at[:, 0].set(BOS_ID)

  def step(i, state):
    buffer, done = state
    logits = model.apply(
      variables,
      encoded,
      segments,
      buffer[:, :-1],
      targets_segments=jnp.ones_like(buffer[:, :-1]),
      method=model.decode,
    )  # [B, L, V]
    token = jnp.argmax(logits[:, i], axis=-1).astype(jnp.int32)  # [B]
    token = jnp.where(done, PAD_ID, token)
    buffer = buffer.at[:, i + 1].set(token)
    return buffer, done | (token == EOS_ID)

  buffer, _ = lax.fori_loop(0, max_length, step, (buffer, jnp.zeros((batch,), bool)))
  return buffer[:, 1:]


def greedy_uncached_continue(model: Any, params: Any, prompt: Array, max_new_tokens: int) -> Array:
  """CausalLM greedy continuation of right-padded prompts, rerunning the whole buffer each step.

  Args:
    prompt: [B, P] tokens starting with bos, right-padded with 0.
  Returns:
    [B, max_new_tokens] generated tokens; after eos everything is PAD_ID.
  """
  variables = models.variables(params)
  batch, prompt_len = prompt.shape
  lengths = jnp.sum(prompt != PAD_ID, axis=1)  # [B]
  total = prompt_len + max_new_tokens
  buffer = jnp.zeros((batch, total), jnp.int32).at[:, :prompt_len].set(prompt)
  rows = jnp.arange(batch)

  def step(i, state):
    buffer, done = state
    position = lengths + i  # where the next token goes, per row
    # [B, total]: mask the padding and the not-yet-written tail (segment 0).
    segments = (jnp.arange(total)[None] < position[:, None]).astype(jnp.int32)
    logits = model.apply(variables, buffer, segments=segments)  # [B, total, V]
    token = jnp.argmax(logits[rows, position - 1], axis=-1).astype(jnp.int32)  # [B]
    token = jnp.where(done, PAD_ID, token)
    buffer = buffer.at[rows, position].set(token)
    return buffer, done | (token == EOS_ID)

  buffer, _ = lax.fori_loop(0, max_new_tokens, step, (buffer, jnp.zeros((batch,), bool)))
  # Row b's new tokens start at its own length: [B, max_new_tokens].
  return jax.vmap(lambda row, n: lax.dynamic_slice(row, (n,), (max_new_tokens,)))(buffer, lengths)
