"""Tokenise a corpus once into token shards that training streams: prepare, then train.

python -m experiments.prepare_data --config=configs/X.py --config.data.train_path='docs/*.jsonl'
  [--out=DIR] [--workers=N]
Inputs: text (a document per line), .jsonl/.jsonl.gz/.jsonl.zst with "text", Parquet "text".
Rerun the same command after an interruption to resume. experiments.train does this itself on
first use, into config.data.prepared_dir (default <workdir>/corpus).
"""

import json

from absl import flags

from experiments import cli

_CONFIG = cli.define_config()
_OUT = flags.DEFINE_string('out', None, 'Output directory; default config.data.prepared_dir.')
_WORKERS = flags.DEFINE_integer(
  'workers', None, 'Processes; default config.data.prepare_workers (0: one per core).'
)


def main():
  from transformer.config.experiment import DataConfig, section
  from transformer.data import prepare

  cfg = section(DataConfig, _CONFIG.value.data)  # every data knob checked, before any work
  out = _OUT.value or cfg.prepared_dir
  if not out:
    raise ValueError('no output directory: pass --out=DIR or --config.data.prepared_dir=DIR')
  meta = prepare.prepare(cfg, out, workers=_WORKERS.value or cfg.prepare_workers)
  summary = {k: v for k, v in meta.items() if k != 'splits'}
  summary |= {f'{s}_shards': len(v) for s, v in meta['splits'].items()}
  print(f'prepared {out}: {json.dumps(summary)}')


if __name__ == '__main__':
  cli.run(main, first_line='prepare: starting (JAX and the config load in a few seconds)')
