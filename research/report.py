"""The report of a sweep: `write_report(workdir)` -> workdir/report.md with PNG plots beside it.

It reads only workdir/sweep.json and workdir/results.jsonl (and the runs' metrics.jsonl curves
they name), so a report can be rebuilt anywhere; the verdicts are recomputed from the numbers by
the sweep's rules, and the report names the commit the runs recorded. A workdir whose
subdirectories hold sweeps gets an index report.md that links their reports.
"""

from __future__ import annotations

import collections
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from research import estimates, verdicts
from research import results as results_lib
from transformer import util

# kind -> (required keys, optional keys) of a sweep's extra `plots`.
PLOT_KINDS = {
  # one line per variant: the metrics in order against the numbers in x (e.g. loss vs length)
  'series': (('metrics', 'x'), ('variants', 'title', 'xlabel', 'ylabel', 'logx', 'logy')),
  # one point per variant: metric x against metric y; fit=True draws the fitted power law
  'scatter': (('x', 'y'), ('variants', 'title', 'xlabel', 'ylabel', 'logx', 'logy', 'fit')),
  # one line per entry of `lines` (name -> variants, one per x): metric against the numbers in x
  # (e.g. recall accuracy against the number of pairs, one line per attention)
  'lines': (('metric', 'x', 'lines'), ('title', 'xlabel', 'ylabel', 'logx', 'logy')),
}


def check_plots(plots: Sequence[Mapping]) -> None:
  """Raises one ValueError for a plot of unknown kind, or with a missing or unknown key."""
  for plot in plots:
    kind = plot.get('kind')
    if kind not in PLOT_KINDS:
      raise ValueError(f'plot kind={kind!r} is not valid; choose one of {", ".join(PLOT_KINDS)}')
    required, optional = PLOT_KINDS[kind]
    for key in required:
      if key not in plot:
        raise ValueError(f'plot of kind {kind!r} needs the key {key!r}')
    unknown = sorted(set(plot) - set(required) - set(optional) - {'kind'})
    if unknown:
      raise ValueError(f'plot of kind {kind!r} has unknown key {unknown[0]!r}')
    if kind == 'series' and len(plot['metrics']) != len(plot['x']):
      raise ValueError(f'series plot: metrics {plot["metrics"]} and x {plot["x"]} differ in size')
    if kind == 'lines':
      for name, variants in plot['lines'].items():
        if len(variants) != len(plot['x']):
          raise ValueError(f'lines plot: {name!r} has {len(variants)} variants for {plot["x"]}')


def _save(fig, workdir: str, name: str) -> str:
  fig.savefig(os.path.join(workdir, name), dpi=110, bbox_inches='tight')
  util.pyplot().close(fig)
  return name


def _mean_std(values: Sequence[float] | None) -> tuple[float, float]:
  if not values:
    return math.nan, math.nan
  return estimates.mean_std([v for v in values if v is not None] or [math.nan])


# Plots -----------------------------------------------------------------------------------------
def _load_curves(workdir: str, results: Sequence[Mapping], skip: set) -> dict[str, list[dict]]:
  curves: dict[str, list[dict]] = {}
  for r in results:
    if r['variant'] in skip or not r.get('curve'):
      continue
    path = os.path.join(workdir, r['curve'])
    if os.path.exists(path):
      curve = results_lib.read_curve(os.path.dirname(path))  # the run's metrics.jsonl
      if curve.get('train'):
        curves.setdefault(r['variant'], []).append(curve)
  return curves


