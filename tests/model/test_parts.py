"""The parts table: each variant is chosen once, and a forward runs the code of its own parts only.

A line tracer (bench/reading.py's kind) records the library functions one forward pass enters. For
each option below, the functions that belong to it must run exactly when the config uses it: a
model never walks through the code of an option it does not have, and the one it has is the one
that runs.
"""

import inspect
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer.config import ModelConfig
from transformer.model import (
  attention,
  bidirectional,
  compressed_attention,
  encoder_decoder,
  layers,
  linear_attention,
  models,
  norms,
  parts,
  remat,
  scan,
  short_conv,
)


def _code(fn):
  return inspect.unwrap(fn).__code__


# option: (does cfg use it?, the functions only it runs)
OPTIONS = {
  'dense mlp': (
    lambda c: c.d_ff and c.activation not in ('swiglu', 'geglu'),
    [layers.FeedForward._hidden],
  ),
  'gated mlp': (
    lambda c: c.d_ff and c.activation in ('swiglu', 'geglu'),
    [layers.GatedFeedForward._hidden],
  ),
  'mlp sub-layer': (lambda c: c.d_ff > 0, [models.Block._mlp]),
  'cross attention': (
    lambda c: c.family == 'encoder_decoder',
    [encoder_decoder.CrossBlock._sublayers],
  ),
  'token types or embedding norm': (
    lambda c: c.family == 'bidirectional_lm' or c.type_vocab_size or c.embedding_norm,
    [layers.TypedEmbedder._more],
  ),
  'sinusoidal': (lambda c: c.position == 'sinusoidal', [layers.AddSinusoidal.__call__]),
  'learned': (lambda c: c.position == 'learned', [layers.AddLearned.__call__]),
  'rope': (lambda c: c.position == 'rope' and not c.rope_dim, [parts.rope]),
  'partial rope': (lambda c: c.position == 'rope' and c.rope_dim, [parts.partial_rope]),
  'alibi': (lambda c: c.position == 'alibi', [parts.alibi]),
  'scaled embeddings': (lambda c: c.scale_embeddings, [layers.ScaledEmbed.__call__]),
  'layernorm or rmsnorm': (
    lambda c: c.norm != 'batchnorm' or c.qk_norm,
    [layers.RMSNorm.__call__],
  ),
  'layernorm': (lambda c: c.norm == 'layernorm', [layers.LayerNorm._centre]),
  'rmsnorm': (lambda c: c.norm in ('rmsnorm', 'rmsnorm_offset'), [layers.RMSNorm._centre]),
  'norm bias': (lambda c: c.norm == 'layernorm' and c.norm_bias, [layers.BiasedLayerNorm._affine]),
  'batchnorm': (lambda c: c.norm == 'batchnorm', [norms.BatchNorm.__call__]),
  '(1 + w) rmsnorm': (lambda c: c.norm == 'rmsnorm_offset', [layers.OffsetNorm._affine]),
  'soft-capped head': (lambda c: c.logit_softcap, [models._Softcapped.__call__]),
  'per-layer windows': (lambda c: c.attention_layers, [layers.patterned]),
  'pre-norm': (
    lambda c: c.norm_placement == 'pre' and c.residual and not c.parallel_residual,
    [layers.pre_norm],
  ),
  'post-norm': (lambda c: c.norm_placement == 'post' and c.residual, [layers.post_norm]),
  'no residual, pre': (
    lambda c: c.norm_placement == 'pre' and not c.residual,
    [layers.pre_norm_no_residual],
  ),
  'no residual, post': (
    lambda c: c.norm_placement == 'post' and not c.residual,
    [layers.post_norm_no_residual],
  ),
  'sandwich': (
    lambda c: c.norm_placement == 'sandwich' and c.residual,
    [layers.sandwich_norm],
  ),
  'sequential block': (lambda c: not c.parallel_residual, [layers.sequential]),
  'parallel block': (lambda c: c.parallel_residual, [layers.parallel]),
  'short convolution': (lambda c: c.short_conv > 0, [short_conv.ShortConv.__call__]),
  'scan': (lambda c: c.scan_layers, [scan.scan]),
  'loop': (lambda c: not c.scan_layers and not c.attention_layers, [layers.loop]),
  'remat': (lambda c: c.remat != 'none', [remat._lift_checkpoint]),
  'softmax': (lambda c: c.attention == 'softmax', [attention.softmax_attend]),
  'linear attention': (lambda c: c.attention == 'linear', [linear_attention.attend]),
  'compressed attention': (lambda c: c.attention == 'compressed', [compressed_attention.attend]),
  'tied head': (
    lambda c: c.family != 'bidirectional_lm' and c.tie_output,
    [models.TiedHead.__call__],
  ),
  'untied head': (
    lambda c: c.family != 'bidirectional_lm' and not c.tie_output,
    [models.UntiedHead.__call__],
  ),
  'masked-LM head': (
    lambda c: c.family == 'bidirectional_lm' and c.output_head and not c.num_classes,
    [bidirectional._masked_lm],
  ),
  'classifier head': (lambda c: c.num_classes > 0, [bidirectional._classifier]),
  'no head': (lambda c: not c.output_head, [bidirectional._hidden_states]),
}

