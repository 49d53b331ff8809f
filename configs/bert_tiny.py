"""A tiny BERT for tests and CPU runs."""

from configs import bert_base


def get_config():
  config = bert_base.get_config()
  config.name = 'bert_tiny'
  m = config.model
  m.d_model, m.num_heads, m.d_ff, m.num_layers = 64, 4, 256, 2
  m.max_length = 128
  m.attention_dropout_rate = 0.0
  return config
