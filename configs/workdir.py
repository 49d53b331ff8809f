"""The config a workdir was written with, e.g. one that experiments.convert_hf imported:

  python -m experiments.train --config=configs/workdir.py:runs/smol --workdir=runs/smol \
    --config.data.task=text --config.data.train_path=my.txt --config.train.steps=200 \
    --config.optim.schedule=constant --config.optim.learning_rate=1e-4

fine-tunes the imported model from its step-0 checkpoint (flags override the data and training
keys; the model keys must stay as saved).
"""

import json
import os

import ml_collections


def get_config(workdir: str | None = None) -> ml_collections.ConfigDict:
  if not workdir:
    raise ValueError('configs/workdir.py needs the workdir: --config=configs/workdir.py:runs/NAME')
  path = os.path.join(workdir, 'config.json')
  if not os.path.isfile(path):
    raise FileNotFoundError(f'no config.json in {workdir!r}; give a sparrow workdir')
  with open(path) as f:
    return ml_collections.ConfigDict(json.load(f))
