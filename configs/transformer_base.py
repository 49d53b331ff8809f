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
  d = config.data
  d.task = 'tfds'
  d.tfds_name = 'wmt14_translate/de-en'  # the paper's WMT 2014 English-German
  d.source_lang, d.target_lang = 'en', 'de'
  d.tfds_eval_split = 'test'  # newstest2014
  d.tokenizer = 'sentencepiece'  # the paper used byte-pair encoding with a shared vocabulary
  d.vocab_size = 37000
  d.max_source_length = d.max_target_length = 256
  d.batch_size = 256  # ~25k source + target tokens per step with packing, as in the paper
  d.pack = True
  t = config.train
  t.steps = 100_000  # paper: 100k steps for base
  t.label_smoothing = 0.1
  t.eval_every = t.checkpoint_every = 5000
  t.max_decode_length = 256
  o = config.optim
  o.schedule, o.learning_rate, o.warmup_steps = 'rsqrt', 1.0, 4000  # paper's lrate formula
  o.b1, o.b2, o.eps = 0.9, 0.98, 1e-9
  return config
