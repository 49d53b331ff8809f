"""A stand-in for one process of a multi-process run, under experiments/supervisor.py.

  python tests/training/supervised_child.py BEHAVIOUR CHECKPOINT_DIR

BEHAVIOUR: 'aborted' (prints what the coordination service prints when a peer is gone, then
SIGABRT), 'coordinator_gone' (the same when process 0 and the service are gone), 'signals'
(counts SIGTERMs for 2 s, prints `preempted: N` and exits with 75), 'crash' (a traceback,
status 1), 'segfault' (SIGSEGV without a word about peers).
"""

import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from experiments import supervisor  # noqa: E402

if not supervisor.is_child():
  supervisor.run_child()
behaviour, checkpoints = sys.argv[1], sys.argv[2]
with open(os.environ['SPARROW_SUPERVISOR_INFO'], 'w') as f:
  f.write(f'{{"checkpoints": "{checkpoints}", "process": 2}}')
if behaviour == 'aborted':
  sys.stderr.write(
    'E1201 09:40:56.438846   30238 coordination_service.cc:1549] Use error polling to propagate '
    'the following error to all tasks: UNAVAILABLE: Task 1 heartbeat timeout.\n'
    'F1201 09:40:56.439 client.h:80] Terminating process because the JAX distributed service '
    'detected fatal errors.\n*** Check failure stack trace: ***\n    @     0x7f6634a40634  abc\n'
    'Fatal Python error: Aborted\n'
  )
  sys.stderr.flush()
  os.abort()
elif behaviour == 'coordinator_gone':
  sys.stderr.write(
    'E1201 09:40:38.739326   30257 coordination_service_agent.cc:289] Polled an error from '
    'coordination service (this can be an error from this or another task).\n'
    'F1201 09:40:38.7394 client.h:80] Terminating process because the JAX distributed service '
    'detected fatal errors.\n'
  )
  sys.stderr.flush()
  os.abort()
elif behaviour == 'signals':
  got = []
  signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
  print('ready', flush=True)
  deadline = time.time() + 10
  while not got and time.time() < deadline:
    time.sleep(0.01)
  time.sleep(2)  # a second copy of the signal would come within this
  print(f'preempted: {len(got)} SIGTERM', file=sys.stderr, flush=True)
  sys.exit(75)
elif behaviour == 'crash':
  raise RuntimeError('a bug: not a lost peer')
elif behaviour == 'segfault':
  print('nothing about other processes', file=sys.stderr, flush=True)
  os.kill(os.getpid(), signal.SIGSEGV)
