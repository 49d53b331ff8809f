"""A tiny Pythia (GPT-NeoX) for CPU runs: the parallel residual, RoPE on a quarter of each head,
LayerNorm with biases and an untied head; gpt_tiny's sizes, data and schedule."""

from configs import gpt_tiny


def get_config():
  config = gpt_tiny.get_config()
  config.name = 'pythia_tiny'
  m = config.model
  m.position, m.rope_dim = 'rope', 4  # head_dim 16: the first 4 dims turn (rotary_pct 0.25)
  m.parallel_residual = True  # x + attn(ln1(x)) + mlp(ln2(x))
  m.activation = 'gelu'
  m.tie_output = False
  return config