def plot_curves(workdir: str, curves: Mapping[str, list[dict]]) -> str | None:
  """Training loss against step per variant: the mean over seeds and a min-max band."""
  if not curves:
    return None
  plt = util.pyplot()
  with_eval = any(len(c.get('eval', [])) > 1 for runs in curves.values() for c in runs)
  fig, axes = plt.subplots(1, 2 if with_eval else 1, figsize=(11 if with_eval else 6, 3.8))
  axes = np.atleast_1d(axes)
  ranges = {kind: [] for kind in ('train', 'eval')}
  for variant, runs in curves.items():
    for ax, kind in zip(axes, ('train', 'eval')):
      series = [[(h['step'], h['loss']) for h in c.get(kind, []) if 'loss' in h] for c in runs]
      series = [s for s in series if s]
      if not series:
        continue
      n = min(len(s) for s in series)
      steps = np.array([p[0] for p in series[0][:n]])
      losses = np.array([[p[1] for p in s[:n]] for s in series], np.float64)  # [seeds, n]
      losses = np.where(np.isfinite(losses), losses, np.nan)
      line = ax.plot(steps, np.nanmean(losses, 0), label=variant, lw=1.2)[0]
      ranges[kind] += [np.nanmin(losses), np.nanmax(losses)]
      if len(series) > 1:
        ax.fill_between(steps, np.nanmin(losses, 0), np.nanmax(losses, 0), alpha=0.2,
                        color=line.get_color())  # fmt: skip
  for ax, kind in zip(axes, ('train', 'eval')):
    ax.set_xlabel('step')
    ax.set_ylabel(f'{kind} loss')
    low, high = np.nanmin(ranges[kind] or [1.0]), np.nanmax(ranges[kind] or [1.0])
    if low > 0 and high / low > 5:  # losses that fall a long way: log axis, plain tick labels
      from matplotlib import ticker

      ax.set_yscale('log')
      ax.yaxis.set_minor_locator(ticker.LogLocator(subs=(2, 3, 5)))
      for set_formatter in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
        set_formatter(ticker.FormatStrFormatter('%g'))
    ax.grid(alpha=0.3, which='both')
    ax.legend(fontsize=7)
  axes[0].set_title('training loss (band: min-max over seeds)', fontsize=9)
  if with_eval:
    axes[1].set_title('eval loss', fontsize=9)
  return _save(fig, workdir, 'curves.png')


def plot_metrics(workdir: str, table: Mapping, metrics: Sequence[str], order: list[str]) -> str:
  """One bar chart per compared metric: the mean over seeds with a ±1 std error bar."""
  plt = util.pyplot()
  fig, axes = plt.subplots(
    1, len(metrics), figsize=(max(4.5, 1 + 0.5 * len(order)) * len(metrics), 3.6)
  )
  for ax, metric in zip(np.atleast_1d(axes), metrics):
    stats = [_mean_std((table.get(v) or {}).get(metric)) for v in order]
    means = np.array([m if math.isfinite(m) else np.nan for m, _ in stats])
    stds = np.array([s if math.isfinite(s) else 0.0 for _, s in stats])
    x = np.arange(len(order))
    ax.bar(x, np.nan_to_num(means), yerr=stds, capsize=3, color='tab:blue', alpha=0.8)
    for i, (m, _) in enumerate(stats):
      if not math.isfinite(m):
        ax.annotate('inf' if m == math.inf else 'n/a', (i, 0), ha='center', va='bottom', fontsize=7)
    ax.set_xticks(x)
    ax.set_xticklabels(order, rotation=30, ha='right', fontsize=7)
    ax.set_title(metric, fontsize=9)
    ax.grid(alpha=0.3, axis='y')
  return _save(fig, workdir, 'metrics.png')


def plot_extra(workdir: str, index: int, plot: Mapping, table: Mapping, order: list[str]) -> str:
  """One of the sweep's own plots (`PLOT_KINDS`)."""
  plt = util.pyplot()
  fig, ax = plt.subplots(figsize=(6, 4))
  variants = [v for v in (plot.get('variants') or order) if v in table]
  if plot['kind'] in ('series', 'lines'):
    rows = (
      {v: [(v, m) for m in plot['metrics']] for v in variants}
      if plot['kind'] == 'series'
      else {name: [(v, plot['metric']) for v in vs] for name, vs in plot['lines'].items()}
    )
    for v, cells in rows.items():
      stats = [_mean_std(table[u].get(m)) if u in table else (math.nan, math.nan) for u, m in cells]
      ys = np.array([m for m, _ in stats])
      errors = np.array([s if math.isfinite(s) else 0.0 for _, s in stats])
      ok = np.isfinite(ys)
      if ok.any():
        ax.errorbar(np.asarray(plot['x'])[ok], ys[ok], yerr=errors[ok], marker='o', ms=3,
                    capsize=2, label=v)  # fmt: skip
  else:
    points = [(v, _mean_std(table[v].get(plot['x']))[0], _mean_std(table[v].get(plot['y']))[0])
              for v in variants]  # fmt: skip
    points = [(v, x, y) for v, x, y in points if math.isfinite(x) and math.isfinite(y)]
    for v, x, y in points:
      ax.plot(x, y, 'o')
      ax.annotate(v, (x, y), fontsize=7, xytext=(3, 3), textcoords='offset points')
    positive = [(x, y) for _, x, y in points if x > 0 and y > 0]
    if plot.get('fit') and len(positive) >= 2:
      fit = estimates.fit_power_law(*zip(*positive))
      xs = np.geomspace(min(p[0] for p in positive), max(p[0] for p in positive), 50)
      ax.plot(xs, fit['c'] * xs ** fit['slope'], 'k--', lw=0.8,
              label=f'fit: {fit["c"]:.3g} x^{fit["slope"]:.3f} (r2 {fit["r2"]:.3f})')  # fmt: skip
  if plot.get('logx'):
    ax.set_xscale('log')
  if plot.get('logy'):
    ax.set_yscale('log')
  if plot['kind'] != 'scatter':  # label the measured x values themselves, not powers of ten
    from matplotlib.ticker import NullFormatter

    ax.set_xticks(plot['x'], [f'{x:g}' for x in plot['x']])
    ax.xaxis.set_minor_formatter(NullFormatter())
  ax.set_xlabel(plot.get('xlabel') or str(plot['x'] if plot['kind'] == 'scatter' else 'x'))
  ax.set_ylabel(plot.get('ylabel') or str(plot['y'] if plot['kind'] == 'scatter' else 'value'))
  ax.set_title(plot.get('title', ''), fontsize=9)
  ax.grid(alpha=0.3, which='both')
  if ax.get_legend_handles_labels()[0]:
    ax.legend(fontsize=7)
  return _save(fig, workdir, f'plot_{index}.png')


