"""nanoGPT's GPU-sized character-level recipe (train_shakespeare_char.py): 6 layers, 6 heads, 384
wide, context 256, batch 64, dropout 0.2, 5000 steps: 10.7M parameters. nanoGPT reports a val
loss of 1.47 with it on tiny-shakespeare, on one A100.

  python -m experiments.train --config=configs/char_lm_gpu.py --config.data.train_path=input.txt \
    --workdir=runs/char_gpu
"""

from configs import char_lm


def get_config():
  config = char_lm.get_config()
  config.name = 'char_lm_gpu'
  m = config.model
  m.d_model, m.num_heads, m.d_ff, m.num_layers = 384, 6, 1536, 6
  m.max_length = 256
  m.dropout_rate = m.attention_dropout_rate = (
    0.2  # nanoGPT's dropout: embeddings, residuals, attention
  )
  d = config.data
  d.batch_size, d.eval_batch_size = 64, 64
  t = config.train
  t.steps = 5000
  t.checkpoint_every = 1000
  return config
