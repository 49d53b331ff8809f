"""Small random PyTorch models from `transformers` that tests import into sparrow and compare
against: a GPT-2 (LayerNorm, learned positions) and a Llama (GQA 3, RoPE, RMSNorm)."""

import os

import torch
import transformers

from transformer.inference import hf

os.environ['HF_HUB_OFFLINE'] = '1'

VOCAB = 83


def save_randomised(builders: dict, root, seed: int) -> dict:
  """{name: (torch model, saved directory)}: each builder's model, seeded in turn and randomised
  (`randomise`, scale 0.3), saved as safetensors under `root`/name."""
  out = {}
  for i, (name, build) in enumerate(builders.items()):
    torch.manual_seed(i)
    model = randomise(build(), seed=seed + i, scale=0.3)
    directory = str(root / name)
    model.save_pretrained(directory, safe_serialization=True)
    out[name] = (model, directory)
  return out


def padded_batch(seed: int, lengths: tuple[int, ...], vocab: int):
  """Right-padded rows of the given lengths (ids in [1, vocab)) and their mask [B, T]."""
  import numpy as np

  rng = np.random.default_rng(seed)
  mask = (np.arange(max(lengths))[None] < np.array(lengths)[:, None]).astype(np.int32)
  ids = rng.integers(1, vocab, size=mask.shape) * mask
  return ids.astype(np.int32), mask


def randomise(model, seed, scale: float = 0.2):
  """1-D parameters away from their init: biases to noise, norm weights to 1 + noise (std
  `scale`), so that every bias and norm weight matters in a comparison."""
  generator = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if p.ndim == 1:
        noise = scale * torch.randn(p.shape, generator=generator)
        p.copy_(noise if name.endswith('bias') else 1.0 + noise)
  return model.eval()


def _gpt2():
  config = transformers.GPT2Config(
    vocab_size=VOCAB, n_positions=32, n_embd=30, n_layer=3, n_head=3, layer_norm_epsilon=1e-4,
    initializer_range=0.3, attn_implementation='eager',
  )  # fmt: skip
  torch.manual_seed(0)
  return randomise(transformers.GPT2LMHeadModel(config), 1)


def _llama():
  config = transformers.LlamaConfig(
    vocab_size=VOCAB, hidden_size=36, num_attention_heads=6, num_key_value_heads=2, head_dim=8,
    intermediate_size=40, num_hidden_layers=2, max_position_embeddings=64, rms_norm_eps=1e-5,
    initializer_range=0.3, tie_word_embeddings=False, attn_implementation='eager',
  )  # fmt: skip
  torch.manual_seed(1)
  return randomise(transformers.LlamaForCausalLM(config), 2)


def build_both(root) -> dict:
  """{name: (torch model, sparrow cfg, params)} for a GPT-2 and a Llama (GQA 3, RoPE), each
  saved under the directory `root` and imported from there."""
  out = {}
  for name, build in (('gpt2', _gpt2), ('llama', _llama)):
    model = build()
    directory = str(root / name)
    model.save_pretrained(directory, safe_serialization=True)
    _, cfg, params, _ = hf.convert_in_memory(directory)
    out[name] = (model, cfg, params)
  return out


def blocks(model):
  """The PyTorch model's transformer blocks."""
  return model.transformer.h if hasattr(model, 'transformer') else model.model.layers


def out_proj(model, layer: int):
  """The attention output projection of block `layer` (its input: the heads' outputs)."""
  block = blocks(model)[layer]
  return block.attn.c_proj if hasattr(block, 'attn') else block.self_attn.o_proj


def assert_greedy_matches_hf(model, cfg, params, vocab: int, tokens: int = 20) -> None:
  """`tokens` greedy tokens on sparrow's KV cache, from two right-padded prompts (lengths 3 and
  7) in one call, equal Hugging Face's `generate` of each prompt alone."""
  import numpy as np

  from transformer.model import decode, models

  rng = np.random.default_rng(3)
  prompts = np.zeros((2, 7), np.int64)  # ours: both in one call, right-padded (one compile)
  for row, length in enumerate((3, 7)):
    prompts[row, :length] = rng.integers(1, vocab, size=length)
  ours = decode.generate(models.build(cfg), params, prompts, max_new_tokens=tokens, eos_id=-1)
  for row, length in enumerate((3, 7)):  # theirs: one prompt at a time
    with torch.no_grad():
      theirs = model.generate(
        torch.as_tensor(prompts[row : row + 1, :length]),
        attention_mask=torch.ones(1, length, dtype=torch.long),
        do_sample=False, max_new_tokens=tokens, min_new_tokens=tokens, eos_token_id=None,
        pad_token_id=0,
      )[0, length:].numpy()  # fmt: skip
    assert len(theirs) == tokens
    np.testing.assert_array_equal(np.asarray(ours)[row], theirs)


def save_word_gpt2(directory: str, words: list[str], seed: int, **config):
  """A random GPT-2 (`config`: GPT2Config's sizes; perturbed by `randomise`) and a word-level
  tokenizer over `words` (words[0] the bos = eos, words[1] the unknown; splits off punctuation)
  saved to `directory`, as the ported demos load them. Returns the torch model."""
  import json

  import tokenizers

  config = transformers.GPT2Config(vocab_size=len(words), bos_token_id=0, eos_token_id=0, **config)
  torch.manual_seed(seed)
  model = randomise(transformers.GPT2LMHeadModel(config), seed=seed + 4)
  model.save_pretrained(directory, safe_serialization=True)
  vocab = {w: i for i, w in enumerate(words)}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token=words[1]))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()  # splits off punctuation
  tok.decoder = tokenizers.decoders.WordPiece(prefix='##')  # joins words with spaces
  tok.save(os.path.join(directory, 'tokenizer.json'))
  with open(os.path.join(directory, 'tokenizer_config.json'), 'w') as f:
    json.dump({'bos_token': words[0], 'eos_token': words[0]}, f)
  return model


def page_section_code(page: str, section: str) -> str:
  """The Python blocks of one `## ` section of a docs page, joined in order."""
  import re

  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  with open(os.path.join(root, 'docs', page)) as f:
    text = f.read()
  text = text[text.index(section) :]
  text = text[: text.find('\n## ', 1)] if '\n## ' in text[1:] else text
  return '\n'.join(re.findall(r'^```python\n(.*?)^```', text, re.S | re.M))
