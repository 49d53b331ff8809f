"""One-call reload of a trained run or a Hugging Face folder: `m = transformer.load('runs/gpt')`.

`load` reads a workdir (config.json, the latest good checkpoint, tokenizer/) onto whatever devices
this machine has, whatever mesh trained it, or converts a Hugging Face model folder in memory, and
returns a `Model` that generates, translates, fills masks, scores text, embeds sentences, returns
raw logits, hidden states and attention maps.
"""

from __future__ import annotations

import functools
import json
import numbers
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from transformer import data
from transformer.config import ModelConfig, experiment
from transformer.inference import cache as cache_lib
from transformer.inference import lens
from transformer.inference import weights as weights_lib
from transformer.model import decode, models
from transformer.model import hooks as hooks_lib

Array = jax.Array
MASK_TEXT = '[MASK]'  # what fill_mask replaces
# Rows longer than this many times max_length are refused (learned positions stop at max_length):
# attention costs length^2, so a huge input would exhaust memory instead of giving an answer.
LENGTH_FACTOR = 16
SLIDE_LIMIT = 2**16  # tokens one generate call makes past the context of learned positions


def load(
  workdir: str,
  step: int | None = None,
  *,
  param_dtype: str = 'float32',
  process_weights: bool = False,
  refactor_factored_attn_matrices: bool = False,
) -> Model:
  """The model, parameters, config and tokenizer of `workdir` (its latest checkpoint by default),
  or of a Hugging Face model folder (config.json + safetensors), converted in memory.

  `param_dtype` (Hugging Face folders): float32 | bfloat16 | float16 | keep (the file's dtype).
  `process_weights`: TransformerLens's processing with its defaults (`Model.process_weights`);
  `refactor_factored_attn_matrices` adds its refactoring of each head's QK and OV factors.

  Raises:
    FileNotFoundError: no such workdir, no config.json in it, or no checkpoint.
    ValueError: the checkpoint does not fit the saved config, or it is corrupt.
  """
  from transformer.inference import hf

  if hf.is_hf_dir(workdir) and not os.path.isdir(os.path.join(workdir, 'checkpoints')):
    config, cfg, params, directory = hf.convert_in_memory(workdir, param_dtype=param_dtype)
    params = jax.tree_util.tree_map(jnp.asarray, params)
    tokenizer = _hf_tokenizer(directory, os.path.join(directory, 'config.json'))
    model = Model(cfg, params, config, tokenizer, 0, workdir)
    return _processed(model, process_weights, refactor_factored_attn_matrices)
  from transformer.training.workdir import load_run  # the loop's siblings; keep `import` light

  run, state, step = load_run(workdir, step, with_data=False)
  tokenizer_dir = os.path.join(workdir, 'tokenizer')
  tokenizer = None
  if os.path.isdir(tokenizer_dir):
    tokenizer = _hf_tokenizer(tokenizer_dir, os.path.join(workdir, hf.HF_CONFIG))
  stats = getattr(state, 'batch_stats', None)  # a batchnorm model's running statistics
  model = Model(run.model_cfg, state.params, run.config, tokenizer, step, workdir, stats)
  return _processed(model, process_weights, refactor_factored_attn_matrices)


def _processed(model: Model, process: bool, refactor: bool) -> Model:
  """`load`'s processing: TransformerLens's four defaults when `process`, the refactoring when
  `refactor` (alone, if only it is asked for)."""
  if not (process or refactor):
    return model
  steps = ('fold_ln', 'center_writing_weights', 'center_unembed', 'fold_value_biases')
  return model.process_weights(
    **dict.fromkeys(steps, process), refactor_factored_attn_matrices=refactor
  )


def _hf_tokenizer(directory: str, hf_config_path: str):
  """The tokenizer of `directory` (None without one); a Hugging Face one gets the bos/eos ids of
  the model's config.json where its tokenizer_config.json names none."""
  if not os.path.isfile(os.path.join(directory, 'tokenizer.json')):
    return None
  tokenizer = data.load_tokenizer(directory)
  if tokenizer.kind != 'hf' or not os.path.isfile(hf_config_path):
    return tokenizer
  with open(hf_config_path) as f:
    hf_config = json.load(f)
  for name in ('bos', 'eos', 'pad'):
    value = hf_config.get(f'{name}_token_id')
    value = value[0] if isinstance(value, list) and value else value
    if getattr(tokenizer, f'{name}_id', None) is None and isinstance(value, int):
      setattr(tokenizer, f'{name}_id', value)
  return tokenizer


