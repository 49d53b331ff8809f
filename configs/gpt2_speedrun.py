"""GPT-2 small on llm.c-format FineWeb shards: the NanoGPT speedrun's setting (3.28 val loss).

The shards (fineweb_train_*.bin, fineweb_val_*.bin: llm.c's dev/data/fineweb.py, or
modded-nanogpt's data/cached_fineweb10B.py) are read in place; point the globs at them:
python -m experiments.train --config=configs/gpt2_speedrun.py \
  --config.data.train_path='DIR/fineweb_train_*.bin' --config.data.eval_path='DIR/fineweb_val_*.bin'
Validation loss is on the first 10,485,760 tokens of the val shards, as the speedrun measures it.
"""

from configs import gpt2_small


def get_config():
  config = gpt2_small.get_config()
  config.name = 'gpt2_speedrun'
  m = config.model
  m.dropout_rate = m.attention_dropout_rate = 0.0  # llm.c and the speedrun train without dropout
  m.dtype = 'bfloat16'
  d = config.data
  d.task = 'corpus'  # llm.c shards: streamed from the .bin files, documents run on (no cut)
  d.train_path = 'data/fineweb10B/fineweb_train_*.bin'
  d.eval_path = 'data/fineweb10B/fineweb_val_*.bin'
  d.vocab_size, d.vocab_multiple = 50257, 128  # GPT-2's ids; the embedding padded to 50304
  d.max_length, d.batch_size, d.pack = 1024, 512, False  # 524,288 tokens a step, as llm.c
  d.eval_batch_size = 64
  d.eval_batches = 160  # 160 x 64 x 1024 = 10,485,760 val tokens
  t = config.train
  t.steps = 19_073  # 10B tokens (llm.c's GPT-2 124M run)
  t.grad_accum_steps = 8  # 64 rows of 1024 per micro-batch on one GPU
  t.eval_every, t.checkpoint_every, t.log_every = 250, 1000, 10
  t.eval_decode_examples = 0  # token-id shards: no text to decode without GPT-2's tokenizer.json
  o = config.optim
  o.learning_rate, o.warmup_steps, o.end_learning_rate_factor = 6e-4, 700, 0.0
  return config
