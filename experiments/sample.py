"""Sample from a trained CausalLM, as nanoGPT's sample.py does:

  python -m experiments.sample --workdir=runs/char --prompt='ROMEO:' --max_new_tokens=500 \
    --temperature=0.8 --top_k=200 --num_samples=3 --seed=1337

The prompt starts as the model's training rows did (no bos after a running text). Past the
context, a model with learned positions goes on from its last max_length tokens. A prompt with a
character outside a char vocabulary is one `error:` line that names it.
"""

from absl import flags

from experiments import cli

_WORKDIR = flags.DEFINE_string(
  'workdir', None, 'Run directory (or Hugging Face folder).', required=True
)
_PROMPT = flags.DEFINE_string('prompt', '\n', 'Text to continue (default a newline, as nanoGPT).')
_PROMPT_FILE = flags.DEFINE_string('prompt_file', None, 'Read the prompt from this file instead.')
_MAX_NEW = flags.DEFINE_integer('max_new_tokens', 500, 'Tokens to generate per sample.')
_TEMPERATURE = flags.DEFINE_float('temperature', 0.8, '0 = greedy; > 0 samples.')
_TOP_K = flags.DEFINE_integer('top_k', 200, 'Sample from the k most likely tokens (0 = all).')
_TOP_P = flags.DEFINE_float('top_p', 1.0, 'Nucleus sampling mass (1 = off).')
_NUM = flags.DEFINE_integer('num_samples', 3, 'Samples, drawn side by side.')
_SEED = flags.DEFINE_integer('seed', 1337, 'Sampling seed.')
_STEP = flags.DEFINE_integer('step', None, 'Checkpoint step; default the latest.')


def main():
  import transformer

  cli.compilation_cache()

  prompt = _PROMPT.value
  if _PROMPT_FILE.value:
    with open(_PROMPT_FILE.value, encoding='utf-8') as f:
      prompt = f.read()
  if _NUM.value < 1:
    raise ValueError(f'--num_samples={_NUM.value} must be >= 1')
  model = transformer.load(_WORKDIR.value, _STEP.value)
  top_k = _TOP_K.value if _TEMPERATURE.value > 0 else 0
  outputs = model.generate(
    [prompt] * _NUM.value,
    _MAX_NEW.value,
    temperature=_TEMPERATURE.value,
    top_k=min(top_k, model.cfg.vocab_size),
    top_p=_TOP_P.value if _TEMPERATURE.value > 0 else 1.0,
    seed=_SEED.value,
  )
  for output in outputs:
    print(prompt + output)
    print('---------------')


if __name__ == '__main__':
  cli.run(main)
