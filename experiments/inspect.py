"""Look inside a run or a model: python -m experiments.inspect --workdir=DIR [--text=...] [--out=D]

Writes DIR/inspect/inspect.md (or --out) with attention maps per layer and head (through the
'xla' path on the trained parameters, whatever attention_impl trained it), head entropy, init and
activation statistics, and plots of the sinusoidal and RoPE encodings. DIR may also be a Hugging
Face folder or a workdir imported from one (--text needed): attention maps, head entropy,
per-layer activation histograms with their outlier dimensions, and the logit lens of causal LMs.
--corrupt=TEXT (a causal LM, with --text of as many tokens) adds patching.md: activation patching
from the clean into the corrupted prompt by layer, position and head, head ablation effects,
direct logit attribution and head detector scores.
"""

from absl import flags

from experiments import cli

_WORKDIR = flags.DEFINE_string(
  'workdir', None, 'Run directory or Hugging Face folder to inspect.', required=True
)
_TEXT = flags.DEFINE_string('text', None, 'Input text; default the first eval example.')
_OUT = flags.DEFINE_string('out', None, 'Output directory; default DIR/inspect.')
_STEP = flags.DEFINE_integer('step', None, 'Checkpoint step; default the latest.')
_CORRUPT = flags.DEFINE_string(
  'corrupt', None, 'A corrupted prompt of as many tokens as --text: adds patching.md.'
)


def main():
  from research import dissect

  print(
    f'wrote {dissect.inspect(_WORKDIR.value, _TEXT.value, _OUT.value, _STEP.value, _CORRUPT.value)}'
  )


if __name__ == '__main__':
  cli.run(main)
