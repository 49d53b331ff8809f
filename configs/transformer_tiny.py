"""A tiny EncoderDecoder for tests and CPU runs."""

from configs import base


def get_config():
  config = base.get_config()
  config.name = 'transformer_tiny'
  m = config.model
  m.family = 'encoder_decoder'
  m.d_model, m.num_heads, m.d_ff, m.num_layers = 64, 4, 256, 2
  m.max_length = 64
  return config
