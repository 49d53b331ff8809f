"""task='text' as one running text for the LMs: the char vocabulary, rows against slices of the
text computed here, the held-out tail, random windows (deterministic, resumable under another
process count), whole-split evaluation and the errors of bad files."""

import numpy as np
import pytest

from transformer import data
from transformer.config.experiment import DataConfig, section
from transformer.data import stream
from transformer.training import checkpoint

_WORDS = (
  'First Citizen: Before we proceed any further, hear me speak. All: Speak, speak. You'.split()
)
_RNG = np.random.default_rng(0)
TEXT = ''.join(  # a running text that never repeats a window: 200 lines of random words
  ' '.join(_RNG.choice(_WORDS, _RNG.integers(2, 9))) + '\n' for _ in range(200)
)


def _cfg(path, **overrides):
  cfg = data.default_config()
  cfg.update(dict(task='text', train_path=str(path), tokenizer='char', text_format='stream'))
  cfg.update(dict(max_length=16, batch_size=6, eval_batch_size=6))
  cfg.update(overrides)
  return cfg


def _write(tmp_path, text=TEXT, name='input.txt'):
  path = tmp_path / name
  path.write_text(text, encoding='utf-8')
  return path


def _ids(text):
  """The reference char encoding: sorted distinct characters, numbered from 5."""
  vocab = {c: i + 5 for i, c in enumerate(sorted(set(TEXT)))}
  return np.array([vocab[c] for c in text])


def _build(cfg, family='causal_lm', process=0, count=1, seed=0):
  return data.build(
    section(DataConfig, cfg),
    family=family,
    workdir=None,
    seed=seed,
    process_index=process,
    process_count=count,
  )


def test_char_tokenizer_round_trip_and_errors(tmp_path):
  tok = data.CharTokenizer.from_texts([TEXT])
  assert tok.vocab_size == 5 + len(set(TEXT)) and tok.chars == ''.join(sorted(set(TEXT)))
  assert tok.encode(TEXT[:200]) == _ids(TEXT[:200]).tolist()
  assert tok.decode(tok.encode(TEXT)) == TEXT  # newlines included
  assert (
    tok.decode([1, *tok.encode('hear'), 2, *tok.encode('me')]) == 'hear'
  )  # bos skipped, eos ends
  tok.save(str(tmp_path / 'tok'))
  again = data.load_tokenizer(str(tmp_path / 'tok'))
  assert again.kind == 'char' and again.encode('Speak') == tok.encode('Speak')
  with pytest.raises(ValueError, match=r"character 'Z' \(U\+005A\) at position 4 is not in"):
    tok.encode('SpeaZk')
  with pytest.raises(ValueError, match="character 'é'"):
    tok.encode('café')