# Markdown --------------------------------------------------------------------------------------
def _cell(values: Sequence[float] | None, scale: float = 1.0, digits: str = '.4g') -> str:
  mean, std = _mean_std(values)
  if math.isnan(mean):
    return '—'
  if math.isinf(mean):
    return 'inf'
  text = format(mean * scale, digits)
  if std and math.isfinite(std) and std > 0:
    text += f' ± {format(std * scale, ".2g")}'
  return text


def _table3(
  results: Sequence[Mapping], table: Mapping, order: list[str], trained: bool
) -> list[str]:
  """Rows in the layout of Table 3 of "Attention Is All You Need" (steps '—': not trained)."""
  configs = {r['variant']: r['config'] for r in sorted(results, key=lambda r: -r['seed'])}
  translation = any(c['model']['family'] == 'encoder_decoder' for c in configs.values())
  quality = 'BLEU (dev)' if translation else 'accuracy (dev)'
  lines = [
    f'| variant | N | d_model | d_ff | h | d_k | P_drop | ε_ls | train steps | PPL (dev) '
    f'| {quality} | params |',
    '|---|---|---|---|---|---|---|---|---|---|---|---|',
  ]
  for v in order:
    if v not in configs:
      continue
    c, row = configs[v], table.get(v, {})
    m = c['model']
    d_k = m.get('head_dim') or m['d_model'] // m['num_heads']
    quality_key = 'eval.bleu' if translation else 'eval.accuracy'
    params = _mean_std(row.get('params'))[0]
    lines.append(
      f'| {v} | {m["num_layers"]} | {m["d_model"]} | {m["d_ff"]} | {m["num_heads"]} | {d_k} | '
      f'{m["dropout_rate"]:g} | {c["train"]["label_smoothing"]:g} | '
      f'{c["train"]["steps"] if trained else "—"} | '
      f'{_cell(row.get("eval.perplexity"), digits=".3f")} | '
      f'{_cell(row.get(quality_key), digits=".3g")} | '
      f'{"—" if math.isnan(params) else f"{params / 1e6:.3f}M"} |'
    )
  return lines


def _judged(meta: Mapping, results: Sequence[Mapping]):
  """(the preconditions' verdicts, the rules' verdicts) of a sweep's recorded numbers."""
  table = results_lib.metric_table(results)
  rules, pre = meta.get('rules') or [], meta.get('preconditions') or []
  return verdicts.judge(rules, table, pre, meta.get('nulls') or [], meta.get('groups'))


