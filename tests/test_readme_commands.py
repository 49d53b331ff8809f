"""README and docs/ work as written: README's first two commands are what a fresh machine runs and
CI runs exactly the second; every `python -m experiments.*` command in README.md and docs/*.md
parses its flags against its entry point, and every relative link names a file (and a heading)
of the repository."""

import glob
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ['README.md'] + sorted(
  os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, 'docs', '*.md'))
)
_FENCE = re.compile(r'^```(\w*)\n(.*?)^```', re.S | re.M)
_SHELL = ('bash', 'sh', 'shell', '')


def _read(page: str) -> str:
  with open(os.path.join(ROOT, page)) as f:
    return f.read()


def readme_commands() -> list[str]:
  """The commands of README's first bash block, comments dropped."""
  block = re.search(r'```bash\n(.*?)```', _read('README.md'), re.S).group(1)
  return [line.split('#')[0].strip() for line in block.splitlines() if line.strip()]


def test_readme_starts_with_an_install_and_train_and_an_install_and_test_command():
  train, test = readme_commands()[:2]
  assert train.startswith('pip install -e . && python -m experiments.train'), train
  assert test.startswith("pip install -e '.[test]' && python -m pytest"), test


def test_ci_runs_readmes_test_command_on_both_stacks():
  test = readme_commands()[1].split('&&')[1].strip()
  with open(os.path.join(ROOT, '.ci', 'run')) as f:
    ci_lines = [line.split('#')[0].strip() for line in f]
  runs = [line for line in ci_lines if line.endswith(test)]
  assert len(runs) == 2, (test, [line for line in ci_lines if 'pytest' in line])
  # The only other pytest call is the slow kill test, which README's command leaves out.
  others = [line for line in ci_lines if 'pytest' in line and line not in runs]
  assert all('-m slow' in line for line in others), others


# Commands ------------------------------------------------------------------------------------


def _shell_lines(text: str) -> list[str]:
  """Shell lines of a page: each line of its bash blocks (continuations joined) and each inline
  code span that runs an entry point."""
  lines = []
  for lang, body in _FENCE.findall(text):
    if lang in _SHELL:
      lines += body.replace('\\\n', ' ').splitlines()
  prose = _FENCE.sub('', text)
  lines += [' '.join(span.split()) for span in re.findall(r'`([^`]+)`', prose)]
  return [line for line in lines if 'python -m experiments.' in line]


def _entry_point_calls(line: str) -> list[tuple[str, list[str]]]:
  """(module, args) for each `python -m experiments.X ...` in a shell line, also inside a quoted
  argument (`ssh ... --command="cd sparrow && python -m experiments.train ..."`)."""
  try:
    words = shlex.split(line, comments=True)
  except ValueError:  # an inline span cut in the middle of a quote
    words = line.split()
  calls = []
  for i, word in enumerate(words):
    if ' ' in word and 'python -m experiments.' in word:
      calls += _entry_point_calls(word)
    elif word == 'python' and words[i + 1 : i + 2] == ['-m'] and i + 2 < len(words):
      module = words[i + 2]
      if not module.startswith('experiments.'):
        continue
      args = []
      for arg in words[i + 3 :]:
        if arg in ('&&', '||', ';', '|') or not arg.startswith('-'):
          break
        args.append(re.sub(r'\$\{?\w+\}?', '0', arg))  # --process_id=$RANK
      calls.append((module, args))
  return calls


def documented_calls() -> dict[tuple[str, tuple[str, ...]], list[str]]:
  """Every entry-point call in README and docs/, with the pages that show it."""
  calls = {}
  for page in PAGES:
    for line in _shell_lines(_read(page)):
      for module, args in _entry_point_calls(line):
        calls.setdefault((module, tuple(args)), []).append(page)
  return calls


# Parses argv as `python -m MODULE` would, up to its main(): absl's flags, the --config file and
# its --config.a.b overrides (ml_collections reads them from sys.argv), required flags.
_PARSE = """
import importlib, sys
from absl import flags
module, *args = sys.argv[1:]
sys.argv = [module, *args]
importlib.import_module(module)
rest = flags.FLAGS(sys.argv)
assert rest == [module], f'unexpected arguments {rest[1:]}'
"""


