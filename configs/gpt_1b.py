"""A ~1.3B GPT for GPU speed checks: 24 layers, d_model 2048, 16 heads of 128, T=2048, bf16.

1,315,819,520 parameters with the tied 50304 vocabulary (`python -m experiments.describe
--config=configs/gpt_1b.py`); attention through our Pallas kernel (Mosaic GPU on Hopper).
"""

from configs import gpt2_small


def get_config():
  config = gpt2_small.get_config()
  config.name = 'gpt_1b'
  m = config.model
  m.vocab_size = 50304  # GPT-2's 50257 rounded up to a multiple of 64
  m.d_model, m.num_heads, m.d_ff, m.num_layers = 2048, 16, 8192, 24
  m.max_length = 2048
  m.dtype = 'bfloat16'  # compute; parameters stay float32
  m.attention_impl = 'pallas'
  m.dropout_rate = m.attention_dropout_rate = 0.0
  m.remat = 'save_matmuls'  # 24 layers of [8, 2048, 2048] activations
  config.data.max_length = 2048
  config.data.batch_size = 8
  return config
