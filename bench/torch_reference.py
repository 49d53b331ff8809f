"""The same GPT training step in PyTorch eager (Hugging Face GPT2LMHeadModel, SDPA, AdamW), for
side-by-side speed comparisons. PyTorch and transformers are optional: `load_torch` says so."""

from __future__ import annotations

import time
from typing import Any

import ml_collections


def load_torch() -> tuple[Any, str | None]:
  """(torch module, None), or (None, one line saying what is missing and how to get it)."""
  try:
    import torch
    import transformers  # noqa: F401
  except ImportError as error:
    return None, (
      f'--compare=torch needs PyTorch and transformers ({error}); pip install torch transformers'
    )
  return torch, None


class TorchGPTStep:
  """A GPT2LMHeadModel with the config's shapes and an AdamW step like sparrow's optimizer."""

  def __init__(self, config: ml_collections.ConfigDict, vocab_size: int, threads: int):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    m, o = config.model, config.optim
    if m.family != 'causal_lm':
      raise ValueError(
        f'--compare=torch builds a GPT: model.family={m.family!r} is not causal_lm; '
        'use a GPT config such as configs/gpt_bench.py'
      )
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    gpt = GPT2Config(
      vocab_size=vocab_size,
      n_positions=config.data.max_length,
      n_embd=m.d_model,
      n_layer=m.num_layers,
      n_head=m.num_heads,
      n_inner=m.d_ff,
      activation_function='gelu_new' if m.activation == 'gelu_tanh' else 'gelu',
      resid_pdrop=m.dropout_rate,
      embd_pdrop=m.dropout_rate,
      attn_pdrop=m.attention_dropout_rate,
      layer_norm_epsilon=m.norm_eps,
      tie_word_embeddings=m.tie_output,
    )
    self.torch = torch
    self.model = GPT2LMHeadModel._from_config(gpt, attn_implementation='sdpa').train()
    self.attention = self.model.config._attn_implementation  # what HF actually selected
    self.optimizer = torch.optim.AdamW(
      self.model.parameters(),
      lr=o.learning_rate,
      betas=(o.b1, o.b2),
      eps=o.eps,
      weight_decay=o.weight_decay,
    )
    self.clip_norm = o.clip_norm
    self.num_params = sum(p.numel() for p in self.model.parameters())

  def batch(self, inputs, targets) -> tuple[Any, Any]:
    """NumPy [B, T] int arrays -> torch int64 tensors."""
    as_long = lambda x: self.torch.as_tensor(x, dtype=self.torch.long)
    return as_long(inputs), as_long(targets)

  def loss(self, inputs, targets):
    """The mean cross-entropy of one forward pass (a tensor that can be backpropagated)."""
    logits = self.model(input_ids=inputs).logits  # [B, T, V]
    return self.torch.nn.functional.cross_entropy(
      logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    )

  def forward(self, inputs, targets) -> float:
    """The loss of a forward pass with no gradient kept (for timing the forward alone)."""
    with self.torch.no_grad():
      return self.loss(inputs, targets).item()

  def gradient(self, inputs, targets) -> float:
    """Forward and backward, gradients then dropped: the step without the optimizer."""
    loss = self.loss(inputs, targets)
    loss.backward()
    self.model.zero_grad(set_to_none=True)
    return loss.item()

  def step(self, inputs, targets) -> float:
    """One optimizer step on [B, T] tensors; returns the mean cross-entropy."""
    loss = self.loss(inputs, targets)
    loss.backward()
    if self.clip_norm:
      self.torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_norm)
    self.optimizer.step()
    self.optimizer.zero_grad(set_to_none=True)
    return loss.item()


def torch_matmul_flops_per_sec(n: int, repeats: int = 10) -> float:
  """Median FLOP/s of a float32 [n, n] @ [n, n] matmul in PyTorch, on its current threads."""
  import torch

  a, b = torch.randn(n, n), torch.randn(n, n)
  torch.matmul(a, b)
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    torch.matmul(a, b)
    times.append(time.perf_counter() - start)
  times.sort()
  return 2 * n**3 / times[len(times) // 2]
