"""What a rebuild of the model room must keep: parameter paths, hook points and logits, frozen.

For every preset in `configs/` and every option the model tests exercise, `tests/model/frozen/`
holds the sorted parameter paths and shapes, the hook points in the order a forward pass calls
them, a checksum of each initial parameter, and the logits on fixed tokens: evaluation, training
(dropout on) and a cached decoding step, from the initial parameters with every weight perturbed.
A change that moves any of them fails here. On the jax, the XLA flags (tests/xla_flags.py) and
the CPU that wrote them the logits must agree bit for bit; another jax (another XLA), other flags,
or a CPU with other vector instructions (XLA:CPU compiles for the host it runs on), may round
differently, so there they agree to 1e-5 relative, or 1e-5 of the array's largest magnitude.

  python tests/model/test_frozen.py --write   # rewrite the fixtures (only when a change is meant)
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time
import zlib

if __name__ == '__main__':  # the suite's XLA flags (tests/xla_flags.py), so that the bits match
  sys.path.insert(0, str(pathlib.Path(__file__).parent.parent))
  import xla_flags

  os.environ['XLA_FLAGS'] = xla_flags.fast_compile()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

HERE = pathlib.Path(__file__).parent
FROZEN = HERE / 'frozen'
sys.path.insert(0, str(HERE.parent))  # model_helpers, when run as a script
sys.path.insert(0, str(HERE.parent.parent))  # configs, when run as a script

from model_helpers import preset, preset_names  # noqa: E402

from transformer.config import ModelConfig  # noqa: E402
from transformer.model import decode, hooks, models  # noqa: E402

_TINY = dict(vocab_size=37, d_model=24, num_heads=4, d_ff=40, num_layers=2, max_length=32)


def _shrunk(cfg: ModelConfig) -> ModelConfig:
  """A preset at test size: every option kept, the sizes small."""
  kv = cfg.num_kv_heads
  changes = dict(
    _TINY,
    d_ff=_TINY['d_ff'] if cfg.d_ff else 0,
    num_kv_heads=None if kv is None or kv >= cfg.num_heads else (1 if kv == 1 else 2),
    head_dim=None if cfg.head_dim is None else 8,
    num_decoder_layers=None if cfg.num_decoder_layers is None else 3,
    rope_original_max_length=None if cfg.rope_original_max_length is None else 16,
    compress_block=4,
    attention_impl=cfg.attention_impl if cfg.attention_impl in ('xla', 'chunked') else None,
  )
  return cfg.replace(**changes)


def _tiny(family='causal_lm', **overrides) -> ModelConfig:
  base = dict(_TINY, family=family, dropout_rate=0.1)
  if family == 'bidirectional_lm':
    base.update(type_vocab_size=2, embedding_norm=True, position='learned')
  return ModelConfig(**{**base, **overrides})


# name -> (config of the fixture, the full-size config whose parameter paths are frozen too)
def cases() -> dict[str, tuple[ModelConfig, ModelConfig | None]]:
  out = {}
  for name in preset_names():
    if name == 'workdir':  # a run's own config, read from its workdir
      continue
    full = preset(name)
    out[f'preset_{name}'] = (_shrunk(full), full)
  options = {
    'enc_dec_pre_rms_swiglu': _tiny('encoder_decoder', norm='rmsnorm', norm_placement='pre',
                                    activation='swiglu', share_embeddings=False),
    'enc_dec_untied_bias': _tiny('encoder_decoder', tie_output=False, output_bias=True,
                                 num_decoder_layers=1, position='learned'),
    'enc_dec_rope_window': _tiny('encoder_decoder', position='rope', window=(3, 0)),
    'causal_rope_gqa_qknorm': _tiny(norm='rmsnorm', norm_placement='pre', activation='swiglu',
                                    position='rope', num_kv_heads=2, qk_norm=True, use_bias=False,
                                    tie_output=False, scale_embeddings=False,
                                    init_distribution='normal'),
    'causal_rope_yarn': _tiny(position='rope', rope_scaling='yarn', rope_scaling_factor=4.0,
                              rope_original_max_length=16, norm_placement='pre'),
    'causal_rope_llama3': _tiny(position='rope', rope_scaling='llama3', rope_scaling_factor=8.0,
                                rope_original_max_length=16, num_kv_heads=1, head_dim=10),
    'causal_rope_ntk_linear_bias': _tiny(position='rope', rope_scaling='ntk',
                                         rope_scaling_factor=2.0, qkv_bias=True, use_bias=False),
    'causal_alibi_window': _tiny(position='alibi', window=(4, 0), norm_placement='pre',
                                 activation='gelu_tanh', attention_dropout_rate=0.2),
    'causal_post_sinusoidal': _tiny(position='sinusoidal', activation='gelu'),
    'causal_none_no_scale': _tiny(position='none', attention_scale=False, init='large',
                                  norm_bias=False, ffn_dropout_rate=0.2),
    'causal_attention_only': _tiny(d_ff=0, num_layers=3, norm_placement='pre'),
    'causal_no_residual': _tiny(residual=False, init='plain'),
    'causal_no_residual_pre': _tiny(residual=False, norm_placement='pre'),
    'causal_linear': _tiny(attention='linear', position='rope', linear_feature_map='relu'),
    'causal_linear_elu': _tiny(attention='linear', norm_placement='pre'),
    'causal_compressed': _tiny(attention='compressed', compress_block=4, position='rope'),
    'causal_short_conv': _tiny(short_conv=3, norm_placement='pre', position='none'),
    'causal_batchnorm': _tiny(norm='batchnorm', norm_placement='pre'),
    'causal_batchnorm_post': _tiny(norm='batchnorm', norm_bias=False),
    'causal_scan_remat': _tiny(scan_layers=True, remat='full', norm_placement='pre'),
    'causal_remat_matmuls': _tiny(remat='save_matmuls', position='learned'),
    'causal_chunked': _tiny(attention_impl='chunked', attention_chunk_size=8, window=(5, 0)),
    'causal_bf16': _tiny(dtype='bfloat16', norm_placement='pre', position='rope'),
    'bert_mlm': _tiny('bidirectional_lm'),
    'bert_mlm_untied_swiglu': _tiny('bidirectional_lm', activation='swiglu', tie_output=False),
    'bert_classifier': _tiny('bidirectional_lm', num_classes=3),
    'bert_hidden': _tiny('bidirectional_lm', output_head=False, norm='rmsnorm'),
    'bert_rope_batchnorm': _tiny('bidirectional_lm', position='rope', norm='batchnorm',
                                 embedding_norm=False, type_vocab_size=0),
    'bert_scan': _tiny('bidirectional_lm', scan_layers=True, window=(2, 2)),
  }  # fmt: skip
  for name, cfg in options.items():
    out[name] = (cfg, None)
  return out


def _paths(tree) -> list[list]:
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return sorted([jax.tree_util.keystr(p), list(x.shape), str(x.dtype)] for p, x in flat)


def _perturbed(variables, seed: int = 1):
  """Every leaf moved by its own noise, drawn from a hash of its path (order-free)."""

  def move(path, x):
    key = zlib.crc32(jax.tree_util.keystr(path).encode()) + seed
    noise = np.random.default_rng(key).standard_normal(x.shape).astype(np.float32)
    if 'batch_stats' in jax.tree_util.keystr(path) and 'var' in jax.tree_util.keystr(path):
      return (jnp.abs(x + 0.2 * noise) + 0.5).astype(x.dtype)  # a variance stays positive
    return (x + 0.2 * noise).astype(x.dtype)

  return jax.tree_util.tree_map_with_path(move, variables)


def _tokens(cfg: ModelConfig, shape, seed: int) -> jnp.ndarray:
  tokens = np.random.default_rng(seed).integers(3, cfg.vocab_size, size=shape)
  tokens[1, -3:] = 0  # padding at the end of row 1
  return jnp.asarray(tokens, jnp.int32)


def _inputs(cfg: ModelConfig) -> dict:
  T = 8
  x = _tokens(cfg, (2, T), 0)
  if cfg.family == 'encoder_decoder':
    return {'inputs': _tokens(cfg, (2, T + 3), 1), 'decoder_inputs': x}
  if cfg.type_vocab_size:
    return {
      'inputs': x,
      'token_types': jnp.asarray(np.arange(T)[None] >= 4, jnp.int32).repeat(2, 0),
    }
  return {'inputs': x}


def compute(cfg: ModelConfig, full: ModelConfig | None) -> dict:
  """Everything frozen for one case: a dict of JSON values and NumPy arrays."""
  model = models.build(cfg)
  variables = models.init_variables(model, jax.random.PRNGKey(0))
  init_sums = {
    jax.tree_util.keystr(p): [float(np.sum(np.asarray(x, np.float64))),
                              float(np.sum(np.square(np.asarray(x, np.float64))))]
    for p, x in jax.tree_util.tree_flatten_with_path(variables)[0]
  }  # fmt: skip
  variables = _perturbed(variables)
  inputs = _inputs(cfg)
  out = {
    'paths': _paths(variables),
    'full_paths': _paths(models.param_shapes(full)) if full is not None else None,
    'init_sums': init_sums,
  }
  evaluation = model.apply(variables, **inputs, deterministic=True)
  rngs = {'dropout': jax.random.PRNGKey(7)}
  mutable = ['batch_stats'] if 'batch_stats' in variables else False
  training = model.apply(variables, **inputs, deterministic=False, rngs=rngs, mutable=mutable)
  training = training[0] if mutable else training
  arrays = {'eval': np.asarray(evaluation, np.float32), 'train': np.asarray(training, np.float32)}
  # The hook points, in the order the forward pass calls them, on the unscanned model.
  logits, cache = hooks.run(cfg, variables, inputs, names=None)
  out['hook_order'] = list(cache)
  out['hook_names'] = hooks.hook_names(cfg)  # the list `run` selects from
  arrays['hooked'] = np.asarray(logits, np.float32)
  if cfg.family != 'bidirectional_lm':  # decoding: prefill, then one cached step
    prompt = inputs['inputs'][:, :5] if cfg.family == 'causal_lm' else inputs['inputs']
    if cfg.attention == 'compressed':
      prompt = inputs['inputs'][:, :4]
    first, kv, step, start = decode.prefill(model, variables, prompt, 4)
    token = jnp.argmax(first, -1).astype(jnp.int32)
    second, _ = step(token, start, kv)
    arrays['decode'] = np.stack([np.asarray(first), np.asarray(second)])
  return out, arrays


def _write() -> None:
  FROZEN.mkdir(exist_ok=True)
  record = {'jax': jax.__version__, 'xla_flags': os.environ['XLA_FLAGS'], 'cpu': _cpu()}
  record['cases'] = {}
  arrays = {}
  for name, (cfg, full) in cases().items():
    start = time.perf_counter()
    values, logits = compute(cfg, full)
    print(f'{time.perf_counter() - start:5.1f} s', end=' ')
    record['cases'][name] = values
    arrays.update({f'{name}/{k}': v for k, v in logits.items()})
    print(name, {k: v.shape for k, v in logits.items()})
  (FROZEN / 'models.json').write_text(json.dumps(record, indent=0, sort_keys=True) + '\n')
  np.savez_compressed(FROZEN / 'logits.npz', **arrays)


# The instructions XLA:CPU picks its code by: two hosts that differ in these round differently.
_ISA = ('sse4_2', 'avx', 'avx2', 'fma', 'f16c', 'avx512f', 'avx512bw', 'avx512vl', 'avx512_bf16',
        'avx512_vnni', 'avx512vnni', 'amx_bf16', 'amx_tile', 'asimd', 'sve')  # fmt: skip
# XLA:CPU also tunes its code for the host's processor model: an Intel and an AMD host with the
# same instruction sets rounded gpt_tiny's decoding logits differently (by 1.4e-6).
_MODEL = ('vendor_id', 'cpu family', 'model')


def _cpu() -> str:
  """The host's machine, processor model and the instruction sets of _ISA it has (/proc/cpuinfo)."""
  import platform

  fields: dict[str, str] = {}
  try:
    with open('/proc/cpuinfo') as f:
      for line in f:
        key, _, value = line.partition(':')
        fields.setdefault(key.strip(), value.strip())  # the first processor's
  except OSError:
    pass
  flags = set((fields.get('flags') or fields.get('Features') or '').split())
  model = [f'{k.replace(" ", "_")}={fields[k]}' for k in _MODEL if k in fields]
  return ' '.join([platform.machine(), *model, *(isa for isa in _ISA if isa in flags)])


