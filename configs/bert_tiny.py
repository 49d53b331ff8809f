"""A tiny BERT for tests and CPU runs."""

from configs import bert_base


def get_config():
  config = bert_base.get_config()
  config.name = 'bert_tiny'
  m = config.model
  m.d_model, m.num_heads, m.d_ff, m.num_layers = 64, 4, 256, 2
  m.max_length = 128
  m.attention_dropout_rate = 0.0
  m.dropout_rate = 0.0
  d = config.data
  d.task = 'grammar'  # built-in Markov-chain corpus with a known entropy floor
  d.tokenizer, d.vocab_size = 'sentencepiece', 512
  d.max_length, d.batch_size, d.pack = 128, 32, True
  d.num_train_examples, d.num_eval_examples = 20_000, 500
  t = config.train
  t.steps, t.eval_every, t.checkpoint_every, t.log_every = 1000, 500, 500, 100
  o = config.optim
  o.schedule, o.learning_rate, o.warmup_steps = 'warmup_cosine', 2e-3, 100
  o.optimizer, o.weight_decay, o.clip_norm = 'adamw', 0.01, 1.0
  return config
