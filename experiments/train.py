"""Train (or resume) one experiment: python -m experiments.train --config=configs/X.py --workdir=DIR

Any config key can be overridden: --config.model.num_heads=4 --config.train.steps=3000.
Rerunning the same command on the same workdir resumes from the latest checkpoint.
SIGTERM or SIGINT saves a checkpoint after the current step and exits with status 75 (a second
signal stops at once); rerun the same command to resume.
Multi-process: add --coordinator_address=HOST:PORT --num_processes=N --process_id=I on each host
(SLURM and Cloud TPU pod slices are detected without them); see docs/scaling.md. Each
runs under experiments/supervisor.py: a lost peer ends it with one line and status 75.
A config file is Python code: run only configs you trust.
"""

import os

from absl import flags

from experiments import cli, supervisor

_CONFIG = cli.define_config()
_WORKDIR = flags.DEFINE_string('workdir', None, 'Run directory; default runs/<config name>.')
_COORDINATOR = flags.DEFINE_string(
  'coordinator_address', None, 'Multi-process: host:port of process 0 (jax.distributed).'
)
_NUM_PROCESSES = flags.DEFINE_integer('num_processes', None, 'Multi-process: number of processes.')
_PROCESS_ID = flags.DEFINE_integer('process_id', None, 'Multi-process: this process, 0-based.')


def main():
  if _multi_process() and not supervisor.is_child():
    supervisor.run_child()  # this command again, as a child that may lose a peer
  from transformer import sharding
  from transformer.training import peers
  from transformer.training.loop import train_and_evaluate

  # Before anything touches a device; also auto-detects SLURM and Cloud TPU pod slices.
  with peers.at_start_up(_NUM_PROCESSES.value):
    sharding.initialize_distributed(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
  if not _multi_process():
    cli.compilation_cache()  # a relaunch skips compiling
    sharding.use_every_core()  # on CPU: the batch split over one device per core
  config = _CONFIG.value
  train_and_evaluate(config, _WORKDIR.value or os.path.join('runs', config.name))


def _multi_process() -> bool:
  """The flags, SLURM or a TPU pod slice ask for several processes (as sharding detects them)."""
  if (_NUM_PROCESSES.value or 1) > 1:
    return True
  slurm = int(os.environ.get('SLURM_NTASKS', '1')) > 1
  return slurm or len(os.environ.get('TPU_WORKER_HOSTNAMES', '').split(',')) > 1


if __name__ == '__main__':
  cli.run(main)