def _frozen():
  record = json.loads((FROZEN / 'models.json').read_text())
  return record, np.load(FROZEN / 'logits.npz')


CASES = cases()
# In the fast suite: one of each family, and a Llama-like decoder. The
# rest (mostly large presets, whose full-size parameter shapes take seconds) run with -m slow.
FAST = {'preset_gpt_tiny', 'preset_bert_tiny', 'preset_transformer_tiny', 'causal_rope_gqa_qknorm'}


@pytest.mark.parametrize(
  'name', [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in sorted(CASES)]
)
def test_paths_hooks_and_logits_stay_frozen(name):
  record, arrays = _frozen()
  frozen = record['cases'][name]
  values, logits = compute(*CASES[name])
  assert values['paths'] == frozen['paths']
  assert values['full_paths'] == frozen['full_paths']
  assert values['hook_order'] == frozen['hook_order']
  assert values['hook_names'] == frozen['hook_names']
  assert values['hook_order'] == values['hook_names']  # every declared point, in call order
  for path, (total, squares) in frozen['init_sums'].items():
    np.testing.assert_allclose(values['init_sums'][path], [total, squares], rtol=1e-5, atol=1e-5)
  keys = sorted(k.split('/')[1] for k in arrays.files if k.startswith(name + '/'))
  assert keys == sorted(logits)
  here = (jax.__version__, os.environ.get('XLA_FLAGS'), _cpu())
  same_jax = (record['jax'], record['xla_flags'], record.get('cpu')) == here
  for key in keys:
    want = arrays[f'{name}/{key}']
    if same_jax:
      np.testing.assert_array_equal(logits[key], want, err_msg=f'{name}/{key}')
    else:  # rounding grows with the magnitudes summed, so the bound scales with the array's
      atol = 1e-5 * max(1.0, float(np.abs(want).max()))
      np.testing.assert_allclose(logits[key], want, rtol=1e-5, atol=atol, err_msg=f'{name}/{key}')


if __name__ == '__main__':
  if sys.argv[1:] != ['--write']:
    sys.exit(__doc__)
  _write()
