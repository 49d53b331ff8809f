"""Claim (seed §3.2, at its sharpest; Olsson et al. 2022): heads divide the labour, and in a
2-layer attention model one kind of head, the induction head, appears abruptly during training.
At the same moment the loss on repeated text drops and the model gets markedly better at using
its context; a 1-layer model, which cannot compose a previous-token head with a copying head,
shows none of this."""

# --scale of the one-GPU run (an estimate, not measured: 9 runs of 4x the steps, about 5 min).
GPU_SCALE = 4

_STEPS = 2000
_EVERY = 50  # steps between induction logs: 50 points per run


def measure(ctx) -> dict:
  from research import induction

  return induction.measure(ctx)


def get_sweep(scale: int = 1) -> dict:
  steps = _STEPS * scale
  variants = {
    'attn1': {'model.num_layers': 1, 'model.d_ff': 0},
    'attn2': {'model.num_layers': 2, 'model.d_ff': 0},
    'mlp2': {'model.num_layers': 2, 'model.d_ff': 256},
  }
  forms = lambda v: dict(
    name=f'{v} forms an induction head', kind='at_least', metric='induction.final',
    variants=[v], value=0.3, every_seed=True,
    text=f'{v}: its best head puts >= 0.3 of its attention on the induction target at the end, '
    'at every seed',
  )  # fmt: skip
  needs = lambda v: {'requires': [f'{v} forms an induction head']}
  rules = []
  for v in ('attn2', 'mlp2'):
    rules += [
      dict(kind='at_most', metric='induction.rise_fraction', variants=[v], value=0.2,
           every_seed=True, text=f'{v}: the best induction score climbs from 20% to 80% of its '
           'rise within a fifth of training (abruptly)', **needs(v)),
      dict(kind='at_most', metric='phase.lag', variants=[v], value=0.1, every_seed=True,
           text=f"{v}: the in-context loss falls fastest within a tenth of training of the "
           "induction score's steepest rise", **needs(v)),
    ]  # fmt: skip
  rules += [
    dict(kind='at_most', metric='induction.final', variants=['attn1'], value=0.1,
         every_seed=True, text='attn1: no head of the 1-layer model becomes an induction head '
         '(best score <= 0.1 at every seed)'),
    dict(kind='less', metric='in_context.final', a='attn2', b='attn1',
         text='the 2-layer model gains more from its context than the 1-layer one (a lower '
         'in-context loss)', **needs('attn2')),
  ]  # fmt: skip
  return dict(
    name='induction',
    claim='An induction head appears abruptly in a 2-layer attention-only model, as its '
    'in-context loss drops; a 1-layer model forms none.',
    description='CausalLM gpt_tiny (d_model 64, 4 heads, RoPE) with 1 or 2 attention-only '
    "layers (model.d_ff=0) and a 2-layer model with MLPs (d_ff 256). Data: the grammar task's "
    'text with repeated spans: a Markov chain over 256 made-up words where each word may be '
    'followed by any other (data.grammar_successors=256, so the text is nearly random words), '
    'three documents per example, and every example followed by a verbatim copy of itself '
    '(data.grammar_repeat=1.0); SentencePiece tokens, packed rows of 128. '
    f'{steps} steps of 32 rows at a constant 3e-3 after 100 warmup steps. Every {_EVERY} steps '
    'the training loop logs (train.induction_every) every head\'s induction and previous-token '
    'scores on 8 rows of 25 random tokens repeated once, drawn from the ids of the batch just '
    'trained on, and the in-context loss of that batch: the mean loss on the last quarter of '
    'each document minus that on its first quarter. induction.final: the best head\'s score '
    'over the last 3 logs (chance is about 1/37); induction.rise_fraction: the share of '
    'training in which it climbs from 20% to 80% of its rise; phase.lag: the distance, as a '
    'share of training, between its steepest rise and the steepest fall of the in-context '
    'loss (each over 3 logs, after a running median of 3). How the task and budget were '
    'found (single-seed trials of the 2-layer attention-only model): on the default grammar '
    '(2-6 successors per word) with every example repeated, no head formed in 1000 steps with '
    'learned positions or RoPE (best induction score 0.03, chance): the bigram statistics '
    'already explain most of the text. With 256 successors and a cosine to 0 over 1000 steps the '
    'score crept to 0.10 as the rate decayed; at a constant rate it jumped from 0.10 to 0.61 '
    'between steps 600 and 900, with the in-context loss falling from -0.8 to -3.6 nats.',
    base='configs/gpt_tiny.py',
    overrides={
      'model.position': 'rope',
      'data.grammar_successors': 256,
      'data.grammar_repeat': 1.0,
      'data.grammar_join': 3,
      'optim.schedule': 'constant',
      'train.steps': steps,
      'train.eval_every': steps,
      'train.checkpoint_every': steps,
      'train.log_every': _EVERY,
      'train.induction_every': _EVERY,
      'train.eval_decode_examples': 0,
    },
    variants=variants,
    measure='measure',
    metrics=[
      'eval.loss', 'induction.final', 'induction.rise_fraction', 'induction.onset',
      'phase.lag', 'in_context.final', 'in_context.start',
    ],
    preconditions=[forms('attn2'), forms('mlp2')],
    nulls=[
      dict(name='untrained', reason='a model at init has no induction head: its best induction '
           'score is the chance level of the probe, about 1/37 (an analytic value, not a forward '
           'pass)', values={v: {'induction.final': 1 / 37} for v in ('attn1', 'attn2', 'mlp2')}),
    ],  # fmt: skip
    rules=rules,
  )  # fmt: skip