class Model(lens.Lens):
  """A trained or imported model ready to use: `generate`, `translate`, `fill_mask`, `score`,
  `embed`, `logits`, `hidden_states`, `attention_maps`. Text methods need a tokenizer; `logits` and
  `hidden_states` take token ids. A model.norm='batchnorm' model also has `batch_stats`, the
  running statistics it normalises by."""

  def __init__(
    self,
    cfg: ModelConfig,
    params: Any,
    config,
    tokenizer,
    step: int,
    workdir: str,
    batch_stats: Any = None,
  ):
    self.cfg, self.params, self.config, self.tokenizer = cfg, params, config, tokenizer
    self.step, self.workdir, self.batch_stats = step, workdir, batch_stats
    self.module = models.build(cfg)

  @property
  def weights(self) -> Any:
    """What the model is applied with: `params`, or with `batch_stats` the variables dict."""
    if self.batch_stats is None:
      return self.params
    return {'params': self.params, 'batch_stats': self.batch_stats}

  def __repr__(self) -> str:
    return (
      f'Model({self.cfg.family}, {models.count_params(self.cfg):,} parameters, step {self.step}, '
      f'workdir={self.workdir!r})'
    )

  def process_weights(
    self,
    *,
    fold_ln: bool = True,
    center_writing_weights: bool = True,
    center_unembed: bool = True,
    fold_value_biases: bool = True,
    refactor_factored_attn_matrices: bool = False,
  ) -> Model:
    """This model with TransformerLens's weight processing (`inference/weights.py`): the same
    log-probabilities, the logits moved by one constant per position, the norms folded into the
    next matrices and the residual stream centred; optionally each head's QK and OV products
    refactored into even, orthogonal factors. Pre-LN LayerNorm models with biases (GPT-2)."""
    cfg, params = weights_lib.process_weights(
      self.cfg, self.params, fold_ln=fold_ln, center_writing_weights=center_writing_weights,
      center_unembed=center_unembed, fold_value_biases=fold_value_biases,
      refactor_factored_attn_matrices=refactor_factored_attn_matrices,
    )  # fmt: skip
    params = jax.tree_util.tree_map(jnp.asarray, params)
    return Model(cfg, params, self.config, self.tokenizer, self.step, self.workdir)

  # Text in, text out -----------------------------------------------------------------------------
  def generate(
    self,
    prompts: str | list[str],
    max_new_tokens: int = 50,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    beam_size: int = 1,
    alpha: float = 0.6,
    seed: int = 0,
  ) -> list[str]:
    """Continuations of each prompt (CausalLM): greedy, beam search or sampling.

    Each prompt starts as the model was trained: after a bos, after the document separator
    (a corpus), or bare (a running text). On the KV cache while the row fits the context; past it,
    a model with learned positions goes on from the last max_length tokens, as nanoGPT does, and
    RoPE, ALiBi, sinusoidal and position-free models keep the cache up to LENGTH_FACTOR x
    max_length positions.
    """
    self._need('causal_lm', 'generate')
    self._check_knobs(beam_size, seed)
    prefix = self.prompt_prefix()
    ids = [prefix + self._encode(p) for p in _as_list(prompts, 'prompts')]
    if not min(map(len, ids)):
      raise ValueError(
        'an empty prompt gives a model trained on a running text nothing to continue; give it at '
        "least one token (nanoGPT's sample.py starts from '\\n')"
      )
    eos = _or(_special(self.tokenizer, 'eos_id', data.EOS_ID), -1)
    if self.config is not None and data.running_text(self._data, self.cfg.family):
      eos = -1  # a running text has no end: generate exactly max_new_tokens
    options = dict(temperature=temperature, top_k=top_k, top_p=top_p, eos_id=eos)
    longest, context = max(map(len, ids)), self.cfg.max_length
    slide = self.cfg.position == 'learned' and _is_int(max_new_tokens)
    slide = slide and longest + max_new_tokens - 1 > context
    if not slide:
      if _is_int(max_new_tokens):
        self._check_length(longest + max_new_tokens - 1, 'prompt + max_new_tokens')
      out = decode.generate(
        self.module, self.weights, _pad(ids), max_new_tokens=max_new_tokens, beam_size=beam_size,
        alpha=alpha, rng=_rng(seed, temperature), **options,
      )  # fmt: skip
      return self._decode(out)
    if max_new_tokens > SLIDE_LIMIT:
      raise ValueError(
        f'max_new_tokens={max_new_tokens} past the context of {context} positions: at most '
        f'{SLIDE_LIMIT} a call (each runs a window afresh); generate in pieces'
      )
    if beam_size != 1:
      raise ValueError(
        f'beam_size={beam_size} searches within the context of {context} positions; prompt + '
        f'max_new_tokens is {longest + max_new_tokens - 1}: sample or decode greedily past it'
      )
    rng = _rng(seed, temperature)
    # On the KV cache until the longest row fills the context, then window by window.
    cached = max(0, context - longest + 1) if longest <= context else 0
    rows, done = [row[-context:] for row in ids], None  # the window a token is predicted from
    if cached:
      first = decode.generate(
        self.module, self.weights, _pad(rows), max_new_tokens=cached, rng=rng, **options
      )
      first = np.asarray(first)
      done = (first == eos).any(axis=1)
      rows = [row + _until_eos(new, eos) for row, new in zip(ids, first.tolist())]
    rest = max_new_tokens - cached
    lengths = np.array([len(r) for r in rows], np.int32)
    key = None if rng is None else jax.random.fold_in(rng, 1)
    more = decode.generate_sliding(
      self.module, self.weights, _pad(rows), lengths, max_new_tokens=rest, rng=key, **options
    )
    more = np.array(more)
    if done is not None:
      more[done] = data.PAD_ID  # a row that ended stays ended
      out = np.concatenate([first, more], axis=1)
    else:
      out = more
    return self._decode(out)

  @functools.cached_property
  def _data(self) -> experiment.DataConfig:
    """The typed data knobs the model was trained with (self.config is not None)."""
    return experiment.section(experiment.DataConfig, self.config.data)

  def prompt_prefix(self) -> list[int]:
    """The ids before every prompt, as in training: [] after a running text (task='text'),
    the document separator after a corpus, else bos (if the tokenizer has one)."""
    tokenizer = self.tokenizer
    if tokenizer is not None and tokenizer.kind != 'hf' and self.config is not None:
      found = data.prompt_prefix(self._data, self.cfg.family, tokenizer)
      if found is not None:
        return found
    bos = _special(tokenizer, 'bos_id', data.BOS_ID)
    return [] if bos is None else [bos]

  def translate(
    self,
    sources: str | list[str],
    *,
    beam_size: int = 4,
    alpha: float = 0.6,
    max_length: int | None = None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
  ) -> list[str]:
    """Translations of each source (EncoderDecoder); beam 4, alpha 0.6 as in the paper."""
    self._need('encoder_decoder', 'translate')
    self._check_knobs(beam_size, seed)
    ids = [self._encode(s) + [data.EOS_ID] for s in _as_list(sources, 'sources')]
    self._check_length(max(map(len, ids)), 'the longest source')
    if max_length is None:
      max_length = self.config.train.get('max_decode_length', 64)
    if _is_int(max_length):
      self._check_length(max_length, 'max_length')
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, rng=_rng(seed, temperature))
    search = dict(max_length=max_length, beam_size=beam_size, alpha=alpha)
    out = decode.translate(self.module, self.weights, _pad(ids), **search, **sampling)
    return self._decode(out)

  def fill_mask(self, texts: str | list[str], top_k: int = 1) -> list[dict]:
    """Fills every `[MASK]` of each text (BidirectionalLM) with its most likely tokens.

    Returns, per text: {'text': the text with each mask replaced by its best token,
    'candidates': per mask, the `top_k` (token text, probability) pairs}.
    """
    self._need('bidirectional_lm', 'fill_mask')
    vocab = self.cfg.vocab_size
    if not _is_int(top_k) or not 1 <= top_k <= vocab:
      raise ValueError(f'top_k={top_k!r} must be an int in [1, {vocab}] (the vocabulary size)')
    rows, where = [], []
    for text in _as_list(texts):
      if MASK_TEXT not in text:
        raise ValueError(f'fill_mask needs {MASK_TEXT} in each text; got {text!r}')
      ids = [data.BOS_ID]
      for i, piece in enumerate(text.split(MASK_TEXT)):
        if i:
          ids.append(data.MASK_ID)
        ids += self._encode(piece)
      rows.append(ids + [data.EOS_ID])
      where.append([j for j, t in enumerate(ids) if t == data.MASK_ID])
    tokens = _pad(rows)
    probs = np.asarray(jax.nn.softmax(self.logits(tokens, mask=tokens != data.PAD_ID), -1))
    results = []
    for row, positions, text in zip(probs, where, _as_list(texts)):
      candidates, filled = [], text
      for position in positions:
        best = np.argsort(-row[position])[:top_k]
        pairs = [(self.tokenizer.decode([int(t)]), float(row[position, t])) for t in best]
        candidates.append(pairs)
        filled = filled.replace(MASK_TEXT, pairs[0][0], 1)
      results.append({'text': filled, 'candidates': candidates})
    return results

  def score(self, texts: str | list[str], sources: list[str] | None = None) -> list[dict]:
    """Per-token log-probabilities and perplexity of each text (+ eos).

    CausalLM scores the text itself; EncoderDecoder scores each text as the translation of the
    matching `sources` entry. Returns per text: {'tokens', 'log_probs' (nats, one per token
    including eos), 'nll' (their negative sum), 'perplexity'}.
    """
    texts = _as_list(texts)
    ids = [self._encode(t) for t in texts]
    eos = _special(self.tokenizer, 'eos_id', data.EOS_ID)
    if self.config is not None and data.running_text(self._data, self.cfg.family):
      eos = None  # a running text has no document end
    if self.cfg.family == 'causal_lm':  # without a prefix, the first token is context only
      rows = [self.prompt_prefix() + row + ([] if eos is None else [eos]) for row in ids]
      self._check_length(max(map(len, rows)) - 1, 'the longest text + eos')
      decoder_inputs, targets = _pad([r[:-1] for r in rows]), _pad([r[1:] for r in rows])
      lengths = [len(r) - 1 for r in rows]
      mask = np.arange(decoder_inputs.shape[1])[None] < np.array(lengths)[:, None]
      logits = self.logits(decoder_inputs, mask=mask)
    elif self.cfg.family == 'encoder_decoder':
      if sources is None or len(_as_list(sources, 'sources')) != len(texts):
        raise ValueError(
          f'EncoderDecoder.score needs sources=[one source text per text] ({len(texts)}); '
          f'got {sources!r:.60}'
        )
      self._check_length(max(map(len, ids)) + 1, 'the longest text + eos')
      targets = _pad([row + [data.EOS_ID] for row in ids])
      decoder_inputs = _pad([[data.BOS_ID] + row for row in ids])
      lengths = [len(row) + 1 for row in ids]
      inputs = _pad([self._encode(s) + [data.EOS_ID] for s in _as_list(sources)])
      logits = self.logits(inputs, decoder_tokens=decoder_inputs)
    else:
      raise ValueError(
        "score needs family 'causal_lm' or 'encoder_decoder'; this model is 'bidirectional_lm' "
        '(use fill_mask)'
      )
    logp = np.asarray(jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), -1))
    results = []
    for i, n in enumerate(lengths):
      per_token = logp[i, np.arange(n), targets[i, :n]]
      nll = float(-per_token.sum())
      tokens = [self.tokenizer.decode([int(t)]) or '</s>' for t in targets[i, :n]]
      perplexity = float(np.exp(nll / n))
      results.append(
        {'tokens': tokens, 'log_probs': per_token.tolist(), 'nll': nll, 'perplexity': perplexity}
      )
    return results

  # Arrays in, arrays out -----------------------------------------------------------------------
  def logits(
    self,
    tokens: Any,
    mask: Any = None,
    token_types: Any = None,
    *,
    decoder_tokens: Any = None,
  ) -> np.ndarray:
    """Raw logits float32 [B, T, V] for int tokens [B, T]; `mask` 1 = real token, 0 = padding.

    EncoderDecoder: `tokens` are the source and `decoder_tokens` [B, T'] the decoder inputs
    (padding 0); the logits are the decoder's. BidirectionalLM takes `token_types` [B, T].
    """
    tokens = self._token_ids(tokens, 'tokens')
    kwargs = {}
    if mask is not None:
      mask = _array(mask, 'mask')
      if mask.shape != tokens.shape:
        raise ValueError(f'mask shape {mask.shape} must equal tokens shape {tokens.shape}')
      if mask.dtype.kind not in 'biuf' or not np.isin(mask, (0, 1)).all():
        raise ValueError(f'mask must hold only 0 (padding) and 1 (token); got {mask.dtype} values')
      kwargs['inputs_segments' if self.cfg.family == 'encoder_decoder' else 'segments'] = (
        mask.astype(np.int32)
      )
    if token_types is not None:
      if self.cfg.family != 'bidirectional_lm':
        raise ValueError('token_types are for bidirectional_lm models')
      types = _int_array(token_types, 'token_types')
      if types.shape != tokens.shape:
        raise ValueError(f'token_types shape {types.shape} must equal tokens shape {tokens.shape}')
      if types.min() < 0 or types.max() >= max(self.cfg.type_vocab_size, 1):
        raise ValueError(
          f'token_types must be in [0, {max(self.cfg.type_vocab_size, 1)}) '
          f'(config type_vocab_size={self.cfg.type_vocab_size})'
        )
      kwargs['token_types'] = types
    if self.cfg.family == 'encoder_decoder':
      if decoder_tokens is None:
        raise ValueError('EncoderDecoder.logits needs decoder_tokens=[B, T] decoder inputs')
      decoder_tokens = self._token_ids(decoder_tokens, 'decoder_tokens')
      if decoder_tokens.shape[0] != tokens.shape[0]:
        raise ValueError(
          f'decoder_tokens has {decoder_tokens.shape[0]} rows and tokens {tokens.shape[0]}; '
          'give one decoder row per source row'
        )
      return np.asarray(_apply(self.module, self.weights, tokens, decoder_tokens, **kwargs))
    return np.asarray(_apply(self.module, self.weights, tokens, **kwargs))

  def hidden_states(
    self, tokens: Any, mask: Any = None, token_types: Any = None, *, layers: bool = False
  ) -> np.ndarray:
    """Final hidden states float32 [B, T, D] (after the final norm where the model has one).

    `layers=True` returns [L + 1, B, T, D]: the embeddings, then each layer's output, the last one
    after the final norm (Hugging Face's `output_hidden_states`). LM families only.
    """
    if self.cfg.family == 'encoder_decoder':
      raise ValueError('hidden_states needs a causal_lm or bidirectional_lm model')
    tokens = self._token_ids(tokens, 'tokens')
    inputs = {'inputs': tokens}
    if mask is not None:
      mask = np.asarray(mask)
      if mask.shape != tokens.shape:
        raise ValueError(f'mask shape {mask.shape} must equal tokens shape {tokens.shape}')
      inputs['segments'] = mask.astype(np.int32)
    if token_types is not None:
      if self.cfg.family != 'bidirectional_lm':
        raise ValueError('token_types are for bidirectional_lm models')
      inputs['token_types'] = _int_array(token_types, 'token_types')
    blocks = [f'blocks.{i}.hook_resid_post' for i in range(self.cfg.num_layers)]
    last = 'ln_final.hook_out' if self.cfg.norm_placement == 'pre' else blocks[-1]
    names = ['blocks.0.hook_resid_pre', *blocks, last] if layers else [last]
    _, seen = hooks_lib.run_xla(self.cfg, self.weights, inputs, names)
    final = seen[last].astype(np.float32)
    if not layers:
      return final
    stacked = [seen[name] for name in names[:-2]] + [final]  # the embeddings, then each layer
    return np.stack(stacked).astype(np.float32)  # [L + 1, B, T, D]

  def embed(
    self, texts: str | list[str], *, pooling: str = 'mean', normalize: bool = True
  ) -> np.ndarray:
    """Sentence embeddings float32 [len(texts), D] from the final hidden states.

    Texts are tokenised with the tokenizer's special tokens ([CLS] ... [SEP] for BERT) and cut to
    max_length. pooling='mean' averages over the real tokens (sentence-transformers), 'cls' takes
    the first token; `normalize` scales each embedding to unit L2 norm.
    """
    if pooling not in ('mean', 'cls'):
      raise ValueError(f"pooling={pooling!r} is not valid; choose 'mean' or 'cls'")
    rows = []
    for text in _as_list(texts):
      if getattr(self.tokenizer, 'kind', None) == 'hf':
        ids = self.tokenizer.encode(text, add_special_tokens=True)
      else:
        ids = [data.BOS_ID] + self._encode(text) + [data.EOS_ID]
      rows.append(ids[: self.cfg.max_length])
    tokens = _pad(rows)
    mask = (np.arange(tokens.shape[1])[None] < np.array([len(r) for r in rows])[:, None]).astype(
      np.int32
    )
    hidden = self.hidden_states(tokens, mask=mask).astype(np.float64)  # [B, T, D]
    if pooling == 'cls':
      pooled = hidden[:, 0]
    else:
      pooled = (hidden * mask[..., None]).sum(1) / np.maximum(mask.sum(1, keepdims=True), 1)
    if normalize:
      pooled = pooled / np.maximum(np.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)
    return pooled.astype(np.float32)  # [B, D]

  # `model.embed.W_E` as TransformerLens's, beside sentence embeddings (lens.WithWeights).
  embed = lens.WithWeights(embed, W_E=lambda model: model.W_E)

  def attention_maps(self, text: str | Any, *, source: str | None = None) -> dict[str, np.ndarray]:
    """Attention probabilities per layer: {'blocks.0.attn.hook_pattern': float32 [N, T, S], ...},
    through the 'xla' path (the names of `run_with_cache`).

    `text` is a string (tokenised like training input) or int token ids [T]. EncoderDecoder: the
    decoder side gets `text` and the encoder `source`.
    """
    inputs = self._hook_inputs(text, source, 'attention_maps')
    patterns = lambda name: name.endswith('hook_pattern')
    _, maps = hooks_lib.run_xla(self.cfg, self.weights, inputs, patterns)
    return {name: m[0] for name, m in maps.items()}

  def run_with_cache(
    self,
    text: str | Any,
    *,
    names: Any = None,
    names_filter: Any = None,
    source: str | None = None,
    remove_batch_dim: bool = False,
    return_type: str | None = 'logits',
    loss_per_token: bool = False,
    stop_at_layer: int | None = None,
    fwd_hooks: list | None = None,
    reset_hooks_end: bool = True,
  ) -> tuple[Any, cache_lib.ActivationCache]:
    """(logits, cache) of one forward pass, keeping only the activations that `names` (or
    TransformerLens's `names_filter`) asks for: a list of names such as
    'blocks.0.attn.hook_pattern' (`transformer.model.hooks.hook_names(cfg)` lists them), a
    predicate on them, or None (all). The cache is an `ActivationCache`: a Mapping by full name
    that also takes TransformerLens's shorthand (`cache['pattern', 0]`) and has its helpers.

    `text`: a string (tokenised like training input), or int token ids [T] or [B, T].
    EncoderDecoder: the decoder side gets `text` and the encoder `source`. `return_type`,
    `loss_per_token` and `stop_at_layer` are `forward`'s; `remove_batch_dim` drops the batch
    axis of a one-row cache. `fwd_hooks` run as in `run_with_hooks`, and the cache holds what
    they returned, for this call only; hooks put on with `add_hook` stay until `reset_hooks`, as
    TransformerLens 4.3's bridge keeps them (`reset_hooks_end` is accepted for its signature).
    """
    if names is not None and names_filter is not None:
      raise ValueError('give names or names_filter (the same thing), not both')
    names = names_filter if names is None else names
    inputs = self._hook_inputs(text, source, 'run_with_cache')
    del reset_hooks_end  # fwd_hooks never outlive the call
    out, seen = self._forward(inputs, names, fwd_hooks, return_type, loss_per_token, stop_at_layer)
    cache = cache_lib.ActivationCache(seen, self)
    return out, cache.remove_batch_dim() if remove_batch_dim else cache

  def run_with_hooks(
    self,
    text: str | Any,
    hooks: dict | None = None,
    *,
    fwd_hooks: list | None = None,
    source: str | None = None,
    return_type: str | None = 'logits',
    loss_per_token: bool = False,
    stop_at_layer: int | None = None,
    reset_hooks_end: bool = True,
  ) -> Any:
    """Logits with hooks applied: TransformerLens's `fwd_hooks=[(name or predicate on names,
    fn), ...]`, or `hooks={name: fn}`. Each fn is called as fn(activation, hook), `hook.name`
    and `hook.layer()` saying where, and returns a replacement (e.g. one head's hook_z zeroed)
    or None to leave it unchanged. `return_type`, `loss_per_token` and `stop_at_layer` are
    `forward`'s.

    A loop of calls whose hooks differ only in Python numbers (a layer, a position, a head) or
    in the arrays they read compiles once: those are the compiled forward's arguments, and the
    hooks' Python runs again at each call on the activations' shapes (docs/dissect.md)."""
    inputs = self._hook_inputs(text, source, 'run_with_hooks')
    both = [*(hooks or {}).items(), *(fwd_hooks or [])]
    del reset_hooks_end  # fwd_hooks never outlive the call; add_hook's stay, as in TL 4.3
    return self._forward(inputs, (), both, return_type, loss_per_token, stop_at_layer)[0]

  # TransformerLens's forward and tokens ----------------------------------------------------
  def __call__(
    self,
    tokens: str | list[str] | Any,
    return_type: str | None = 'logits',
    loss_per_token: bool = False,
    stop_at_layer: int | None = None,
  ) -> Any:
    """TransformerLens's forward on token ids [B, T] or [T], or text (`to_tokens`, bos first):
    the logits [B, T, V] (NumPy float32), the mean next-token loss, (logits, loss) for 'both',
    or None. `loss_per_token` gives the loss [B, T - 1]. `stop_at_layer=L` returns the residual
    stream before block L (`blocks.L.hook_resid_pre`, [B, T, D]; negative counts from the end);
    the blocks from L on never run."""
    if self.cfg.family == 'encoder_decoder':
      raise ValueError('forward needs a causal_lm or bidirectional_lm model; use logits()')
    if isinstance(tokens, str) or (
      isinstance(tokens, list) and tokens and isinstance(tokens[0], str)
    ):
      tokens = self.to_tokens(tokens)
    inputs = self._hook_inputs(tokens, None, 'forward')
    return self._forward(inputs, (), None, return_type, loss_per_token, stop_at_layer)[0]

  forward = __call__

  def loss_fn(self, logits: Any, tokens: Any, per_token: bool = False) -> np.ndarray:
    """TransformerLens's `loss_fn`: the mean next-token NLL of `tokens` [B, T] under `logits`
    [B, T, V], or per token [B, T - 1]."""
    return cache_lib.loss(logits, tokens, per_token)

  def to_tokens(self, text: str | list[str], prepend_bos: bool = True) -> np.ndarray:
    """int32 ids [B, T] of a text or a list of texts, each after the prefix the model was trained
    with (`prompt_prefix`: the tokenizer's bos for an imported model) unless `prepend_bos` is
    False; shorter rows are right-padded with the tokenizer's pad id (else its eos, else 0)."""
    prefix = self.prompt_prefix() if prepend_bos else []
    rows = [prefix + self._encode(t) for t in _as_list(text, 'text')]
    pad = _special(self.tokenizer, 'pad_id', data.PAD_ID)
    pad = _or(pad, _or(_special(self.tokenizer, 'eos_id', data.EOS_ID), 0))
    out = np.full((len(rows), max(map(len, rows))), pad, np.int32)
    for i, row in enumerate(rows):
      out[i, : len(row)] = row
    return out

  def to_str_tokens(self, text: str | Any, prepend_bos: bool = True) -> list:
    """Each token of a text as a string (with the bos prefix, as `to_tokens`), or of ids [T] or
    [1, T]; ids [B, T] give one list per row. Special tokens show their names ('<|endoftext|>')."""
    ids = self.to_tokens(text, prepend_bos) if isinstance(text, str) else _array(text, 'text')
    if ids.ndim == 2 and ids.shape[0] == 1:
      ids = ids[0]
    if ids.ndim == 2:
      return [self.to_str_tokens(row) for row in ids]
    return [self.tokenizer.piece(int(t)) for t in ids]  # the bos as '<|endoftext|>', as TL

  def to_single_token(self, text: str) -> int:
    """The id of a string that is exactly one token (' John'); anything else is an error."""
    ids = self._encode(text)
    if len(ids) != 1:
      raise ValueError(f'{text!r} is {len(ids)} tokens, {ids}; to_single_token needs exactly one')
    return int(ids[0])

  def _forward(self, inputs, names, hooks, return_type, per_token, stop_at_layer):
    """(what `return_type` asks for, or the residual stream at `stop_at_layer`; {name: value} in
    forward order, as TransformerLens lists its cache)."""
    names = hooks_lib.select(self.cfg, names)
    on = [(name, fn) for name, fn, _ in self._persistent_hooks()]
    hooks = [*on, *(hooks or [])] or None  # add_hook's, then the call's
    if stop_at_layer is None:
      logits, seen = hooks_lib.run_jit(self.cfg, self.weights, inputs, names=names, hooks=hooks)
      tokens = inputs.get('decoder_inputs', inputs['inputs'])
      return cache_lib.output(logits, tokens, return_type, per_token), {n: seen[n] for n in names}
    short, last, names, hooks = cache_lib.truncate(self, stop_at_layer, names, hooks)
    if hooks:  # the hooks' own compile rules; the truncated model's head runs, unread
      seen = hooks_lib.run_jit(short, self.weights, inputs, names=names + (last,), hooks=hooks)[1]
    else:
      seen = _run_cache(short, tuple(dict.fromkeys(names + (last,))))(self.weights, inputs)
    resid = np.asarray(seen[last])
    return resid, {n: seen[n] for n in names}

  def _hook_inputs(self, text: Any, source: Any, method: str) -> dict[str, np.ndarray]:
    """Model inputs for one text or token rows. A text starts as in training: a causal LM's
    after `prompt_prefix` (the tokenizer's bos, or nothing where the model had none), an
    imported BERT's with the tokenizer's special tokens, else after bos; a source ends in eos."""

    def ids(value, prefix):
      if isinstance(value, str):
        if prefix is None:  # the tokenizer adds its own ([CLS] ... [SEP])
          return np.asarray([self.tokenizer.encode(value, add_special_tokens=True)], np.int32)
        return np.asarray([prefix + self._encode(value)], np.int32)
      value = np.asarray(value)
      return _int_array(value[None] if value.ndim == 1 else value, 'text')

    family = self.cfg.family
    if family == 'encoder_decoder':
      if source is None:
        raise ValueError(f'EncoderDecoder.{method} needs source=... (the encoder input)')
      src = ids(source, [])
      if isinstance(source, str):
        src = np.concatenate([src, [[data.EOS_ID]]], axis=1)
      return {'inputs': src, 'decoder_inputs': ids(text, [data.BOS_ID])}
    if family == 'causal_lm':
      return {'inputs': ids(text, self.prompt_prefix())}
    hf_tokenizer = getattr(self.tokenizer, 'kind', None) == 'hf'
    return {'inputs': ids(text, None if hf_tokenizer else [data.BOS_ID])}

  # Helpers ---------------------------------------------------------------------------------------
  def _encode(self, text: str) -> list[int]:
    if self.tokenizer is None:
      raise ValueError(
        f'workdir {self.workdir!r} has no tokenizer/; pass token ids to logits() instead'
      )
    return self.tokenizer.encode(text)

  def _decode(self, out: Array) -> list[str]:
    """Texts of generated rows, each cut at its first eos (what follows is padding)."""
    eos = _or(_special(self.tokenizer, 'eos_id', data.EOS_ID), -1)
    texts = []
    for row in np.asarray(out).tolist():
      texts.append(self.tokenizer.decode(row[: row.index(eos)] if eos in row else row))
    return texts

  def _token_ids(self, x: Any, name: str) -> np.ndarray:
    """int32 [B, T] ids, each in [0, vocab_size), B and T >= 1, T within the length limit."""
    ids = _array(x, name)
    if ids.ndim != 2 or ids.dtype.kind not in 'iu' or not ids.size:
      raise ValueError(
        f'{name} must be integer token ids of shape [B, T] with B, T >= 1; got {ids.dtype}'
        f'{ids.shape}'
      )
    vocab = self.cfg.vocab_size
    if ids.min() < 0 or ids.max() >= vocab:  # before the cast to int32, which would wrap
      raise ValueError(
        f'token ids must be in [0, {vocab}); {name} has min {ids.min()} and max {ids.max()}'
      )
    self._check_length(ids.shape[1], f'{name} length')
    return ids.astype(np.int32)

  def _check_length(self, length: int, what: str) -> None:
    """Refuses a row longer than learned positions reach, or LENGTH_FACTOR x max_length."""
    cfg = self.cfg
    limit = cfg.max_length if cfg.position == 'learned' else LENGTH_FACTOR * cfg.max_length
    if length > limit:
      why = f'{LENGTH_FACTOR} x max_length={cfg.max_length}'
      why = 'learned positions stop there' if cfg.position == 'learned' else why
      raise ValueError(f'{what} is {length} positions; at most {limit} ({why}): shorten it')

  def _check_knobs(self, beam_size: Any, seed: Any) -> None:
    vocab = self.cfg.vocab_size
    if _is_int(beam_size) and beam_size > vocab:
      raise ValueError(f'beam_size={beam_size} must be at most the vocabulary size, {vocab}')
    if not _is_int(seed) or not -(2**63) <= seed < 2**63:
      raise ValueError(f'seed={seed!r} must be an int in [-2**63, 2**63)')

  def _need(self, family: str, method: str) -> None:
    if self.cfg.family != family:
      raise ValueError(f'{method} needs a {family} model; this one is {self.cfg.family!r}')