def _verdict_lines(meta: Mapping, results: Sequence[Mapping]) -> tuple[str, str, list[str]]:
  """(status, a note on rules that held, were inconclusive or could not run, the Markdown lines
  of the claim, the preconditions and the rules)."""
  pre, found = _judged(meta, results)
  status = verdicts.overall(found)
  skipped = {r['variant']: r.get('error') for r in results if r.get('status') == 'skipped'}
  filtered = sum(
    v.status == verdicts.NOT_RUN and v.text.startswith(verdicts.NOT_COMPARED) for v in found
  )
  not_run = sum(v.status == verdicts.NOT_RUN for v in found) - filtered
  unsure = sum(v.status == verdicts.INCONCLUSIVE for v in found)
  held = [v.rule.get('text') or v.rule['kind'] for v in found if v.status == verdicts.REPRODUCED]
  built = sum(v.status == verdicts.BY_CONSTRUCTION for v in found)
  notes = []
  failed = [p.rule['name'] for p in pre if p.status != verdicts.REPRODUCED]
  if failed:
    notes.append(f'precondition not met: {"; ".join(failed)}')
  if held and status != verdicts.REPRODUCED:  # a partial result is still a result
    notes.append(f'{len(held)} of {len(found)} rules held: {"; ".join(held)}')
  if built:  # they held on a null too: they could not have failed
    notes.append(f'{built} of {len(found)} rules hold by construction and do not count')
  if unsure and status != verdicts.INCONCLUSIVE:
    notes.append(f'{unsure} of {len(found)} rules inconclusive at this budget')
  if not_run and status != verdicts.NOT_RUN:
    notes.append(f'{not_run} of {len(found)} rules could not run here: no verdict on them')
  if filtered and status != verdicts.NOT_RUN:  # the data exist: a `where` condition left them out
    notes.append(
      f"{filtered} of {len(found)} rules not compared: an arm they name fails the rule's "
      'condition at every seed, so no verdict on them'
    )
  note = '; '.join(notes)
  line = f'**Verdict: {status}.**' + (f' {note} (see below).' if note else '')
  lines = [f'**Claim.** {meta.get("claim") or "(not stated)"}', '', line, '', *_null_lines(meta)]
  lines += _group_lines(meta, results)

  def why_not_run(v):
    if v.status != verdicts.NOT_RUN:
      return ''
    named = [v.rule.get(k) for k in ('a', 'b', 'variant')] + list(v.rule.get('variants') or [])
    return ''.join(f' ({n}: {skipped[n]})' for n in dict.fromkeys(named) if n in skipped)

  if pre:
    lines += ['Preconditions (a rule that needs one that fails is inconclusive):', '']
    for v in pre:
      held_word = (
        'holds'
        if v.status == verdicts.REPRODUCED
        else ('fails' if v.status == verdicts.NOT_REPRODUCED else v.status)
      )
      said = f' ({v.rule["text"]})' if v.rule.get('text') else ''
      lines.append(
        f'- **{v.rule["name"]}: {held_word}**{said}: {v.text}{why_not_run(v)}. '
        f'Rule: `{_rule_text(v.rule)}`.'
      )
    lines += ['', 'Rules:', '']
  for i, v in enumerate(found):
    said = f' ({v.rule["text"]})' if v.rule.get('text') else ''
    lines.append(
      f'{i + 1}. **{v.status}**{said}: {v.text}{why_not_run(v)}. Null: {v.null}. '
      f'Rule: `{_rule_text(v.rule)}`.'
    )
  if not found:
    lines.append('The sweep states no rule: no verdict.')
  return status, note, lines


def _group_lines(meta: Mapping, results: Sequence[Mapping]) -> list[str]:
  """Which member each group (`verdicts.best_of`) stands for, before the rules that compare it."""
  groups = meta.get('groups') or {}
  if not groups:
    return []
  _, chosen = verdicts.best_of(results_lib.metric_table(results), groups)
  lines = ['Groups (each stands for its member with the best mean of the metric):', '']
  for name, group in groups.items():
    pick, members = chosen.get(name, 'none recorded'), list(group['best_of'])
    edge = group.get('grid') and pick in (members[0], members[-1]) and len(members) > 2
    lines.append(
      f'- **{name}** = {pick}: best {group["metric"]} of {", ".join(members)}'
      + (' (best at the edge of its grid: a setting beyond it may do better)' if edge else '')
    )
  return lines + ['']


def _null_lines(meta: Mapping) -> list[str]:
  """The sweep's nulls in words, before the rules that are judged on them."""
  nulls = meta.get('nulls') or []
  if not nulls:
    return ['The sweep declares no null: no rule is checked against one that learns nothing.', '']
  lines = [
    'Nulls (what a model that learns nothing scores; a rule that holds on one too holds by '
    'construction and does not count):',
    '',
  ]
  return lines + [f'- **{n["name"]}**: {n["reason"]}' for n in nulls] + ['']