@pytest.mark.slow  # about 35 s: one fresh interpreter per documented command
def test_every_documented_command_parses_against_its_entry_point(tmp_path):
  calls = documented_calls()
  assert len(calls) > 20 and any(m == 'experiments.sweep' for m, _ in calls), sorted(calls)
  # configs/workdir.py:DIR reads DIR/config.json: give it one, as experiments.convert_hf writes.
  saved = tmp_path / 'workdir'
  saved.mkdir()
  sys.path.insert(0, ROOT)
  try:
    from configs import default
  finally:
    sys.path.remove(ROOT)
  (saved / 'config.json').write_text(default.get_config().to_json_best_effort())
  failures = []
  for (module, args), pages in sorted(calls.items()):
    path = os.path.join(ROOT, *module.split('.')) + '.py'
    if not os.path.isfile(path):
      failures.append(f'{pages[0]}: no entry point {module} ({path})')
      continue
    if not args:  # named in prose: the entry point exists
      continue
    args = [re.sub(r'^(--config=configs/workdir\.py):.*', rf'\1:{saved}', a) for a in args]
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS='cpu')
    done = subprocess.run(
      [sys.executable, '-c', _PARSE, module, *args],
      cwd=ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=120,
    )
    if done.returncode != 0:
      error = (done.stderr.strip().splitlines() or ['(no output)'])[-1]
      failures.append(f'{pages[0]}: python -m {module} {" ".join(args)}\n    {error}')
  assert not failures, '\n'.join(failures)


# Links ---------------------------------------------------------------------------------------


def github_anchor(heading: str) -> str:
  """The id GitHub gives a heading: its text lower-cased, without markup and punctuation,
  spaces as hyphens."""
  text = re.sub(r'\[([^\]]*)\]\([^)]*\)', r'\1', heading)  # [text](link) -> text
  text = text.replace('`', '').strip().lower()
  text = re.sub(r'[^\w\- ]', '', text)
  return text.replace(' ', '-')


def anchors(path: str) -> set[str]:
  """The anchors of a markdown file's headings (a repeated one gets -1, -2, ...)."""
  with open(path) as f:
    text = _FENCE.sub('', f.read())
  seen = {}
  for heading in re.findall(r'^#{1,6}\s+(.+?)\s*#*\s*$', text, re.M):
    slug = github_anchor(heading)
    count = seen.get(slug, 0)
    seen[slug] = count + 1
    if count:
      seen[f'{slug}-{count}'] = 1
  return set(seen)


def relative_links(page: str) -> list[str]:
  """The link targets of a page outside code: `[text](target)`, without web and mail links."""
  text = _FENCE.sub('', _read(page))
  text = re.sub(r'`[^`]*`', '', text)
  targets = re.findall(r'\]\(([^)\s]+)(?:\s+"[^"]*")?\)', text)
  return [t for t in targets if not re.match(r'[a-z][a-z0-9+.-]*:', t)]


def broken_links(page: str) -> list[str]:
  broken = []
  for target in relative_links(page):
    path, _, anchor = target.partition('#')
    full = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), path)) if path else page
    full = os.path.join(ROOT, full)
    if not os.path.exists(full):
      broken.append(f'{page}: ({target}): no file {os.path.relpath(full, ROOT)}')
    elif anchor and (not full.endswith('.md') or anchor not in anchors(full)):
      broken.append(f'{page}: ({target}): no heading #{anchor} in {os.path.relpath(full, ROOT)}')
  return broken


@pytest.mark.parametrize('page', PAGES)
def test_every_relative_link_resolves(page):
  broken = broken_links(page)
  assert not broken, '\n'.join(broken)


def test_anchors_are_githubs():
  assert github_anchor('Compiled for the H200 (no GPU)') == 'compiled-for-the-h200-no-gpu'
  assert github_anchor('The `chunked` path: O(T) memory') == 'the-chunked-path-ot-memory'
  assert github_anchor('[Data](x.md) at scale') == 'data-at-scale'


def test_docs_have_an_index_that_links_every_page():
  index = relative_links('docs/README.md')
  for page in PAGES:
    if page.startswith('docs/') and page != 'docs/README.md':
      assert os.path.basename(page) in index, page
  assert 'docs/README.md' in relative_links('README.md')
