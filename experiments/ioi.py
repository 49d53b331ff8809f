"""Indirect-object identification (IOI), dissected: a small GPT trained offline on IOI sentences,
then taken apart with the hooks: cache, patch, ablate, attribute (docs/dissect.md).

  python -m experiments.ioi --workdir=runs/ioi --out=docs/dissect --seeds=3

It writes WORKDIR/ioi.txt, 50,000 generated sentences such as "When Mary and John went to the
store, John gave a drink to Mary." (the repeated name is the subject S, the other the indirect
object IO, which ends the sentence), trains configs/gpt_tiny.py on them (2 layers, 4 heads,
d_model 64, 1500 steps; one run per seed in WORKDIR/seed_K, resumed if it is there), and on 64
prompts "When IO and S went to the store, S gave a drink to" measures, for each run:
  - the logit difference logit(IO) - logit(S) after the last token, clean and with S2 replaced by a
    third name (the corrupted, "ABC" prompts of Wang et al. 2022);
  - activation patching from the clean into the corrupted run: the residual stream, attention and
    MLP outputs by layer and position, and every head's output (hook_z);
  - attribution patching (one backward pass) against that patching;
  - the effect of zero- and mean-ablating each head on the clean logit difference;
  - direct logit attribution of the logit difference to the embeddings, each head and each MLP;
  - where every head looks from S2 and from the last token.
OUT/ioi.md holds the table over seeds and the first seed's figures.
"""

from __future__ import annotations

import os

from absl import flags

from experiments import cli
from research import ioi

_WORKDIR = flags.DEFINE_string('workdir', 'runs/ioi', 'Where the corpus and the runs go.')
_OUT = flags.DEFINE_string('out', None, 'Where ioi.md and the figures go; default WORKDIR.')
_SEEDS = flags.DEFINE_integer('seeds', 3, 'Training seeds 0..N-1, each its own run.')
_STEPS = flags.DEFINE_integer('steps', 1500, 'Training steps of each run.')
_PROMPTS = flags.DEFINE_integer('prompts', 64, 'IOI prompts the measures average over.')
CORPUS_SIZE = 50_000


def config(train_path: str, steps: int, seed: int):
  """configs/gpt_tiny.py on the IOI sentences: one document a line, packed rows of 128 tokens."""
  from configs import gpt_tiny

  c = gpt_tiny.get_config()
  c.name, c.seed = 'ioi', seed
  c.data.task, c.data.train_path, c.data.text_format = 'text', train_path, 'lines'
  c.data.vocab_size = 128  # SentencePiece gives 96 pieces on this corpus; every name is one
  c.train.steps, c.train.eval_every, c.train.checkpoint_every = steps, steps, steps
  c.train.eval_decode_examples = 0
  return c


def main():
  import transformer
  from research import sweeps
  from transformer.training.loop import train_and_evaluate

  workdir = _WORKDIR.value
  out = _OUT.value or workdir
  if _SEEDS.value < 1 or _STEPS.value < 1:
    raise ValueError(f'--seeds={_SEEDS.value} and --steps={_STEPS.value} must be >= 1')
  os.makedirs(workdir, exist_ok=True)
  corpus = os.path.join(workdir, 'ioi.txt')
  if not os.path.exists(corpus):
    with open(corpus, 'w') as f:
      f.write('\n'.join(ioi.sentences(CORPUS_SIZE)) + '\n')
  results, p, cfg = [], None, None
  for seed in range(_SEEDS.value):
    run = os.path.join(workdir, f'seed_{seed}')
    train_and_evaluate(config(os.path.abspath(corpus), _STEPS.value, seed), run)
    model = transformer.load(run)
    p = ioi.prompts(model.tokenizer, _PROMPTS.value)
    cfg = model.cfg
    r = ioi.dissect(cfg, model.params, p, out if seed == 0 else None)
    results.append(r)
    print(f'seed {seed}: logit diff {r["clean"]:.3f} clean, {r["corrupt"]:.3f} corrupted; key '
          f'head {r["key_head"]}')  # fmt: skip
  # The sweeps' own record of the source: HEAD, with '-dirty' when the tree has changes beyond
  # this command's outputs.
  revision = sweeps.checked_revision([workdir, out], allow_dirty=True)
  command = f'python -m experiments.ioi --workdir={workdir} --out={out} --seeds={_SEEDS.value}'
  command += f' --steps={_STEPS.value}' if _STEPS.value != 1500 else ''
  command += f' --prompts={_PROMPTS.value}' if _PROMPTS.value != 64 else ''
  path = os.path.join(out, 'ioi.md')
  with open(path, 'w') as f:
    f.write(ioi.report(results, p, cfg, command, revision))
  print(f'wrote {path}')


if __name__ == '__main__':
  cli.run(main)
