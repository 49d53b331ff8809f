"""Evaluate a run's checkpoint, or translate / score a file with it.

  python -m experiments.evaluate --workdir=runs/default [--step=N] [--json]
  python -m experiments.evaluate --workdir=runs/default --input=numbers.txt [--output=out.txt]

With --json it prints one JSON object with the metrics that apply: loss, perplexity, accuracy,
bleu, exact_match and step. With --input, an EncoderDecoder translates each line and an LM
scores each line (nats per token and perplexity).
"""

import json
import math
import sys

from absl import flags

from experiments import cli

_WORKDIR = flags.DEFINE_string('workdir', None, 'Run directory to evaluate.', required=True)
_STEP = flags.DEFINE_integer('step', None, 'Checkpoint step; default the latest.')
_JSON = flags.DEFINE_bool('json', False, 'Print one JSON object instead of text.')
_INPUT = flags.DEFINE_string('input', None, 'A text file: one source or document per line.')
_OUTPUT = flags.DEFINE_string('output', None, 'Where --input results go; default stdout.')


def _process_file(run, params, path):
  with open(path, encoding='utf-8') as f:
    lines = [line.rstrip('\n') for line in f]
  if run.family == 'encoder_decoder':
    return [out for _, _, out in run.generate(params, [(line, '') for line in lines])]
  rows = []
  for line, (total, count) in zip(lines, run.score(params, lines)):
    rows.append(f'{total / max(count, 1):.4f}\t{math.exp(total / max(count, 1)):.3f}\t{line}')
  return rows


def main():
  from transformer.training.state import weights
  from transformer.training.workdir import load_run

  run, state, step = load_run(_WORKDIR.value, _STEP.value)
  if _INPUT.value:
    text = '\n'.join(_process_file(run, weights(state), _INPUT.value)) + '\n'
    if _OUTPUT.value:
      with open(_OUTPUT.value, 'w', encoding='utf-8') as f:
        f.write(text)
    else:
      sys.stdout.write(text)
    return
  metrics, _ = run.evaluate(weights(state))
  metrics['step'] = step
  if _JSON.value:
    print(json.dumps(metrics))
  else:
    for key, value in metrics.items():
      print(f'{key}: {value}')


if __name__ == '__main__':
  cli.run(main)
