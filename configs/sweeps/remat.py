"""Claim: rematerialisation trades time for memory; full remat costs about 20-30% more step time.
Step time and compiled memory of the remat policies, on random tokens (no training)."""

from research.rules import COMPILED_MEMORY

# One H200: d_model 1024, d_ff 4096; each run compiles its policy and 'none' and times 7 steps
# of each, about 2 GPU minutes a seed.
GPU_SCALE = 8


def get_sweep(scale: int = 1) -> dict:
  rules = [
    dict(kind='less', metric='temp_mib', a='full', b='none', exact=COMPILED_MEMORY,
         text='remat saves memory'),
    *[dict(kind=kind, metric='step_ratio', variants=['full'], value=value, interval=True,
           text=f'full remat costs {word} {value - 1:.0%} more time than none (the 95% interval '
           'over seeds of the alternated step-time ratio)')
      for kind, value, word in (('at_least', 1.2, 'at least'), ('at_most', 1.3, 'at most'))],
  ]  # fmt: skip
  plots = [
    dict(kind='scatter', x='temp_mib', y='step_ms', title='step time against compiled memory',
         xlabel='temp memory (MiB)', ylabel='step time (ms)'),
  ]  # fmt: skip
  return dict(
    name='remat',
    claim='Full remat lowers the compiled memory of a training step and costs 20-30% more step '
    'time.',
    description=f'CausalLM 4 layers, d_model {128 * scale}, 4 heads, d_ff {512 * scale}, batch 16 '
    "x 256 tokens of random ids; the jitted training step as in training. Memory is XLA's "
    'compiled temp size, time the median of 5 steps after 2 warm-up steps. step_ratio is the '
    "median over those 5 rounds of one step of this policy over the step of remat 'none' just "
    "before it ('none' compiled beside it in the same process, the two timed in turn), so that "
    "the machine's drift moves both sides of each ratio. The layers are not "
    "scanned (the default); remat ties each block's recomputation to its incoming gradient, so "
    'XLA (CPU included) can neither merge it back into the forward nor run it early.',
    base='configs/gpt_tiny.py',
    train=False,
    overrides={
      'model.vocab_size': 512,  # gpt_tiny's tokenizer size (no data here to set it)
      'model.d_model': 128 * scale,
      'model.d_ff': 512 * scale,
      'model.num_layers': 4,
      'model.max_length': 256,
      'data.max_length': 256,
      'data.batch_size': 16,
    },
    variants={p: {'model.remat': p} for p in ('none', 'full', 'save_matmuls')},
    measure='step_time_memory',
    measure_args={'against': {'model.remat': 'none'}},  # each step timed beside one of none's
    metrics=['step_ms', 'step_ratio', 'temp_mib'],
    nulls=[
      dict(
        name='the compiled step',
        reason='nothing is trained: the compiled memory and time of a training step do not '
        'depend on what any parameters learned, so there is no null that learns '
        'nothing (an untrained model has the same numbers, and every rule would hold '
        'on it though each could fail: XLA could keep what remat drops, or time it '
        'otherwise)',
        values={},
      ),
      dict(
        name='no extra cost',
        reason="remat 'none' timed beside itself the same way: the step_ratio of a policy that "
        'costs nothing, as recorded (the time rules fail on it: they could fail)',
        values={'full': {'step_ratio': 'as recorded: none step_ratio'}},
      ),
    ],  # fmt: skip
    rules=rules,
    plots=plots,
  )
