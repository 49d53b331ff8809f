"""The training-speed benchmark model: GPT, 6 layers, d_model 384, 6 heads, T=256, batch 8.

Vocabulary 50304, float32, no dropout: 30.06M parameters. Used by experiments/bench_train.py.
"""

from configs import gpt2_small


def get_config():
  config = gpt2_small.get_config()
  config.name = 'gpt_bench'
  m = config.model
  m.vocab_size = 50304  # GPT-2's 50257 rounded up to a multiple of 64
  m.d_model, m.num_heads, m.d_ff, m.num_layers = 384, 6, 1536, 6
  m.max_length = 256
  m.dropout_rate = m.attention_dropout_rate = 0.0
  m.dtype = 'float32'
  config.data.max_length = 256
  config.data.batch_size = 8
  config.optim.schedule = 'warmup_cosine'
  config.optim.learning_rate = 6e-4
  config.optim.warmup_steps = 100
  return config