_BASE = dict(vocab_size=40, d_model=16, num_heads=2, d_ff=24, num_layers=2, max_length=16)
CONFIGS = {
  'gpt2': dict(family='causal_lm', position='learned', norm_placement='pre', activation='gelu'),
  'llama': dict(family='causal_lm', position='rope', norm='rmsnorm', norm_placement='pre',
                activation='swiglu', tie_output=False, scale_embeddings=False, qk_norm=True),
  'transformer': dict(family='encoder_decoder'),
  'bert': dict(family='bidirectional_lm', position='learned', embedding_norm=True,
               type_vocab_size=2, activation='gelu'),
  'bert_classifier': dict(family='bidirectional_lm', num_classes=3, norm='batchnorm'),
  'bert_hidden': dict(family='bidirectional_lm', output_head=False, position='none'),
  'alibi_attention_only': dict(family='causal_lm', position='alibi', d_ff=0, residual=False),
  'no_residual_pre': dict(family='causal_lm', norm_placement='pre', residual=False),
  'linear_scan_remat': dict(family='causal_lm', attention='linear', scan_layers=True,
                            remat='full', position='rope'),
  'neox_parallel': dict(family='causal_lm', norm_placement='pre', parallel_residual=True,
                        position='rope', rope_dim=4),
  'gemma_sandwich': dict(family='causal_lm', norm_placement='sandwich', norm='rmsnorm_offset',
                         activation='geglu', position='rope', attention_layers='LG',
                         window=(3, 0), rope_local_theta=100.0, attention_softcap=20.0,
                         logit_softcap=10.0, query_pre_attn_scalar=6.0),
  'compressed_conv': dict(family='causal_lm', attention='compressed', compress_block=4,
                          short_conv=3, norm_placement='pre'),
}  # fmt: skip


def _entered(cfg: ModelConfig) -> set:
  """The code objects that one forward pass of `cfg`'s model enters (the parts table is built
  before, by init, as a model is built once and applied many times)."""
  model = models.build(cfg)
  inputs = {k: v[:, :8] for k, v in model.dummy_inputs(2, 8).items()}
  variables = models.init_variables(model, jax.random.PRNGKey(0))
  seen = set()

  def tracer(frame, event, arg):
    seen.add(frame.f_code)

  previous = sys.getprofile()
  sys.setprofile(tracer)
  try:
    jax.eval_shape(lambda v: model.apply(v, **inputs), variables)
  finally:
    sys.setprofile(previous)
  return seen


@pytest.mark.parametrize('name', sorted(CONFIGS))
def test_a_forward_runs_the_parts_of_its_options_and_no_others(name):
  cfg = ModelConfig(**{**_BASE, **CONFIGS[name]})
  entered = _entered(cfg)
  wrong = []
  for option, (used, functions) in OPTIONS.items():
    for fn in functions:
      if bool(used(cfg)) != (_code(fn) in entered):
        wrong.append(f'{option}: {fn.__qualname__} {"did not run" if used(cfg) else "ran"}')
  assert wrong == [], wrong


