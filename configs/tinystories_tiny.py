"""A tiny TinyStories-style GPT-Neo for CPU runs: global and local (windowed) layers alternating,
unscaled attention logits, no q/k/v biases; gpt_tiny's sizes, data and schedule."""

from configs import gpt_tiny


def get_config():
  config = gpt_tiny.get_config()
  config.name = 'tinystories_tiny'
  m = config.model
  m.attention_layers, m.window = 'GL', (31, 0)  # GPT-Neo: window_size 32 on every other layer
  m.attention_scale = False
  m.qkv_bias = False
  return config
