"""BERT-base (Devlin et al. 2019): 12 layers, 768 wide, 12 heads, MLM head, no pooler."""

from configs import base


def get_config():
  config = base.get_config()
  config.name = 'bert_base'
  m = config.model
  m.family = 'bidirectional_lm'
  m.vocab_size = 30522  # BERT's WordPiece vocabulary
  m.d_model, m.num_heads, m.d_ff, m.num_layers = 768, 12, 3072, 12
  m.max_length = 512
  m.position = 'learned'
  m.type_vocab_size = 2
  m.activation = 'gelu'
  m.norm_placement = 'post'
  m.norm_eps = 1e-12
  m.embedding_norm = True
  m.scale_embeddings = False
  m.init_distribution = 'normal'
  m.init = 'plain'
  m.dropout_rate = 0.1
  m.attention_dropout_rate = 0.1
  d = config.data
  d.task, d.tfds_name, d.tfds_text_key = 'tfds', 'lm1b', 'text'
  d.tokenizer, d.vocab_size = 'sentencepiece', 30522
  d.max_length, d.batch_size, d.pack, d.mlm_prob = 512, 256, True, 0.15
  config.train.steps = 1_000_000  # BERT: 1M steps of 256 x 512
  config.train.label_smoothing = 0.0
  o = config.optim
  o.optimizer, o.schedule, o.learning_rate, o.warmup_steps = 'adamw', 'linear', 1e-4, 10_000
  o.b2, o.eps, o.weight_decay = 0.999, 1e-6, 0.01
  return config
