"""A character-level GPT trained on a running text, reloaded: prompted without a bos, generating
past its context as nanoGPT does (against a window-by-window reference), RoPE going on along its
cache, experiments.sample, and the errors of bad prompts and files."""

import os
import subprocess
import sys

import numpy as np
import pytest
from decode_reference import greedy_uncached_continue

import transformer
from configs import char_lm
from transformer.training import checkpoint, provenance
from transformer.training.run import Run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_RNG = np.random.default_rng(0)
_WORDS = 'ROMEO: JULIET: O Romeo, wherefore art thou? Deny thy father and refuse thy name.'.split()
TEXT = ''.join(' '.join(_RNG.choice(_WORDS, _RNG.integers(2, 9))) + '\n' for _ in range(300))


def _config(text_path, **model):
  config = char_lm.get_config()
  m = config.model
  m.d_model, m.num_heads, m.d_ff, m.num_layers, m.max_length = 32, 2, 64, 2, 16
  m.update(model)
  config.data.train_path = str(text_path)
  config.data.batch_size, config.data.eval_batch_size = 4, 4
  config.train.steps, config.train.eval_every, config.train.checkpoint_every = 3, 3, 3
  return config


def _workdir(path, **model):
  """A workdir as training leaves it, at step 0 (untrained weights: a fixed random function)."""
  os.makedirs(path, exist_ok=True)
  (path / 'input.txt').write_text(TEXT)
  config = _config(path / 'input.txt', **model)
  run = Run(config, str(path))
  provenance.write_run_metadata(str(path), run.config)
  ckpt = checkpoint.Checkpointer(str(path))
  ckpt.save(0, run.init_state(), {})
  ckpt.close()
  return str(path)


@pytest.fixture(scope='module')
def char_model(tmp_path_factory):
  return transformer.load(_workdir(tmp_path_factory.mktemp('char')))


def _greedy_by_windows(model, ids, new):
  """Reference: every new token from a full forward over the last max_length tokens."""
  ids = list(ids)
  for _ in range(new):
    window = np.array([ids[-model.cfg.max_length :]], np.int32)
    ids.append(int(np.argmax(np.asarray(model.logits(window))[0, -1])))
  return ids


def test_a_stream_model_is_prompted_without_bos(char_model):
  assert char_model.tokenizer.kind == 'char' and char_model.prompt_prefix() == []
  ids = char_model.tokenizer.encode('ROMEO: O')
  out = char_model.generate('ROMEO: O', max_new_tokens=5)  # within the context: the KV cache
  reference = greedy_uncached_continue(
    char_model.module, char_model.params, np.array([ids], np.int32), 5
  )
  assert out == [char_model.tokenizer.decode(np.asarray(reference)[0].tolist())]
  scored = char_model.score('ROMEO: O')[0]
  assert len(scored['log_probs']) == len(ids) - 1  # no bos, no eos: the first char is context


def test_generation_past_the_context_slides_the_window(char_model):
  prompt = 'JULIET: O Rom'  # 13 characters, context 16: 4 tokens fit, 36 slide
  out = char_model.generate(prompt, max_new_tokens=40)[0]
  ids = char_model.tokenizer.encode(prompt)
  want = _greedy_by_windows(char_model, ids, 40)[len(ids) :]
  assert out == char_model.tokenizer.decode(want) and len(out) == 40
  longer = 'thy name. ' * 5  # a prompt longer than the context keeps its last 16 characters
  out = char_model.generate(longer, max_new_tokens=6)[0]
  ids = char_model.tokenizer.encode(longer)
  assert out == char_model.tokenizer.decode(_greedy_by_windows(char_model, ids, 6)[len(ids) :])


def test_sampling_past_the_context_is_reproducible(char_model):
  a = char_model.generate(['O'] * 3, max_new_tokens=50, temperature=1.0, top_k=10, seed=4)
  b = char_model.generate(['O'] * 3, max_new_tokens=50, temperature=1.0, top_k=10, seed=4)
  c = char_model.generate(['O'] * 3, max_new_tokens=50, temperature=1.0, top_k=10, seed=5)
  assert a == b and a != c and len(set(a)) > 1  # untrained: specials may decode to nothing
  with pytest.raises(ValueError, match='beam_size=2 searches within the context of 16'):
    char_model.generate('O', max_new_tokens=50, beam_size=2)
  with pytest.raises(ValueError, match="character 'z' .* is not in the char vocabulary"):
    char_model.generate('Romeo zz', max_new_tokens=5)
  with pytest.raises(ValueError, match='max_new_tokens=1000000 past the context of 16 positions'):
    char_model.generate('O', max_new_tokens=10**6)
  with pytest.raises(ValueError, match='empty prompt'):
    char_model.generate('', max_new_tokens=5)


def test_rope_goes_on_along_its_cache_and_says_how_far(tmp_path):
  model = transformer.load(_workdir(tmp_path / 'rope', position='rope'))
  ids = model.tokenizer.encode('ROMEO:')
  out = model.generate('ROMEO:', max_new_tokens=40)  # 45 positions, context 16: the cache
  reference = greedy_uncached_continue(model.module, model.params, np.array([ids], np.int32), 40)
  assert out == [model.tokenizer.decode(np.asarray(reference)[0].tolist())]
  with pytest.raises(ValueError, match=r'at most 256 \(16 x max_length=16\)'):
    model.generate('ROMEO:', max_new_tokens=300)


def _cli(module, *flags):
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  command = [sys.executable, '-m', module, *flags]
  return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_sample_command(char_model):
  done = _cli(
    'experiments.sample', f'--workdir={char_model.workdir}', '--prompt=ROMEO:',
    '--max_new_tokens=30', '--num_samples=2', '--seed=3',
  )  # fmt: skip
  assert done.returncode == 0, done.stderr[-2000:]
  samples = done.stdout.split('---------------\n')
  assert len(samples) == 3 and samples[-1] == ''
  assert all(s.startswith('ROMEO:') and len(s) > len('ROMEO:') for s in samples[:2])
  bad = _cli('experiments.sample', f'--workdir={char_model.workdir}', '--prompt=Juliet!')
  lines = [line for line in bad.stderr.splitlines() if line.strip()]
  assert bad.returncode == 2 and 'Traceback' not in bad.stderr
  assert lines[-1].startswith("error: character 'l' (U+006C) at position 2 is not in the char")


@pytest.mark.parametrize(
  'content, message',
  [
    (b'', 'input.txt is empty'),
    (b'\x00\x01binary\x02' * 40, 'input.txt is binary'),
    (b'too short for one row\n', 'the first 0.9 of data.train_path='),
  ],
)
def test_train_refuses_a_bad_file_with_one_line(tmp_path, content, message):
  (tmp_path / 'input.txt').write_bytes(content)
  done = _cli(
    'experiments.train', '--config=configs/char_lm.py', f'--workdir={tmp_path / "run"}',
    f'--config.data.train_path={tmp_path / "input.txt"}',
  )  # fmt: skip
  lines = [line for line in done.stderr.splitlines() if line.strip() and 'WARNING' not in line]
  assert done.returncode == 2 and 'Traceback' not in done.stderr, done.stderr[-2000:]
  assert lines[-1].startswith('error: ') and message in lines[-1], lines
