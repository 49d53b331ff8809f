"""Claim (seed §5.2; Hernandez et al. 2022): piling on parameters without better data soon hits a
ceiling, and cleaning and deduplicating the data matters: a small share of repeated data hurts
well beyond its share. GPTs on the grammar corpus with 0-50% of the training examples drawn from
100 repeated ones, controls that see the same unique data spread evenly, and four widths on a
fixed small set of unique examples."""

# About 4 GPU minutes on one H200: 27 runs of 1200 steps (dispatch-bound at these widths).
GPU_SCALE = 4

_FRACTIONS = (0.0, 0.1, 0.3, 0.5)
_WIDTHS = (16, 32, 64, 128)
_SUBSET = 100  # repeated examples (Hernandez et al.: a small subset seen many times)


def get_sweep(scale: int = 1) -> dict:
  steps = 300 * scale
  examples = 30_000 * scale  # about one pass at 16 packed rows of 64 tokens per step
  fractions = [f'rep{round(100 * f)}' for f in _FRACTIONS]
  sizes = [f'size{w}' for w in _WIDTHS]
  variants = {
    f'rep{round(100 * f)}': {'data.num_train_examples': examples, 'data.repeat_fraction': f}
    for f in _FRACTIONS
  }
  # evenN: the unique examples that repN sees once, alone, for the same steps: the same unique
  # data (grammar draws its examples in order, so the first k of n are those of k), with the
  # repetition spread evenly: each seen 1/(1 - N%) times on average (10%: 1.11, 50%: 2).
  for f in _FRACTIONS[1:]:
    variants[f'even{round(100 * f)}'] = {'data.num_train_examples': round((1 - f) * examples)}
  for w in _WIDTHS:
    variants[f'size{w}'] = {
      'data.num_train_examples': examples // 15,  # 2000: about 15 passes, the data is the limit
      'model.d_model': w,
      'model.d_ff': 4 * w,
      'model.num_heads': max(1, w // 16),
    }
  trains = 'rep0 trains'
  preconditions = [
    dict(name=trains, kind='at_most', metric='eval.loss', variants=['rep0'], value=3.0,
         every_seed=True,
         text='rep0 ends below 3.0 nats at every seed (it learns the chain)'),
  ]  # fmt: skip
  rules = [
    dict(kind='ordering', metric='eval.loss', variants=fractions, direction='increasing',
         requires=[trains],
         text='the eval loss rises with the share of repeated examples, step by step'),
    *[dict(kind='greater', metric='eval.loss', a=f'rep{n}', b=f'even{n}',
           requires=[trains],
           text=f'piled-on repetition hurts beyond the unique data it displaces: rep{n} ends '
                f'worse than even{n}, which saw the same unique examples {1 / (1 - n / 100):.2g} '
                'times each on average')
      for n in (10, 30, 50)],
    dict(kind='largest_step', metric='eval.loss', variants=sizes, expect_at='size32',
         at_least_share=0.67,
         text='at a fixed budget of unique data, the first doubling of width gains the most, '
              "a larger share of the whole change along the four widths than model_scaling's "
              'power law with no data limit gives (0.66, the `power law` null)'),
  ]  # fmt: skip
  return dict(
    name='data_repetition',
    claim='Repeated data hurts beyond its share: the eval loss on fresh data rises with the share '
    'of training examples drawn from a small repeated subset, and at each share (10, 30 and '
    '50%) a model ends worse than one that saw the same unique examples, repeated evenly. At a '
    'fixed budget of unique data, a larger model gains less and less.',
    description=f'CausalLM 2 layers (gpt_tiny), d_model 64, grammar task, {steps} steps of 16 '
    'packed rows of 64 tokens (AdamW 3e-3, warmup then cosine). repN: '
    f'{examples} training examples (about one pass), N% of them copies of {_SUBSET} examples '
    '(data.repeat_fraction, data.repeat_subset: rep50 sees each of them about '
    f'{examples // 2 // _SUBSET} times and {examples // 2} distinct others once). evenN: the '
    'distinct examples that repN sees once, alone, for the same steps (even10, even30, even50: '
    f'{round(0.9 * examples)}, {round(0.7 * examples)}, {examples // 2} examples, about 1.11, '
    '1.43 and 2 passes): the unique data of repN, repeated evenly. sizeW: d_model W '
    f'({", ".join(map(str, _WIDTHS))}; d_ff 4W, heads of 16) '
    f'on {examples // 15} unique examples for the same {steps} steps (about 15 passes), so the '
    'data, not the parameters, is the limit. eval.loss is on fresh documents of the same chain '
    '(its entropy floor is 1.54 nats, its unigram loss 4.43).',
    base='configs/gpt_tiny.py',
    overrides={
      'data.max_length': 64,
      'data.batch_size': 16,
      'data.repeat_subset': _SUBSET,
      'train.steps': steps,
      'train.log_every': 10,
      'train.eval_every': steps,
      'train.checkpoint_every': steps,
      'train.eval_decode_examples': 0,
    },
    variants=variants,
    metrics=['eval.loss', 'train.loss'],
    preconditions=preconditions,  # fmt: skip
    nulls=[
      dict(
        name='unigram',
        reason='a model that learns only how often each token occurs scores '
        "the grammar's unigram loss, 4.43 nats, whatever its variant (an analytic value)",
        values={v: {'eval.loss': 4.43} for v in variants},
      ),
      dict(
        name='power law',
        reason='models with no data limit: a loss E + c N^-a, with the steepest '
        "exponent of model_scaling's fits (a = 0.712) and N the non-embedding parameters, about "
        'd_model^2, so each doubling of width gains 2^(-2a) = 0.373 times the one before and the '
        'first takes 1 / (1 + 0.373 + 0.139) = 0.66 of the change (E and c do not matter)',
        values={f'size{16 * 2**k}': {'eval.loss': 1.5 + 2 ** (-2 * 0.712 * k)} for k in range(4)},
      ),
    ],  # fmt: skip
    rules=rules,  # fmt: skip
  )
