"""The house's rooms: inside the library `transformer/`, imports point one way (data, model <-
training <- inference); the tools beside it (`bench/`, then `research/`) import the library and
never the reverse; no module imports itself back through others, and no source file outgrows one
job.

Every import counts, also those inside functions: a lazy import that dodges a cycle at import
time is still an arrow in the design.
"""

from __future__ import annotations

import ast
import os
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Lower ranks may be imported by higher ones, never the reverse. Same rank: the same room.
RANKS = {
  'transformer.kernels': 0,  # Pallas flash attention; it imports nothing else from transformer/
  'transformer.util': 0,
  'transformer.config': 0,
  'transformer.sharding': 0,
  'transformer.data': 1,
  'transformer.model': 2,
  'transformer.training': 3,
  'transformer.inference': 4,
  'transformer': 5,  # the public surface in transformer/__init__.py
}
# Beside the library, from a clone (never installed): the tools that build on it, in rank order.
TOOLS = ('bench', 'research')  # device checks and timing; sweeps, verdicts, studies, dissection
MAX_LINES = 800
# The model room is the one a researcher reads first: each of its files fits one sitting.
MAX_MODEL_LINES = 450


def _module_name(root: str, path: str) -> str:
  rel = os.path.relpath(path, root)[: -len('.py')].split(os.sep)
  if rel[-1] == '__init__':
    rel = rel[:-1]
  return '.'.join(rel)


def modules(root: str, packages: tuple[str, ...]) -> dict[str, str]:
  """{dotted module name: file path} of every .py file under `packages` of `root`."""
  found = {}
  for package in packages:
    for directory, _, files in os.walk(os.path.join(root, package)):
      for name in files:
        if name.endswith('.py'):
          path = os.path.join(directory, name)
          found[_module_name(root, path)] = path
  return found


def imports(path: str, name: str, known: set[str]) -> set[str]:
  """Modules that the file imports anywhere in it (functions included), as dotted names.

  `from a.b import c` is an import of `a.b.c` when that is a module, else of `a.b`.
  """
  tree = ast.parse(open(path).read(), path)
  package = name if path.endswith('__init__.py') else name.rpartition('.')[0]
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      out.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ''
      if node.level:  # relative: from . import x
        parts = package.split('.')
        parts = parts[: len(parts) - node.level + 1]
        base = '.'.join(parts + ([node.module] if node.module else []))
      for alias in node.names:
        full = f'{base}.{alias.name}'
        out.add(full if full in known else base)
  return out


def rank(module: str) -> int | None:
  """The rank of the room that holds `module` (None: outside transformer/)."""
  best = None
  for prefix, value in RANKS.items():
    if module == prefix or module.startswith(prefix + '.'):
      if best is None or len(prefix) > len(best[0]):
        best = (prefix, value)
  return None if best is None else best[1]


def graph(root: str) -> dict[str, set[str]]:
  """Edges between the project's own modules: the library, its tools, configs/, experiments/."""
  found = modules(root, ('transformer', *TOOLS, 'configs', 'experiments'))
  known = set(found)
  return {m: {t for t in imports(p, m, known) if t in known and t != m} for m, p in found.items()}


def _config_may_import(source: str, target: str) -> bool:
  """configs/base.py renders the library's defaults; a sweep file may define its own measure,
  which calls the library and the research tools. Any other config is a plain ConfigDict."""
  if source == 'configs.base':
    return target == 'transformer.config' or target.startswith('transformer.config.')
  return source.startswith('configs.sweeps')


