"""Hugging Face (safetensors) <-> sparrow workdir: GPT-2, BERT, Llama, Qwen2, Qwen3, Mistral.

  python -m experiments.convert_hf --input=HF_DIR --workdir=runs/NAME [--param_dtype=keep]
  python -m experiments.convert_hf --direction=to_hf --input=runs/NAME --workdir=OUT

from_hf reads HF_DIR (config.json + model.safetensors or its shards [+ tokenizer.json]; or the path
of its model.safetensors) and writes a new workdir that `transformer.load` and `experiments.train`
read; --arch is read from config.json unless given. to_hf writes a workdir's latest checkpoint as
config.json + model.safetensors. The output must not exist yet (or be empty); nothing is written
to it unless all succeeds. See transformer/inference/hf.py.
"""

from absl import flags

from experiments import cli

_ARCH = flags.DEFINE_string(
  'arch', None, 'gpt2 | bert | llama | qwen2 | qwen3 | mistral; default: from config.json.'
)
_INPUT = flags.DEFINE_string('input', None, 'from_hf: HF model directory; to_hf: sparrow workdir.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Output: sparrow workdir (from_hf) or HF dir.')
_DIRECTION = flags.DEFINE_string('direction', 'from_hf', 'from_hf | to_hf')
_PARAM_DTYPE = flags.DEFINE_string(
  'param_dtype', 'float32', 'from_hf: float32 | bfloat16 | float16 | keep (the checkpoint dtype).'
)
flags.mark_flags_as_required(['input', 'workdir'])


def main():
  from transformer.inference import hf  # imported after flag parsing: keeps --help fast

  summary = hf.convert(
    _ARCH.value, _INPUT.value, _WORKDIR.value, _DIRECTION.value, _PARAM_DTYPE.value
  )
  print(' | '.join(f'{k}: {v}' for k, v in summary.items()))


if __name__ == '__main__':
  cli.run(main)