def test_a_running_text_is_one_stream_cut_into_rows(tmp_path):
  task = _build(_cfg(_write(tmp_path), sampling='sequential'))
  tokens = _ids(TEXT)
  split = int(len(tokens) * 0.9)  # nanoGPT's split of the characters
  train, evaluation = tokens[:split], tokens[split:]
  held = len(evaluation)
  assert task.info['train_tokens'] == len(train) and task.info['eval_tokens'] == held
  assert task.prompt_prefix == []  # prompted as trained: no bos it never saw
  it = task.train_iterator()
  for b in range(5):
    batch = next(it)
    for r in range(6):
      start = (b * 6 + r) * 16
      want = np.take(train, np.arange(start, start + 17), mode='wrap')
      np.testing.assert_array_equal(batch['inputs'][r], want[:16])
      np.testing.assert_array_equal(batch['targets'][r], want[1:])
  newline = _ids('\n')[0]
  assert (batch['targets'] == newline).any()  # newlines are predicted, not cut away
  # Evaluation: every non-overlapping window of the held-out tail once, in order, then padding.
  windows = (held - 17) // 16 + 1
  rows = np.concatenate([b['inputs'] for b in task.eval_batches()])
  weights = np.concatenate([b['weights'] for b in task.eval_batches()])
  assert len(rows) == -(-windows // 6) * 6 and weights[:windows].min() == 1
  assert weights[windows:].sum() == 0
  for r in range(windows):
    np.testing.assert_array_equal(rows[r], evaluation[r * 16 : r * 16 + 16])
  # The training loss beside it: as many rows, at evenly spaced windows of the training split.
  train_rows = np.concatenate([b['inputs'] for b in task.train_eval_batches()])
  assert len(train_rows) == len(rows)
  starts = np.linspace(0, (len(train) - 17) // 16, len(rows)).round().astype(int) * 16
  for row, start in zip(train_rows, starts):
    np.testing.assert_array_equal(row, train[start : start + 16])


def test_random_windows_are_uniform_offsets_fixed_by_the_seed(tmp_path):
  path = _write(tmp_path)
  train = _ids(TEXT)[: int(len(TEXT) * 0.9)]
  task = _build(_cfg(path))
  starts = []
  for batch in (next(it) for it in [task.train_iterator()] for _ in range(40)):
    for row in batch['inputs']:  # find each row in the text: it is a window of it
      matches = [s for s in range(len(train) - 16) if (train[s : s + 16] == row).all()]
      assert matches, row
      starts.append(matches[0])
  assert len(set(starts)) > 150  # 240 rows, mostly different offsets (not a fixed order)
  assert max(starts) > 0.8 * len(train) and min(starts) < 0.2 * len(train)
  again = next(_build(_cfg(path)).train_iterator())
  other = next(_build(_cfg(path), seed=1).train_iterator())
  first = next(task.train_iterator())
  np.testing.assert_array_equal(again['inputs'], first['inputs'])
  assert not np.array_equal(other['inputs'], first['inputs'])


@pytest.mark.parametrize('family', ['causal_lm', 'bidirectional_lm'])
@pytest.mark.parametrize('before, after', [(1, 2), (2, 1), (3, 2)])
def test_random_windows_resume_exactly_under_another_process_count(tmp_path, family, before, after):
  cfg = _cfg(_write(tmp_path))
  uninterrupted = _build(cfg, family).train_iterator()
  for _ in range(5):
    next(uninterrupted)
  want = [next(uninterrupted) for _ in range(3)]
  first = [_build(cfg, family, p, before).train_iterator() for p in range(before)]
  for _ in range(5):
    for it in first:
      next(it)
  saved = {'processes': [it.get_state() for it in first]}  # as the checkpoint gathers it
  state = checkpoint._this_process_state(saved, 'test')
  resumed = [_build(cfg, family, p, after).train_iterator() for p in range(after)]
  for it in resumed:
    it.set_state(state)
  for batch in want:
    pieces = [next(it) for it in resumed]
    for key in batch:
      np.testing.assert_array_equal(np.concatenate([p[key] for p in pieces]), batch[key], key)
  sequential = _build(_cfg(cfg.train_path, sampling='sequential'), family).train_iterator()
  with pytest.raises(ValueError, match="data.sampling='random'"):
    sequential.set_state(state)


def test_several_files_are_joined_with_the_separator_and_eval_path_is_used(tmp_path):
  _write(tmp_path, TEXT[:1000], 'a_part.txt')
  _write(tmp_path, TEXT[1000:2000], 'b_part.txt')
  held = _write(tmp_path, TEXT[2000:], 'held.txt')
  task = _build(_cfg(tmp_path / '*_part.txt', eval_path=str(held), sampling='sequential'))
  want = np.concatenate([_ids(TEXT[:1000]), [2], _ids(TEXT[1000:2000])])  # eos between files
  assert task.info['train_tokens'] == len(want) and task.info['eval_tokens'] == len(TEXT) - 2000
  got = np.concatenate([b['inputs'].reshape(-1) for b in [next(task.train_iterator())]])
  np.testing.assert_array_equal(got, want[: len(got)])


def test_lines_keep_one_document_a_line(tmp_path):
  task = _build(_cfg(_write(tmp_path), text_format='lines', eval_path=str(_write(tmp_path))))
  assert task.prompt_prefix == [data.BOS_ID]
  assert task.info['num_train_examples'] == 200


@pytest.mark.parametrize(
  'content, overrides, message',
  [
    (b'', {}, 'input.txt is empty'),
    (b'  \n\n', {}, 'input.txt is empty'),
    (b'abc\x00\x01\x02' * 10, {}, 'is binary'),
    (b'caf\xe9 au lait\n' * 10, {}, 'not UTF-8 text'),
    (b'too short', {}, 'fewer than one row of 17'),
    (TEXT.encode(), {'eval_fraction': 1.5}, 'data.eval_fraction=1.5'),
    (TEXT.encode(), {'text_format': 'paragraphs'}, "text_format='paragraphs'"),
    (TEXT[:100].encode() * 2, {'max_length': 64}, 'the last 0.1 of'),
  ],
)
def test_bad_files_are_one_clear_error(tmp_path, content, overrides, message):
  path = tmp_path / 'input.txt'
  path.write_bytes(content)
  with pytest.raises(ValueError, match=message):
    _build(_cfg(path, **overrides))


def test_auto_eval_scores_a_small_split_whole_and_a_large_one_in_part():
  assert stream.num_eval_batches(10_000, 64, 'causal_lm', 128, -1) == 2  # 156 windows, whole
  big = stream.AUTO_EVAL_TOKENS + 1
  assert stream.num_eval_batches(big, 64, 'causal_lm', 128, -1) == stream.AUTO_EVAL_BATCHES
  assert stream.num_eval_batches(big, 64, 'causal_lm', 128, 0) == -(-((big - 65) // 64 + 1) // 128)
  assert stream.num_eval_batches(10_000, 64, 'causal_lm', 128, 1) == 1
