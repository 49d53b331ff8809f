"""A Llama-shaped 7B decoder for GPU compile and memory checks: 32 layers, d_model 4096, 32 query
heads and 8 kv heads of 128 (GQA), SwiGLU 14336, RMSNorm, RoPE, untied, T=4096, bf16.

`python -m experiments.describe --config=configs/llama_7b.py` counts its parameters;
`python -m experiments.gpu_check --deviceless` compiles its training step for 1 and 8 H200s.
"""

from configs import gpt2_small


def get_config():
  config = gpt2_small.get_config()
  config.name = 'llama_7b'
  m = config.model
  m.vocab_size = 32000
  m.d_model, m.num_heads, m.num_kv_heads, m.d_ff, m.num_layers = 4096, 32, 8, 14336, 32
  m.max_length = 4096
  m.position, m.rope_theta = 'rope', 10000.0
  m.norm, m.norm_eps, m.norm_placement = 'rmsnorm', 1e-5, 'pre'
  m.activation = 'swiglu'
  m.use_bias = False
  m.tie_output = False
  m.dtype = 'bfloat16'  # compute; parameters stay float32
  m.attention_impl = 'pallas'
  m.dropout_rate = m.attention_dropout_rate = 0.0
  m.remat = 'full'  # 32 layers of [B, 4096, 4096] activations
  m.scan_layers = True  # one compiled layer, scanned 32 times
  d = config.data
  d.tokenizer, d.vocab_size = 'sentencepiece', 32000
  d.max_length, d.batch_size = 4096, 8
  return config