def _rules_note(meta: Mapping, results: Sequence[Mapping]) -> str:
  """A sentence when the rules were applied later than the runs were made (`rejudge`)."""
  judged = meta.get('rules_revision')
  if not judged or {r.get('git_revision') for r in results} == {judged}:
    return ''
  return (
    f'The verdict applies the rules of `{meta["path"]}` at revision `{judged}` to these recorded '
    f'runs (python -m experiments.report --workdir=... --rejudge).'
  )


def revision_note(results: Sequence[Mapping]) -> tuple[str, bool]:
  """(a Markdown sentence naming the commit of the runs, whether all are at one clean commit)."""
  counts = collections.Counter(r.get('git_revision') or 'unknown' for r in results)
  if len(counts) == 1:
    (revision,) = counts
    if revision == 'unknown':
      return '**Code: no recorded git revision**: these runs do not name their commit.', False
    if revision.endswith('-dirty'):
      return (
        f'**Code: commit `{revision[:-6]}` with uncommitted changes** (`{revision}`): no commit '
        'holds the code these numbers come from.'
      ), False
    return f'Code: commit `{revision}` (every run).', True
  shown = ', '.join(f'`{rev}` ({n} run{"s" * (n > 1)})' for rev, n in sorted(counts.items()))
  dirty = any(r.endswith('-dirty') or r == 'unknown' for r in counts)
  return (
    f'**Code: the runs are at {len(counts)} different revisions**{" (some dirty)" * dirty}: '
    f'{shown}. Regenerate at one commit before comparing them.'
  ), False


def _rule_text(rule: Mapping) -> str:
  return ', '.join(f'{k}={v!r}' for k, v in rule.items() if k not in ('text', 'name'))


def regenerate_command(workdir: str, meta: Mapping, seeds: int) -> str:
  """The command that reruns a sweep into `workdir` at the current commit: for a committed
  folder (results root/<name>) `experiments.regenerate`, which replaces runs from another commit
  (`experiments.sweep` refuses to mix them), else `experiments.sweep`."""
  parent, name = os.path.split(os.path.normpath(workdir))
  if name == meta['name'] and parent.replace(os.sep, '/') in results_lib.RESULT_ROOTS:
    gpu = ' --gpu' if parent.endswith('_gpu') else ''
    return f'python -m experiments.regenerate --only={name}{gpu}'
  return (
    f'python -m experiments.sweep --sweep={meta["path"]} --workdir={workdir} '
    f'--seeds={meta.get("seeds", seeds)} --scale={meta["scale"]}'
  )


