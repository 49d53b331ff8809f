"""A tiny Gemma 3 for CPU runs: Gemma 2's layout with q/k norms, no soft-capping, and a 5:1
pattern of local and global layers with their own RoPE bases; gpt_tiny's data and schedule."""

from configs import gemma2_tiny


def get_config():
  config = gemma2_tiny.get_config()
  config.name = 'gemma3_tiny'
  m = config.model
  m.num_layers = 6
  m.qk_norm = True
  m.attention_softcap, m.logit_softcap = None, None
  m.attention_layers = 'LLLLLG'
  m.rope_theta, m.rope_local_theta = 1_000_000.0, 10_000.0
  return config
