"""TransformerLens's `utils` for ported notebooks: `from transformer_lens import utils` becomes
`from transformer.inference import utils`. Values are NumPy or JAX arrays, never torch tensors."""

from __future__ import annotations

from typing import Any

import numpy as np

from transformer.inference.cache import get_act_name  # noqa: F401  (TransformerLens's name)


def to_numpy(x: Any) -> np.ndarray:
  """A NumPy array of a JAX or NumPy array, a number, a list, or a torch tensor."""
  if hasattr(x, 'detach'):  # torch, without importing it
    x = x.detach().cpu().numpy()
  return np.asarray(x)


def get_device() -> str:
  """'cpu': where the values that sparrow hands back live (NumPy arrays in host memory), so that a
  ported notebook's own torch tensors (`torch.zeros(..., device=device)`, `.to(device)`) mix
  with them, as TransformerLens's torch device does with its tensors. The model itself runs on
  `jax.devices()[0]`, whatever this says."""
  return 'cpu'


def get_corner(x: Any, n: int = 3) -> np.ndarray:
  """The first `n` entries along every axis: a glance at a large array."""
  x = to_numpy(x)
  return x[tuple(slice(0, n) for _ in range(x.ndim))]


def test_prompt(
  prompt: str,
  answer: str,
  model: Any,
  prepend_space_to_answer: bool = True,
  print_details: bool = True,
  prepend_bos: bool = True,
  top_k: int = 10,
) -> None:
  """TransformerLens's `test_prompt`: prints how the model ranks each token of `answer` after
  `prompt` (rank, logit, probability) and its top `top_k` tokens there."""
  if prepend_space_to_answer and not answer.startswith(' '):
    answer = ' ' + answer
  prompt_ids = model.to_tokens(prompt, prepend_bos=prepend_bos)[0]
  answer_ids = model.to_tokens(answer, prepend_bos=False)[0]
  tokens = np.concatenate([prompt_ids, answer_ids])[None]
  logits = np.asarray(model(tokens), np.float64)[0]  # [T, V]
  log_probs = logits - logits.max(-1, keepdims=True)
  log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
  if print_details:
    print('Tokenized prompt:', model.to_str_tokens(prompt_ids))
    print('Tokenized answer:', model.to_str_tokens(answer_ids))
  for i, target in enumerate(answer_ids):
    at = len(prompt_ids) + i - 1  # the position that predicts answer token i
    order = np.argsort(-logits[at])
    rank = int(np.nonzero(order == target)[0][0])
    piece = model.to_str_tokens(np.array([target]))[0]
    print(
      f'Performance on answer token:\nRank: {rank: <8} Logit: {logits[at, target]:5.2f} '
      f'Prob: {np.exp(log_probs[at, target]):6.2%} Token: |{piece}|'
    )
    if print_details:
      for k, t in enumerate(order[:top_k]):
        piece = model.to_str_tokens(np.array([t]))[0]
        print(
          f'Top {k}th token. Logit: {logits[at, t]:5.2f} Prob: {np.exp(log_probs[at, t]):6.2%} '
          f'Token: |{piece}|'
        )
