"""The paper's big Transformer (Table 3 'big'): d_model 1024, 16 heads, d_ff 4096, dropout 0.3."""

from configs import transformer_base


def get_config():
  config = transformer_base.get_config()
  config.name = 'transformer_big'
  m = config.model
  m.d_model, m.num_heads, m.d_ff = 1024, 16, 4096
  m.dropout_rate = 0.3
  config.train.steps = 300_000  # paper: 300k steps for big
  return config
