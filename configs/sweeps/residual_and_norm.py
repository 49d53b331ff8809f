"""Claim (seed §3.4): without residual connections deep stacks do not train; LayerNorm beats
BatchNorm for variable-length sequences and small batches. Pre-LN GPTs of 2, 6 and 12 layers with
and without residual connections, and 2-layer GPTs with LayerNorm or BatchNorm (statistics over
the real tokens of padded, variable-length batches) at batches of 4, 16 and 64."""

# About 5 GPU minutes on one H200: 36 runs of 1000 steps (dispatch-bound at these widths).
GPU_SCALE = 4

_DEPTHS = (2, 6, 12)
_BATCHES = (4, 16, 64)


def get_sweep(scale: int = 1) -> dict:
  steps = 250 * scale
  width = 32 if scale == 1 else 128  # narrow, so that 12 layers stay CPU-sized at scale 1
  variants = {}
  for n in _DEPTHS:
    for name, on in (('res', True), ('nores', False)):
      variants[f'{name}{n}L'] = {
        'model.num_layers': n,
        'model.d_model': width,
        'model.num_heads': width // 16,
        'model.d_ff': 4 * width,
        'model.residual': on,
      }
  for b in _BATCHES:
    for name, norm in (('ln', 'layernorm'), ('bn', 'batchnorm')):
      variants[f'{name}_b{b}'] = {
        'model.norm': norm,
        'data.pack': False,  # one document per row, padded: lengths vary within every batch
        'data.batch_size': b,
      }
  trains = lambda v: dict(
    name=f'{v} trains', kind='at_most', metric='eval.loss', variants=[v], value=3.0,
    every_seed=True, text=f'{v}: ends below 3.0 nats at every seed',
  )  # fmt: skip
  rules = [
    dict(kind='less', metric='eval.loss', a=f'res{n}L', b=f'nores{n}L',
         requires=['res12L trains'], text=f'{n} layers: residual connections end better than none')
    for n in _DEPTHS[1:]
  ]  # fmt: skip
  rules += [
    dict(kind='greater', metric='eval.loss', a='nores12L', b='nores2L',
         requires=['res12L trains'], text='without residual connections, 12 layers end worse '
         'than 2'),
    dict(kind='at_least', metric='eval.loss', variants=['nores12L'], value=4.0,
         every_seed=True, requires=['res12L trains'],
         text='without residual connections, 12 layers do not train: the eval loss stays above '
         '4.0 nats (the unigram loss is 4.43) at every seed'),
    dict(kind='no_worse', metric='eval.loss', a='res12L', b='res2L', tolerance=0.05,
         requires=['res12L trains'],
         text='with residual connections, 12 layers end no worse than 2 (within 0.05 nats)'),
  ]  # fmt: skip
  rules += [
    dict(kind='less', metric='eval.loss', a=f'ln_b{b}', b=f'bn_b{b}',
         requires=[f'ln_b{b} trains'],
         text=f'batch {b}: LayerNorm ends better than BatchNorm')
    for b in _BATCHES[:2]
  ]  # fmt: skip
  rules.append(
    dict(kind='close', metric='eval.loss', a='ln_b64', b='bn_b64', tolerance=0.1,
         requires=['ln_b64 trains'],
         text='batch 64: BatchNorm comes within 0.1 nats of LayerNorm (its deficit is a '
         'small-batch one)')
  )  # fmt: skip
  return dict(
    name='residual_and_norm',
    claim='Without residual connections a deep stack does not train, while with them depth does '
    'not hurt; LayerNorm beats BatchNorm on variable-length, padded batches when batches are '
    'small, and BatchNorm catches up as they grow.',
    description=f'Residuals: pre-LN CausalLM of 2, 6 and 12 layers, d_model {width}, '
    f'{width // 16} heads of 16, d_ff {4 * width}, with (resNL) and without (noresNL: '
    "model.residual=False, each sub-layer's output replaces the stream) residual connections; "
    'packed rows of 64 tokens, batch 16. Norms: 2-layer pre-LN CausalLM, d_model 64 '
    "(gpt_tiny), with LayerNorm (lnB) or BatchNorm (bnB, model.norm='batchnorm': per-feature "
    'statistics over the real tokens of the batch, padding left out, running statistics with '
    'momentum 0.9 for evaluation) at every norm site, at batches of 4, 16 and 64 rows of one '
    'document each (data.pack=False: 2 to 64 tokens, padded), so the batch statistics mix '
    f'sequences of different lengths. Every run: the grammar task, {steps} steps of AdamW at '
    '3e-3, warmup then cosine, no dropout; eval.loss on fresh documents (BatchNorm: with its '
    "running statistics). The grammar's entropy floor is 1.54 nats and its unigram loss 4.43. "
    'A batch of 4 sees 16x fewer tokens than one of 64 in the same steps: compare LayerNorm '
    "and BatchNorm within a batch size, not across. A first run with flax's momentum of 0.99 "
    'evaluated BatchNorm with stale statistics: after 250 steps its running variance at the '
    'first norm was 0.087 against batch variances of 0.008-0.016 (8% of the initial 1 was '
    "left), and BatchNorm at batch 64 ended at 3.82 nats against LayerNorm's 1.79 while its "
    "training loss matched; sparrow's momentum is now PyTorch's 0.9. Rules about residuals "
    'need res12L to train; those about norms need LayerNorm to train at their batch size.',
    base='configs/gpt_tiny.py',
    overrides={
      'model.norm_placement': 'pre',
      'data.max_length': 64,
      'data.batch_size': 16,
      'train.steps': steps,
      'train.log_every': 10,
      'train.eval_every': steps,
      'train.checkpoint_every': steps,
      'train.nonfinite': 'skip',
      'train.eval_decode_examples': 0,
    },
    variants=variants,
    metrics=['eval.loss', 'train.loss'],
    preconditions=[trains('res12L'), *[trains(f'ln_b{b}') for b in _BATCHES]],
    nulls=[
      dict(
        name='unigram',
        reason='a model that learns only how often each token occurs scores '
        "the grammar's unigram loss, 4.43 nats, whatever its variant (an analytic value)",
        values={v: {'eval.loss': 4.43} for v in variants},
      ),
    ],  # fmt: skip
    rules=rules,
  )