def back_arrows(edges: dict[str, set[str]]) -> list[str]:
  """Imports that point up the house, or out of it where the design forbids."""
  bad = []
  for source, targets in sorted(edges.items()):
    for target in sorted(targets):
      top_s, top_t = source.split('.')[0], target.split('.')[0]
      kernels = 'transformer.kernels'
      if source.startswith(kernels + '.') and not (target + '.').startswith(kernels + '.'):
        bad.append(f'{source} -> {target} (the kernels import nothing else from transformer/)')
      elif top_s != 'experiments' and top_t == 'experiments':
        bad.append(f'{source} -> {target} (only experiments/ imports experiments/)')
      elif top_s == 'transformer' and top_t in (*TOOLS, 'configs'):
        bad.append(f'{source} -> {target} (the library never imports what stands beside it)')
      elif top_s in TOOLS and top_t in TOOLS and TOOLS.index(top_t) > TOOLS.index(top_s):
        bad.append(f'{source} -> {target} ({top_s}/ comes before {top_t}/)')
      elif top_s == 'configs' and top_t != 'configs' and not _config_may_import(source, target):
        bad.append(f'{source} -> {target} (configs are plain ConfigDicts)')
      elif top_s == top_t == 'transformer':
        rs, rt = rank(source), rank(target)
        if rt > rs:
          bad.append(f'{source} -> {target} (rank {rs} imports rank {rt})')
  return bad


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
  """Every strongly connected group of two or more modules (Tarjan), each sorted."""
  index, low, stack, on_stack, groups = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(edges.get(v, ())):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      group = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        group.append(w)
        if w == v:
          break
      if len(group) > 1:
        groups.append(sorted(group))

  for v in sorted(edges):
    if v not in index:
      visit(v)
  return groups


# The project itself --------------------------------------------------------------------------
def test_imports_point_one_way():
  assert back_arrows(graph(ROOT)) == []


def test_no_import_cycles():
  assert cycles(graph(ROOT)) == []


def test_every_room_exists_and_holds_modules():
  found = modules(ROOT, ('transformer',))
  for room in ('data', 'model', 'training', 'inference', 'kernels'):
    inside = [m for m in found if m.startswith(f'transformer.{room}.')]
    assert inside, f'transformer/{room}/ holds no modules'
  for tool in TOOLS:
    assert [m for m in modules(ROOT, (tool,)) if m.startswith(f'{tool}.')], f'{tool}/ is empty'


def test_no_module_shadows_the_standard_library():
  import sys

  stdlib = set(sys.stdlib_module_names)
  for name in modules(ROOT, ('transformer', *TOOLS)):
    leaf = name.rpartition('.')[2]
    assert leaf not in stdlib or leaf == '__init__', f'{name} shadows the standard library'


def test_no_source_file_is_over_800_lines():
  long = []
  for top in ('transformer', *TOOLS, 'configs', 'experiments'):
    for path in modules(ROOT, (top,)).values():
      count = sum(1 for _ in open(path))
      if count > MAX_LINES:
        long.append(f'{os.path.relpath(path, ROOT)}: {count} lines')
  assert long == []


def test_no_file_of_the_model_room_is_over_450_lines():
  paths = modules(ROOT, ('transformer',))
  model = [p for name, p in paths.items() if name.startswith('transformer.model')]
  assert len(model) > 10  # the room was found
  long = [
    f'{os.path.relpath(p, ROOT)}: {n}'
    for p in model
    if (n := len(open(p).readlines())) > MAX_MODEL_LINES
  ]
  assert long == [], f'over {MAX_MODEL_LINES} lines: {long}'


def test_experiments_only_call_the_package():
  # Thin entry points: experiments/ never reaches into a module's private names.
  for name, path in modules(ROOT, ('experiments',)).items():
    for node in ast.walk(ast.parse(open(path).read())):
      if (
        isinstance(node, ast.Attribute)
        and node.attr.startswith('_')
        and not (node.attr.startswith('__'))
      ):
        value = node.value
        if isinstance(value, ast.Name) and value.id in ('transformer', 'training', 'model'):
          raise AssertionError(f'{name} uses the private {value.id}.{node.attr}')


# The checker, on a tree made to break the rules ------------------------------------------------
def _write(root, files: dict[str, str]) -> None:
  for rel, text in files.items():
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, 'w') as f:
      f.write(textwrap.dedent(text))


