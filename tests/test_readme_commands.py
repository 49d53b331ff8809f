"""README's first two commands are what a fresh machine runs, and CI runs exactly the second."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_commands() -> list[str]:
  """The commands of README's first bash block, comments dropped."""
  with open(os.path.join(ROOT, 'README.md')) as f:
    block = re.search(r'```bash\n(.*?)```', f.read(), re.S).group(1)
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
