"""A tiny GPT for tests and CPU runs."""

from configs import gpt2_small


def get_config():
  config = gpt2_small.get_config()
  config.name = 'gpt_tiny'
  m = config.model
  m.d_model, m.num_heads, m.d_ff, m.num_layers = 64, 4, 256, 2
  m.max_length = 128
  m.attention_dropout_rate = 0.0
  return config