def write_report(workdir: str) -> str:
  """Writes workdir/report.md (and its PNGs) for one sweep, or an index over sub-sweeps.

  Raises:
    ValueError: the workdir holds no results (run a sweep there first).
  """
  if not os.path.exists(os.path.join(workdir, results_lib.RESULTS)):
    subs = sorted(
      d for d in (os.listdir(workdir) if os.path.isdir(workdir) else [])
      if os.path.exists(os.path.join(workdir, d, results_lib.RESULTS))
    )  # fmt: skip
    if subs:
      return _write_index(workdir, subs)
  meta, results = results_lib.load_results(workdir)  # raises the one clear error
  table = verdicts.best_of(results_lib.metric_table(results), meta.get('groups') or {})[0]
  order = [v for v in list(meta['variants']) + list(meta.get('eval_variants') or {}) if v in table]
  _, _, verdict = _verdict_lines(meta, results)
  seeds = sorted({r['seed'] for r in results})
  wall = sum(r.get('wall_time_s') or 0 for r in results)
  backend = sorted({f'{r.get("backend")} ({r.get("device")})' for r in results})
  command = regenerate_command(workdir, meta, len(seeds))
  lines = [
    f'# {meta["name"]}',
    '',
    *verdict,
    '',
    ' '.join(filter(None, [revision_note(results)[0], _rules_note(meta, results)])),
    '',
    f'Runs: {len(results)} ({len(order)} variants x seeds {seeds}), scale {meta["scale"]}, '
    f'total wall time {wall / 60:.1f} min on {", ".join(backend)}. Regenerate with',
    '',
    f'```bash\n{command}\npython -m experiments.report --workdir={workdir}\n```',
    '',
    'The second line alone writes this report again from the recorded runs, in seconds.',
    '',
  ]
  if meta.get('description'):
    lines += [meta['description'], '']
  lines += [
    '## Results in the layout of Table 3',
    '',
    *_table3(results, table, order, meta.get('train', True)),
    '',
  ]
  lines += ['Mean ± std over seeds; PPL and BLEU/accuracy from the final evaluation.', '']
  metrics = list(meta.get('metrics') or [])
  if metrics:
    lines += ['## Compared metrics', '', '| variant | ' + ' | '.join(metrics) + ' |']
    lines += ['|---' * (len(metrics) + 1) + '|']
    for v in order:
      lines.append(f'| {v} | ' + ' | '.join(_cell(table[v].get(m)) for m in metrics) + ' |')
    lines += ['', f'![final metrics]({plot_metrics(workdir, table, metrics, order)})', '']
  curves = plot_curves(
    workdir, _load_curves(workdir, results, set(meta.get('eval_variants') or {}))
  )
  if curves:
    lines += ['## Loss curves', '', f'![loss curves]({curves})', '']
  for i, plot in enumerate(meta.get('plots') or []):
    name = plot_extra(workdir, i, plot, table, order)
    lines += [
      f'## {plot.get("title") or f"Plot {i}"}',
      '',
      f'![{plot.get("title", "")}]({name})',
      '',
    ]
  figures = [(r['variant'], r['seed'], f) for r in results for f in r.get('figures') or []]
  if figures:
    lines += ['## Figures', '']
    for variant, seed, path in figures:
      path = path.replace(os.sep, '/')
      if path.endswith('.png'):
        lines += [f'{variant}, seed {seed}:', '', f'![{variant}]({path})', '']
      else:
        lines += [f'- {variant}, seed {seed}: [{os.path.basename(path)}]({path})']
    lines.append('')
  # One row per run, with the compared metrics of that seed (the table above has their means).
  header = ['variant', 'seed', 'status', *metrics, 'wall time (s)', 'params', 'FLOPs/token']
  lines += ['## Runs', '', '| ' + ' | '.join(header) + ' |', '|---' * len(header) + '|']
  for r in results:
    note = f' ({r["error"]})' if r.get('error') else ''
    values = [_cell([r['metrics'][m]]) if m in r.get('metrics', {}) else '' for m in metrics]
    lines.append(
      f'| {r["variant"]} | {r["seed"]} | {r["status"]}{note} | '
      + ''.join(f'{v} | ' for v in values)
      + f'{r.get("wall_time_s", 0):.0f} | {r.get("params", 0):,} | '
      f'{r.get("flops_per_token", 0):.3g} |'
    )
  path = os.path.join(workdir, 'report.md')
  with open(path, 'w') as f:
    f.write('\n'.join(lines) + '\n')
  return path


def _write_index(workdir: str, subs: list[str]) -> str:
  """report.md over several sweep workdirs: one line per claim with its verdict and a link."""
  rows, everything = [], []
  for sub in subs:
    directory = os.path.join(workdir, sub)
    write_report(directory)
    meta, results = results_lib.load_results(directory)
    everything += results
    status, note, _ = _verdict_lines(meta, results)
    wall = sum(r.get('wall_time_s') or 0 for r in results) / 60
    claim = (meta.get('claim') or '').replace('|', '/')
    revisions = sorted({r.get('git_revision') or 'unknown' for r in results})
    rows.append(
      f'| {claim} | [{meta["name"]}]({sub}/report.md) | **{status}**'
      f'{f" ({note})" if note else ""} | {len(results)} | '
      f'{wall:.1f} min | {", ".join(f"`{rev[:12]}`" for rev in revisions)} |'
    )
  note, _ = revision_note(everything)
  lines = ['# Claims and verdicts', '', note.replace('every run', f'all {len(everything)} runs')]
  lines += ['', '| claim | sweep | verdict | runs | wall time | commit |', '|---' * 6 + '|', *rows]
  path = os.path.join(workdir, 'report.md')
  with open(path, 'w') as f:
    f.write('\n'.join(lines) + '\n')
  return path


def summary(workdir: str) -> dict[str, Any]:
  """The sweep's verdict as data: {'name', 'status', 'verdicts': [(status, text), ...]}."""
  meta, results = results_lib.load_results(workdir)
  pre, found = _judged(meta, results)
  return {
    'name': meta['name'],
    'status': verdicts.overall(found),
    'preconditions': [(v.rule['name'], v.status, v.text) for v in pre],
    'verdicts': [(v.status, v.text) for v in found],
  }
