"""The embedded default: a small EncoderDecoder that learns to spell numbers, on a laptop CPU.

Built-in generated data (digits -> English words) and a SentencePiece vocabulary of 64 trained on
it: no downloads. About 2 minutes on 2 CPU cores to BLEU >= 97 and exact match >= 95% at every
seed (docs/results/default_recipe).
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
  d.tokenizer = 'sentencepiece'
  d.vocab_size = 64  # ~30 number words plus digits and characters
  d.max_source_length = 12
  d.max_target_length = 24
  d.batch_size = 64
  d.eval_batch_size = 256
  d.num_train_examples = 50_000
  d.num_eval_examples = 512
  t = config.train
  t.steps = 1000
  t.eval_every = 1000  # once, at the end: keeps the run within 3 minutes on 2 CPU cores
  t.checkpoint_every = 500
  t.log_every = 100
  t.eval_decode_examples = 512
  t.max_decode_length = 24
  o = config.optim
  # Chosen by configs/sweeps/default_recipe.py: linear warmup to 3e-3, then a cosine to 0 at the
  # last step. The paper's rsqrt (peak 0.0051 at step 300, still 0.0028 at step 1000) misses 95%
  # exact match at seeds 0 and 3; this holds BLEU >= 97 and exact match >= 95% at seeds 0-4.
  o.schedule = 'warmup_cosine'
  o.learning_rate = 3e-3
  o.warmup_steps = 100
  o.end_learning_rate_factor = 0.0
  return config
