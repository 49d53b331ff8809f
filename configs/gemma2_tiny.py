"""A tiny Gemma 2 for CPU runs: sandwich RMSNorms with (1 + w), GeGLU, embeddings x sqrt(d_model),
local and global layers alternating, soft-capped attention and output logits, GQA; gpt_tiny's
sizes, data and schedule."""

from configs import gpt_tiny


def get_config():
  config = gpt_tiny.get_config()
  config.name = 'gemma2_tiny'
  m = config.model
  m.position, m.norm, m.norm_placement = 'rope', 'rmsnorm_offset', 'sandwich'
  m.activation, m.use_bias = 'geglu', False
  m.d_ff = 128  # two up projections: about the MLP parameters of gpt_tiny's 256
  m.num_kv_heads = 2
  m.scale_embeddings = True
  m.attention_layers, m.window = 'LG', (31, 0)  # sliding window of 32 on every other layer
  m.attention_softcap, m.logit_softcap = 50.0, 30.0
  return config
