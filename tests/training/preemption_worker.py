"""One process of a 2-process CPU job (1 device each) that tests/training/test_faults.py preempts.

  python tests/training/preemption_worker.py PROCESS_ID PORT WORKDIR

It trains like `python -m experiments.train` and, when stopped, exits as the CLI does.
"""

import os
import sys

os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=1'
os.environ['JAX_PLATFORMS'] = 'cpu'

from test_faults import kill_config  # noqa: E402

from transformer import sharding
from transformer.training.faults import EXIT_PREEMPTED, Preempted  # noqa: E402
from transformer.training.loop import train_and_evaluate


def main(process_id: int, port: int, workdir: str) -> None:
  sharding.initialize_distributed(f'127.0.0.1:{port}', 2, process_id)
  config = kill_config(steps=100_000, checkpoint_every=100_000)  # stops only when told to
  try:
    train_and_evaluate(config, workdir)
  except Preempted as stop:
    print(f'preempted: {stop}', file=sys.stderr, flush=True)
    sys.exit(EXIT_PREEMPTED)


if __name__ == '__main__':
  main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