def test_checker_finds_back_arrows_and_cycles_also_inside_functions(tmp_path):
  _write(
    tmp_path,
    {
      'transformer/__init__.py': '',
      'transformer/config.py': '',
      'transformer/model/__init__.py': '',
      'transformer/model/layers.py': 'from transformer.model import models\n',
      'transformer/model/models.py': """
        def build():
          from transformer.model import layers  # a lazy import still closes the cycle
          from transformer.training import loop  # and still points back up
      """,
      'transformer/training/__init__.py': '',
      'transformer/training/loop.py': 'import transformer.kernels.flash\n',
      'transformer/kernels/__init__.py': '',
      'transformer/kernels/flash.py': 'from transformer import config\n',
      'experiments/__init__.py': '',
      'experiments/train.py': 'from transformer.training import loop\n',
    },
  )
  edges = graph(str(tmp_path))
  assert edges['experiments.train'] == {'transformer.training.loop'}
  assert back_arrows(edges) == [
    'transformer.kernels.flash -> transformer.config'
    ' (the kernels import nothing else from transformer/)',
    'transformer.model.models -> transformer.training.loop (rank 2 imports rank 3)',
  ]
  assert cycles(edges) == [['transformer.model.layers', 'transformer.model.models']]


def test_checker_resolves_names_and_relative_imports(tmp_path):
  _write(
    tmp_path,
    {
      'transformer/__init__.py': 'from transformer.inference.api import load\n',
      'transformer/data/__init__.py': 'from .tokenizers import BOS_ID\n',
      'transformer/data/tokenizers.py': 'BOS_ID = 1\n',
      'transformer/inference/__init__.py': '',
      'transformer/inference/api.py': 'from transformer.data import BOS_ID\n',
      'transformer/data/tasks.py': 'from transformer import load\n',  # the surface, from below
    },
  )
  edges = graph(str(tmp_path))
  assert edges['transformer.data'] == {'transformer.data.tokenizers'}
  assert edges['transformer.inference.api'] == {'transformer.data'}
  assert back_arrows(edges) == ['transformer.data.tasks -> transformer (rank 1 imports rank 5)']
  assert cycles(edges) == []


def test_checker_keeps_the_tools_beside_the_library(tmp_path):
  _write(
    tmp_path,
    {
      'transformer/__init__.py': '',
      'transformer/training/__init__.py': '',
      'transformer/training/loop.py': 'from research import verdicts\n',  # the library, up
      'transformer/training/run.py': 'def f():\n  from configs import base\n',
      'research/__init__.py': '',
      'research/verdicts.py': 'from transformer.training import loop\n',
      'bench/__init__.py': '',
      'bench/timing.py': 'import research.verdicts\n',  # bench comes before research
      'configs/__init__.py': '',
      'configs/base.py': 'from transformer import config\n',
      'configs/gpt.py': 'from research import verdicts\n',  # a config is a plain ConfigDict
      'transformer/config.py': '',
    },
  )
  assert back_arrows(graph(str(tmp_path))) == [
    'bench.timing -> research.verdicts (bench/ comes before research/)',
    'configs.gpt -> research.verdicts (configs are plain ConfigDicts)',
    'transformer.training.loop -> research.verdicts'
    ' (the library never imports what stands beside it)',
    'transformer.training.run -> configs.base (the library never imports what stands beside it)',
  ]


def test_installing_puts_only_the_library_on_the_path():
  """The installed distribution provides one top-level module, `transformer`, and no other
  installed distribution provides it: sparrow shadows nothing (a top-level `kernels` once
  shadowed Hugging Face's), and nothing shadows sparrow."""
  from importlib import metadata

  providers = metadata.packages_distributions()
  ours = sorted(name for name, dists in providers.items() if 'sparrow' in dists)
  assert ours == ['transformer'], f'sparrow installs top-level {ours}; only transformer belongs'
  assert set(providers['transformer']) == {'sparrow'}, providers['transformer']
  for tool in ('configs', 'experiments', *TOOLS):
    assert 'sparrow' not in providers.get(tool, []), f'{tool}/ is installed; it runs from a clone'
