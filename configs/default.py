"""The embedded default: a small EncoderDecoder that learns to spell numbers, on a laptop CPU.

Built-in generated data (digits -> English words), a byte tokenizer, no downloads.
"""

from configs import base


def get_config():
  config = base.get_config()
  config.name = 'default'
  m = config.model
  m.family = 'encoder_decoder'
  m.d_model, m.num_heads, m.d_ff, m.num_layers = 128, 4, 512, 2
  m.max_length = 128
  m.dropout_rate = 0.1
  d = config.data
  d.task = 'numbers'
  d.tokenizer = 'byte'
  d.max_source_length = 16
  d.max_target_length = 64
  d.batch_size = 64
  d.eval_batch_size = 256
  d.num_train_examples = 50_000
  d.num_eval_examples = 512
  t = config.train
  t.steps = 2000
  t.eval_every = 1000
  t.checkpoint_every = 1000
  t.log_every = 100
  t.eval_decode_examples = 512
  t.max_decode_length = 64
  o = config.optim
  o.schedule = 'rsqrt'
  o.learning_rate = 2.0
  o.warmup_steps = 400
  return config
