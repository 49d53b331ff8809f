"""TFDS's real download_and_prepare, offline: a tiny builder defined here reads files the test
writes (so a missing dependency of that path fails here), and a failed download is one clear error.

Unlike tfds.testing.mock_data, nothing here is mocked inside TFDS: the builder is prepared, written
as TFRecord shards with its dataset_info.json, and read back through `transformer.data`.
"""

import gzip

import numpy as np
import pytest

from transformer import data
from transformer.config.experiment import DataConfig, section
from transformer.data import sources

TRAIN = [f'the {w} number {i} walks to the river' for i, w in enumerate(['red', 'blue'] * 12)]
TEST = ['a small test line', 'another test line', 'the last test line']


def _cfg(**overrides):
  cfg = data.default_config()
  cfg.update(dict(task='tfds', batch_size=4, eval_batch_size=4, max_length=32))
  cfg.update(overrides)
  return cfg


@pytest.fixture(scope='module')
def builders():
  """Registers two tiny TFDS builders: one reads local .gz files, one downloads a URL."""
  tfds = pytest.importorskip('tensorflow_datasets')
  # A module path inside a package, as lm1b's and wmt14's: TFDS then finds the builder's code
  # and checksums through importlib_resources, the import a fresh install once lacked.
  module = 'tensorflow_datasets.datasets.sparrow_tiny.sparrow_tiny_dataset_builder'

  class SparrowLocalText(tfds.core.GeneratorBasedBuilder):
    """Text lines from the gzip files in SOURCE (set by the test), extracted by TFDS."""

    __module__ = module
    VERSION = tfds.core.Version('1.0.0')
    SOURCE = None

    def _info(self):
      features = tfds.features.FeaturesDict({'text': tfds.features.Text()})
      return tfds.core.DatasetInfo(builder=self, features=features)

    def _split_generators(self, dl_manager):
      files = {split: f'{self.SOURCE}/{split}.txt.gz' for split in ('train', 'test')}
      paths = dl_manager.extract(files)  # TFDS's own extraction, as for lm1b's archive
      return {split: self._generate_examples(path) for split, path in paths.items()}

    def _generate_examples(self, path):
      for index, line in enumerate(path.read_text(encoding='utf-8').splitlines()):
        yield index, {'text': line}

  class SparrowRemoteText(SparrowLocalText):
    """The same, from a URL: the test makes its download fail without touching the network."""

    __module__ = module

    URL = 'https://data.sparrow.invalid/tiny.txt.gz'

    def _split_generators(self, dl_manager):
      path = dl_manager.download_and_extract(self.URL)
      return {'train': self._generate_examples(path)}

  return SparrowLocalText, SparrowRemoteText


def _write_gz(path, lines):
  with gzip.open(path, 'wt', encoding='utf-8') as f:
    f.write(''.join(line + '\n' for line in lines))


def test_download_and_prepare_runs_for_real_and_the_task_reads_it(builders, tmp_path):
  local, _ = builders
  source = tmp_path / 'source'
  source.mkdir()
  _write_gz(source / 'train.txt.gz', TRAIN)
  _write_gz(source / 'test.txt.gz', TEST)
  local.SOURCE = str(source)
  data_dir = tmp_path / 'tfds'
  cfg = _cfg(tfds_name='sparrow_local_text', tfds_data_dir=str(data_dir), tfds_text_key='text')
  task = data.build(section(DataConfig, cfg), family='causal_lm', workdir=None, seed=0)
  prepared = data_dir / 'sparrow_local_text' / '1.0.0'
  assert (prepared / 'dataset_info.json').exists()
  shards = sorted(p.name for p in prepared.glob('*.tfrecord*'))
  assert shards == [f'sparrow_local_text-{s}.tfrecord-00000-of-00001' for s in ('test', 'train')]
  assert local.code_path is not None and local.code_path.name == 'sparrow_tiny_dataset_builder.py'
  assert task.info['num_train_examples'] == len(TRAIN)
  assert task.info['num_eval_examples'] == len(TEST)
  # The examples are the lines written (TFDS stores them in the order of their keys' hashes).
  for split, lines in (('train', TRAIN), ('test', TEST)):
    got = list(sources.tfds_examples('sparrow_local_text', split, str(data_dir), ('text',)))
    assert sorted(got) == sorted(lines)
  batch = next(task.train_iterator())
  assert batch['inputs'].shape == (4, 32) and np.all(batch['weights'].sum(axis=1) > 0)
  # Prepared once: a second build reads the shards even with the source files gone.
  for f in source.iterdir():
    f.unlink()
  again = data.build(section(DataConfig, cfg), family='causal_lm', workdir=None, seed=0)
  np.testing.assert_array_equal(next(again.train_iterator())['inputs'], batch['inputs'])


def test_a_failed_download_is_one_line_naming_the_dataset_and_the_data_dir(
  builders, tmp_path, monkeypatch
):
  requests = pytest.importorskip('requests')
  calls = []

  def no_network(self, url, *args, **kwargs):
    calls.append(url)
    raise requests.exceptions.ConnectionError(
      "HTTPSConnectionPool(host='data.sparrow.invalid', port=443): Max retries exceeded with "
      "url: /tiny.txt.gz (Caused by NameResolutionError: Failed to resolve 'data.sparrow.invalid')"
      '\nsecond line of the message'
    )

  monkeypatch.setattr(requests.Session, 'get', no_network)
  data_dir = tmp_path / 'tfds'
  cfg = _cfg(tfds_name='sparrow_remote_text', tfds_data_dir=str(data_dir), tfds_eval_split='train')
  with pytest.raises(sources.DownloadFailed) as caught:
    data.build(section(DataConfig, cfg), family='causal_lm', workdir=None, seed=0)
  assert calls == ['https://data.sparrow.invalid/tiny.txt.gz']  # TFDS's downloader got there
  message = str(caught.value)
  assert '\n' not in message
  assert "could not download TFDS dataset 'sparrow_remote_text'" in message
  assert 'ConnectionError' in message and "Failed to resolve 'data.sparrow.invalid'" in message
  assert f'--config.data.tfds_data_dir=DIR (now {str(data_dir)!r})' in message
  assert isinstance(caught.value, ConnectionError)  # experiments.cli prints it as one line


def test_other_prepare_errors_keep_their_type(builders, tmp_path):
  local, _ = builders
  local.SOURCE = str(tmp_path / 'missing')  # no files: TFDS's extraction fails, not the network
  cfg = _cfg(tfds_name='sparrow_local_text', tfds_data_dir=str(tmp_path / 'tfds'))
  with pytest.raises(Exception) as caught:
    data.build(section(DataConfig, cfg), family='causal_lm', workdir=None, seed=0)
  assert not isinstance(caught.value, sources.DownloadFailed)
