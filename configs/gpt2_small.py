"""GPT-2 small (Radford et al. 2019): 12 layers, 768 wide, 12 heads, pre-LN, tied head."""

from configs import base


def get_config():
  config = base.get_config()
  config.name = 'gpt2_small'
  m = config.model
  m.family = 'causal_lm'
  m.vocab_size = 50257  # GPT-2's byte-level BPE
  m.d_model, m.num_heads, m.d_ff, m.num_layers = 768, 12, 3072, 12
  m.max_length = 1024
  m.position = 'learned'
  m.activation = 'gelu_tanh'
  m.norm_placement = 'pre'
  m.norm_eps = 1e-5
  m.scale_embeddings = False
  m.tie_output = True
  m.init_distribution = 'normal'
  m.init = 'scaled'
  m.dropout_rate = 0.1
  m.attention_dropout_rate = 0.1
  d = config.data
  d.task, d.tfds_name, d.tfds_text_key = 'tfds', 'lm1b', 'text'
  d.tokenizer, d.vocab_size = 'sentencepiece', 32000
  d.max_length, d.batch_size, d.pack = 1024, 64, True
  config.train.steps = 100_000
  config.train.label_smoothing = 0.0
  o = config.optim
  o.optimizer, o.schedule, o.learning_rate, o.warmup_steps = 'adamw', 'warmup_cosine', 6e-4, 2000
  o.b2, o.eps, o.weight_decay, o.clip_norm = 0.95, 1e-8, 0.1, 1.0
  return config