@functools.lru_cache(maxsize=16)
def _run_cache(cfg: ModelConfig, names: tuple[str, ...]):
  """`hooks.run` under jit returning only the cache: XLA drops whatever no name reads."""
  return jax.jit(lambda weights, inputs: hooks_lib.run(cfg, weights, inputs, names=names)[1])


@functools.partial(jax.jit, static_argnums=0)
def _apply(module, params, *args, **kwargs):
  return module.apply(models.variables(params), *args, **kwargs).astype(jnp.float32)


def _special(tokenizer, name: str, default: int) -> int | None:
  """A tokenizer's special id: a Hugging Face one has its own (None: it has none), else ours."""
  value = getattr(tokenizer, name, None)
  if value is None:
    return None if getattr(tokenizer, 'kind', None) == 'hf' else default
  return int(value)


def _or(value, default):
  return default if value is None else value


def _as_list(texts, name: str = 'texts') -> list[str]:
  if isinstance(texts, str):
    return [texts]
  if not isinstance(texts, (list, tuple)) or not all(isinstance(t, str) for t in texts):
    raise ValueError(f'{name} must be a string or a list of strings; got {texts!r:.60}')
  if not texts:
    raise ValueError(f'{name} is an empty list; give at least one string')
  return list(texts)


def _is_int(x: Any) -> bool:
  return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _array(x: Any, name: str) -> np.ndarray:
  try:
    return np.asarray(x)
  except (ValueError, TypeError) as e:  # ragged rows
    raise ValueError(f'{name} must be a rectangular array [B, T]; got {x!r:.60} ({e})') from e


def _pad(rows: list[list[int]]) -> np.ndarray:
  """Right-pads rows with PAD_ID (0) to [len(rows), longest]."""
  out = np.zeros((len(rows), max(1, max(len(r) for r in rows))), np.int32)
  for i, row in enumerate(rows):
    out[i, : len(row)] = row
  return out


def _until_eos(tokens: list[int], eos: int) -> list[int]:
  """Generated tokens up to and including the first eos."""
  return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def _int_array(x: Any, name: str) -> np.ndarray:
  x = _array(x, name)
  if x.ndim != 2 or not np.issubdtype(x.dtype, np.integer):
    raise ValueError(f'{name} must be integer token ids of shape [B, T]; got {x.dtype}{x.shape}')
  return x.astype(np.int32)


def _rng(seed: int, temperature: Any) -> Array | None:
  """The sampling key; None when not sampling (decode checks the temperature itself)."""
  sampling = isinstance(temperature, numbers.Real) and temperature > 0
  return jax.random.PRNGKey(seed) if sampling else None
