"""The paper's base Transformer (Vaswani et al. 2017, Table 3 'base') on WMT14 en-de."""

from configs import base


def get_config():
  config = base.get_config()
  config.name = 'transformer_base'
  m = config.model
  m.family = 'encoder_decoder'
  m.vocab_size = 37000  # the paper's shared source/target byte-pair vocabulary
  m.d_model, m.num_heads, m.d_ff, m.num_layers = 512, 8, 2048, 6
  m.dropout_rate = 0.1
  m.max_length = 256
  return config
