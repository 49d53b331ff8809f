"""research.nulls.task_losses against independent references: the grammar's chain solved as an
eigenproblem, and an untrained model's own loss at init."""

import math

import numpy as np
import pytest

from configs import default, gpt_tiny
from research import nulls, spec
from transformer.data.grammar import make_grammar
from transformer.training.run import Run


def test_grammar_nulls_match_the_chain_computed_independently():
  config = gpt_tiny.get_config()
  losses = nulls.task_losses(config)
  d = config.data
  p = make_grammar(int(d.grammar_seed), int(d.grammar_words), int(d.grammar_successors)).transitions
  values, vectors = np.linalg.eig(p.T)  # the stationary distribution: eigenvalue 1 of P^T
  pi = np.real(vectors[:, np.argmin(np.abs(values - 1))])
  pi /= pi.sum()
  unigram = -np.sum(pi[pi > 0] * np.log(pi[pi > 0]))  # nats per word
  logs = np.log(np.where(p > 0, p, 1.0))
  chain = float(pi @ -np.sum(p * logs, axis=1))
  # Both per-word values are divided by the same tokens per word: SentencePiece 512 over 256
  # made-up words writes about one token per word.
  assert losses['unigram'] / losses['chain'] == pytest.approx(unigram / chain, rel=1e-9)
  assert 1.0 <= unigram / losses['unigram'] < 1.05
  assert losses['chance'] == pytest.approx(math.exp(-losses['uniform']))


@pytest.mark.parametrize('base, flat', [(default, False), (gpt_tiny, True)])
def test_an_untrained_model_does_no_better_than_the_uniform_null(tmp_path, base, flat):
  # The sweeps' 'uniform' nulls stand for a model that learned nothing. gpt_tiny's small init
  # gives flat logits, so it scores ln V; default.py's encoder-decoder starts worse (~6.9 nats
  # against ln 64 = 4.16), so a uniform prediction is the stronger null there.
  config = base.get_config()
  config.data.num_eval_examples = 64
  run = Run(config, str(tmp_path))
  metrics, _ = run.evaluate(run.init_state().params, num_decode=0)
  uniform = nulls.task_losses(config)['uniform']
  assert metrics['loss'] >= 0.98 * uniform
  assert (metrics['loss'] == pytest.approx(uniform, rel=0.02)) == flat


def test_a_sweeps_task_losses_apply_its_overrides():
  plain = spec.task_losses('configs/gpt_tiny.py')
  joined = spec.task_losses('configs/gpt_tiny.py', {'data': {'grammar_join': 4}})
  assert joined == nulls.task_losses(_with(gpt_tiny.get_config(), grammar_join=4))
  assert joined != plain  # other documents, so another tokenizer sample
  with pytest.raises(ValueError, match="'data.nope', which is not a key"):
    spec.task_losses('configs/gpt_tiny.py', {'data.nope': 1})


def _with(config, **data):
  for key, value in data.items():
    config.data[key] = value
  return config
