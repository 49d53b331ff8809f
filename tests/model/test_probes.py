"""Probes of heads (transformer.model.probes): the in-context loss against a hand computation
over packed documents, and the detectors on the repeated-token rows they score."""

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
from model_helpers import random_model

from transformer.config import ModelConfig
from transformer.model import hooks, probes


def test_in_context_loss_is_last_quarter_minus_first_quarter_of_each_document():
  cfg = ModelConfig(family='causal_lm', vocab_size=31, d_model=16, num_heads=2, d_ff=24,
                    num_layers=1, max_length=24, dropout_rate=0.0)  # fmt: skip
  _, params = random_model(cfg, seed=1, scale=0.5)
  params = nn.meta.unbox(params)
  rng = np.random.default_rng(0)
  B, T = 3, 24
  inputs = rng.integers(1, 31, (B, T)).astype(np.int32)
  targets = rng.integers(1, 31, (B, T)).astype(np.int32)
  # Row 0: documents of 10 and 14 tokens; row 1: one of 20 then padding; row 2: 3 tokens + 21.
  segments = np.zeros((B, T), np.int32)
  segments[0, :10], segments[0, 10:] = 1, 2
  segments[1, :20] = 1
  segments[2, :3], segments[2, 3:] = 1, 2
  positions = np.zeros((B, T), np.int32)
  for row in range(B):
    for s in np.unique(segments[row][segments[row] > 0]):
      at = np.flatnonzero(segments[row] == s)
      positions[row, at] = np.arange(len(at))
  weights = (segments > 0).astype(np.float32)
  batch = {'inputs': jnp.asarray(inputs), 'segments': jnp.asarray(segments),
           'positions': jnp.asarray(positions)}  # fmt: skip
  got = probes.in_context_loss(cfg, params, batch, targets, weights)

  logits = np.asarray(hooks.run(cfg, params, batch)[0], np.float64)
  logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
  logp -= logits.max(-1, keepdims=True)
  nll = -np.take_along_axis(logp, targets[..., None], -1)[..., 0]
  early, late = [], []
  for row, start, size in [(0, 0, 10), (0, 10, 14), (1, 0, 20), (2, 3, 21)]:  # 2's first: < 4
    q = size // 4
    early += list(nll[row, start : start + q])
    late += list(nll[row, start + size - q : start + size])
  np.testing.assert_allclose(got['early_loss'], np.mean(early), rtol=1e-5)
  np.testing.assert_allclose(got['late_loss'], np.mean(late), rtol=1e-5)
  np.testing.assert_allclose(got['in_context_loss'], np.mean(late) - np.mean(early), rtol=1e-4)


def test_a_hand_made_induction_pattern_scores_one_and_the_pool_is_respected():
  length = 5
  tokens = probes.repeated_tokens(0, length, 2, seed=3, pool=[7, 9, 11])
  assert tokens.shape == (2, 11) and set(np.unique(tokens[:, 1:])) <= {7, 9, 11}
  np.testing.assert_array_equal(tokens[:, 1:6], tokens[:, 6:])
  T = 1 + 2 * length
  induction = np.zeros((2, 1, T, T))
  for q in range(T):  # attend to the token after the previous occurrence (else to bos)
    induction[:, 0, q, q - length + 1 if q > length else 0] = 1.0
  scores = probes.detector_scores(induction, length)
  assert scores['induction'][0] == 1.0 and scores['previous_token'][0] == 0.0
  assert scores['duplicate_token'][0] == 0.0
