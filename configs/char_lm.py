"""A character-level GPT on any UTF-8 text file: nanoGPT's CPU recipe ("I only have a macbook").

  python -m experiments.train --config=configs/char_lm.py --config.data.train_path=input.txt \
    --workdir=runs/char
  python -m experiments.sample --workdir=runs/char --prompt='ROMEO:' --max_new_tokens=300

4 layers, 4 heads, 128 wide, context 64, batch 12, 2000 steps, no dropout, no biases: 0.8M
parameters. The file is one running text; its last 10% is the eval split, scored whole; training
rows start at random offsets. configs/char_lm_gpu.py is nanoGPT's GPU-sized recipe.
"""

from configs import base


def get_config():
  config = base.get_config()
  config.name = 'char_lm'
  m = config.model
  m.family = 'causal_lm'
  m.d_model, m.num_heads, m.d_ff, m.num_layers = 128, 4, 512, 4
  m.max_length = 64  # the context (nanoGPT's block_size); data.max_length follows it
  m.position = 'learned'
  m.norm_placement, m.norm_eps = 'pre', 1e-5
  m.activation = 'gelu'
  m.use_bias = m.norm_bias = False  # nanoGPT's bias=False: no biases in projections or norms
  m.scale_embeddings, m.tie_output = False, True
  m.init_distribution, m.init = 'normal', 'scaled'  # std 0.02; residual outputs / sqrt(2 layers)
  m.dropout_rate = m.attention_dropout_rate = 0.0
  d = config.data
  d.task, d.text_format, d.tokenizer = 'text', 'stream', 'char'
  d.eval_fraction = 0.1  # the last 10% of the file, as nanoGPT's prepare.py
  d.sampling = 'random'  # a random offset for every row, as nanoGPT's get_batch
  d.batch_size, d.eval_batch_size = 12, 64  # eval: 64 rows keep its buffers below the compile peak
  t = config.train
  t.steps = 2000
  t.label_smoothing = 0.0
  t.eval_every, t.checkpoint_every, t.log_every = 500, 1000, 100  # each eval: ~6 s on 1 core
  t.eval_decode_examples = 0  # samples: python -m experiments.sample
  o = config.optim
  o.optimizer, o.schedule, o.learning_rate = 'adamw', 'warmup_cosine', 1e-3
  o.warmup_steps, o.end_learning_rate_factor = 100, 0.1  # min_lr 1e-4
  o.b1, o.b2, o.eps = 0.9, 0.99, 1e-8
  o.weight_decay, o.clip_norm = 0.1, 1.0
  return config
