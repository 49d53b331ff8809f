"""Hugging Face GPT-2/BERT (safetensors) <-> sparrow workdir.

  python -m experiments.convert_hf --arch=gpt2 --input=HF_DIR --workdir=runs/gpt2
  python -m experiments.convert_hf --arch=gpt2 --direction=to_hf --input=runs/gpt2 --workdir=OUT

from_hf reads HF_DIR (config.json + model.safetensors [+ tokenizer.json]; or the path of its
model.safetensors) and writes a new workdir that `transformer.load` and `experiments.train` read.
to_hf writes a sparrow workdir's latest checkpoint as config.json + model.safetensors.
The output must not exist yet (or be empty); nothing is written to it unless all succeeds.
See transformer/inference/hf.py for the name mapping and for dissecting a downloaded model.
"""

from absl import flags

from experiments import cli

_ARCH = flags.DEFINE_string('arch', None, 'Architecture of the Hugging Face model: gpt2 | bert.')
_INPUT = flags.DEFINE_string('input', None, 'from_hf: HF model directory; to_hf: sparrow workdir.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Output: sparrow workdir (from_hf) or HF dir.')
_DIRECTION = flags.DEFINE_string('direction', 'from_hf', 'from_hf | to_hf')
flags.mark_flags_as_required(['arch', 'input', 'workdir'])


def main():
  from transformer.inference import hf  # imported after flag parsing: keeps --help fast

  summary = hf.convert(_ARCH.value, _INPUT.value, _WORKDIR.value, _DIRECTION.value)
  print(' | '.join(f'{k}: {v}' for k, v in summary.items()))


if __name__ == '__main__':
  cli.run(main)