def test_the_table_is_chosen_once_per_config():
  cfg = ModelConfig(**{**_BASE, **CONFIGS['gpt2']})
  assert parts.parts(cfg) is parts.parts(cfg.replace())  # memoised on the frozen config
  assert parts.parts(cfg) is not parts.parts(cfg.replace(norm='rmsnorm'))
  assert parts.parts(cfg).sublayer is layers.pre_norm
  assert parts.parts(cfg.replace(norm_placement='post')).sublayer is layers.post_norm


def test_every_norm_kind_has_one_call_signature():
  x = jnp.asarray(jax.random.normal(jax.random.PRNGKey(0), (2, 3, 8)))
  segments = jnp.asarray([[1, 1, 0], [1, 1, 1]])
  for kind in ('layernorm', 'rmsnorm', 'batchnorm', 'rmsnorm_offset'):
    norm = parts.parts(ModelConfig(**{**_BASE, 'norm': kind})).norm()
    variables = norm.init(jax.random.PRNGKey(1), x, segments, False)
    y = norm.apply(variables, x, segments, True)  # deterministic: running statistics
    assert y.shape == x.shape, kind


@pytest.mark.parametrize('kind', ['layernorm', 'rmsnorm', 'rmsnorm_offset'])
def test_the_analyses_numpy_norm_is_the_models_norm(kind):
  rng = np.random.default_rng(0)
  x = rng.standard_normal((2, 5, 8)) * 3 + 1
  weights = {'scale': rng.standard_normal(8) + 1}
  if kind == 'layernorm':
    weights['bias'] = rng.standard_normal(8)
  module = parts.parts(ModelConfig(**{**_BASE, 'norm': kind, 'norm_eps': 1e-5})).norm()
  want = module.apply({'params': weights}, jnp.asarray(x, jnp.float32))
  got = norms.normalized(kind, x, 1e-5, weights['scale'], weights.get('bias'))
  np.testing.assert_allclose(got, np.asarray(want, np.float64), rtol=1e-5, atol=1e-5)


def test_an_analysis_refuses_a_norm_it_cannot_reapply():
  from research import dissect

  cfg = ModelConfig(**{**_BASE, **CONFIGS['gpt2'], 'norm': 'batchnorm'})
  params = models.init_params(models.build(cfg), jax.random.PRNGKey(0))
  message = "the logit lens reapplies the model's norm .* this model has norm='batchnorm'"
  with pytest.raises(ValueError, match=message):
    dissect.logit_lens(cfg, params, [np.zeros((3, cfg.d_model))])


def test_a_gpt_forward_reads_four_library_files():
  """GPT's forward runs code in four files only: the family (block and stack included), the
  layers, the attention and the mask rule (docs/architecture.md, "How far a reader walks")."""
  import os

  import transformer
  from bench import reading

  cfg = ModelConfig(**{**_BASE, **CONFIGS['gpt2']})
  model, tokens = models.build(cfg), jnp.ones((2, 8), jnp.int32)
  variables = models.init_variables(model, jax.random.PRNGKey(0))
  root = os.path.dirname(transformer.__file__)
  seen = reading.lines_run(lambda: models.build(cfg).apply(variables, tokens), root)
  files = sorted(os.path.relpath(f, root) for f in seen)
  assert files == ['kernels/masks.py', 'model/attention.py', 'model/layers.py', 'model/models.py']


@pytest.mark.parametrize('norm_bias', [False, True])
def test_qk_norm_is_the_models_norm_with_its_bias_setting(norm_bias):
  cfg = ModelConfig(**{**_BASE, **CONFIGS['gpt2'], 'qk_norm': True, 'norm_bias': norm_bias})
  shapes = models.param_shapes(cfg)['decoder']['stack']['layer_0']
  for name in ('query_norm', 'key_norm'):
    got = shapes['self_attention'][name]
    assert sorted(got) == (['bias', 'scale'] if norm_bias else ['scale'])
    assert got['scale'].shape == (cfg.head_size,)
  assert sorted(shapes['self_attention_norm']) == sorted(got)  # the same norm as the block's
