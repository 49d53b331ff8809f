"""experiments/ioi.py: the IOI sentences and prompts, and the dissection's invariants on a random
model (patching the only token that differs restores the clean run; the attribution parts sum to
the logit difference; a bad tokenizer or prompt count is one error)."""

import re

import flax.linen as nn
import numpy as np
import pytest
from model_helpers import random_model

from research import ioi
from transformer import data
from transformer.config import ModelConfig


def test_sentences_repeat_the_subject_and_end_with_the_indirect_object():
  for text in ioi.sentences(200, seed=3):
    words = text.replace(',', ' ').replace('.', ' ').split()
    names = [w for w in words if w in ioi.NAMES]
    # A and B (IO and S in either order), then S again, then IO ends the sentence.
    assert len(names) == 4 and set(names[:2]) == {names[2], names[3]} != {names[2]}, text
    assert text.endswith(f' {names[3]}.')
  assert ioi.sentences(50, seed=1) == ioi.sentences(50, seed=1) != ioi.sentences(50, seed=2)


@pytest.fixture(scope='module')
def tokenizer():
  return data.train_sentencepiece(ioi.sentences(3000), 128)


def test_prompts_differ_only_at_the_second_subject(tokenizer):
  p = ioi.prompts(tokenizer, 16)
  assert p.clean.shape == p.corrupt.shape == (16, p.roles['END'] + 1)
  differ = np.flatnonzero((p.clean != p.corrupt).any(0))
  assert differ.tolist() == [p.roles['S2']]
  rows = np.arange(16)
  assert (p.clean[rows, p.roles['IO']] == p.io).all() and (p.io != p.s).all()
  assert (p.clean[rows, p.roles['S1']] == p.s).all() and (p.clean[rows, p.roles['S2']] == p.s).all()
  c = p.corrupt[:, p.roles['S2']]
  assert ((c != p.io) & (c != p.s)).all()
  assert len({(a, b) for a, b in zip(p.io, p.s)}) == 16  # every prompt its own name pair
  assert p.labels[p.roles['IO']] == 'IO' and p.labels[-1].strip() == 'to'


def test_prompts_refuse_split_names_and_bad_counts(tokenizer):
  with pytest.raises(ValueError, match=r"the name '[A-Z][a-z]+' is not one token"):
    ioi.prompts(data.ByteTokenizer(), 4)  # bytes spell each name in several tokens
  with pytest.raises(ValueError, match=r'prompts=0 must be in \[1, 240\]'):
    ioi.prompts(tokenizer, 0)


def test_dissect_on_a_random_model_keeps_its_invariants(tokenizer):
  cfg = ModelConfig(family='causal_lm', num_layers=2, d_model=16, num_heads=4, d_ff=32,
                    vocab_size=tokenizer.vocab_size, max_length=32, dropout_rate=0.0,
                    norm_placement='pre')  # fmt: skip
  params = nn.meta.unbox(random_model(cfg, seed=5, scale=0.4)[1])
  p = ioi.prompts(tokenizer, 8)
  r = ioi.dissect(cfg, params, p)
  T, s2 = p.clean.shape[1], p.roles['S2']
  # Before layer 0 the runs differ only in the S2 token: patching it restores the clean run
  # exactly, and patching any other position changes nothing.
  first = r['patch_resid_pre'][0]
  assert first[s2] == pytest.approx(1.0, abs=1e-3)
  np.testing.assert_allclose(np.delete(first, s2), 0.0, atol=1e-3)
  assert r['patch_resid_pre'].shape == (2, T) and r['patch_z'].shape == (2, 4)
  assert r['dla_residual'] < 1e-3
  assert sum(r['dla'].values()) == pytest.approx(r['clean'], abs=1e-3)
  assert r['looks'].shape == (2, 4, 2, 3) and (r['looks'] >= 0).all() and (r['looks'] <= 1).all()
  assert -1.0 <= r['attrib_r'] <= 1.0 and 0.0 <= r['io_over_s'] <= 1.0
  text = ioi.report([r], p, cfg, 'cmd', 'abc1234')
  rows = text.splitlines()
  assert 'abc1234' in text and sum(x.startswith('| 0 | ') and ' ± ' in x for x in rows) == 1
  assert sum(bool(re.match(r'\| 0 \| [01]\.[0-3] \|', x)) for x in rows) == 8  # every head
  layer, head = r['key_head']
  assert r['patch_z'][layer, head] == r['patch_z'].max()
