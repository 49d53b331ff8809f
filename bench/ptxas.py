"""What ptxas said about each GPU kernel of a deviceless compile: registers, spills, shared
memory and performance warnings, read from the compiler's own logs.

Two sources: Mosaic GPU writes one `.ptxas` log (and a `.resources.txt`) per kernel under
`MOSAIC_GPU_DUMP_TO`; every other kernel (Triton, XLA's fusions) is linked by nvJitLink, whose
verbose log reaches stderr with `--xla_gpu_ptx_compiler_extra_flags=-v` and
`TF_CPP_VMODULE=nvjitlink=3`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import os
import re
import tempfile

_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_USED = re.compile(r'Used (\d+) registers')
_SPILL = re.compile(r'(\d+) bytes spill stores, (\d+) bytes spill loads')
_SMEM = re.compile(r'(\d+) bytes smem')
_WARNING = re.compile(r'\((C\d{4})\) ([^\n]*)')
_MOSAIC_SMEM = re.compile(r'smem_scratch_bytes=(\d+)')
REGISTER_CEILING = 255  # the most registers a thread can have


@dataclasses.dataclass
class Kernel:
  """One kernel as ptxas built it."""

  name: str
  registers: int
  spill_stores: int
  spill_loads: int
  smem_bytes: int  # static SMEM from ptxas, plus Mosaic GPU's scratch where it is known
  warnings: list[str]  # ptxas performance notes, e.g. 'C7504 ... setmaxnreg ignored ...'

  @property
  def spills(self) -> int:
    return self.spill_stores + self.spill_loads

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


def parse_log(text: str) -> list[Kernel]:
  """Kernels in a ptxas log: each 'Compiling entry function' starts one.

  ptxas prints a function's performance notes and spill warning before its entry line, so the
  notes between one kernel's register count and the next entry belong to that next kernel.
  """
  text = text.replace('\x00', '')
  kernels, done = [], 0  # done: where the previous kernel's report ended
  for match in _ENTRY.finditer(text):
    notes = _WARNING.findall(text[done : match.start()])
    used = _USED.search(text, match.end())
    end = used.end() if used else match.end()
    body = text[match.end() : end]
    spill, smem = _SPILL.search(body), _SMEM.search(text, end, end + 200) if used else None
    done = end
    kernels.append(
      Kernel(
        name=match.group(1),
        registers=int(used.group(1)) if used else -1,
        spill_stores=int(spill.group(1)) if spill else 0,
        spill_loads=int(spill.group(2)) if spill else 0,
        smem_bytes=int(smem.group(1)) if smem else 0,
        warnings=sorted({f'{code} {what.strip()}' for code, what in notes}),
      )
    )
  return _dedupe(kernels)


def _dedupe(kernels: list[Kernel]) -> list[Kernel]:
  """One entry per kernel name (a log may repeat a module's summary)."""
  seen: dict[str, Kernel] = {}
  for k in kernels:
    if k.name not in seen or (seen[k.name].registers < 0 <= k.registers):
      seen[k.name] = k
  return list(seen.values())


def mosaic_kernels(dump_dir: str) -> list[Kernel]:
  """Mosaic GPU kernels from a `MOSAIC_GPU_DUMP_TO` folder, with their SMEM scratch added."""
  kernels = []
  for path in sorted(glob.glob(os.path.join(dump_dir, '*.ptxas'))):
    with open(path, errors='replace') as f:
      kernels.extend(parse_log(f.read()))
  scratch = {}
  for path in glob.glob(os.path.join(dump_dir, '*.resources.txt')):
    base = re.sub(r'_\d+\.resources\.txt$', '', os.path.basename(path))
    with open(path, errors='replace') as f:
      found = _MOSAIC_SMEM.search(f.read())
    if found:
      scratch[base] = int(found.group(1))
  for k in kernels:
    k.smem_bytes += scratch.get(k.name.removesuffix('_mosaic_gpu_kernel'), 0)
  return _dedupe(kernels)


@contextlib.contextmanager
def captured_stderr():
  """Collects what the process (C++ included) writes to file descriptor 2; yields a list that
  holds the text once the block ends."""
  out: list[str] = []
  with tempfile.TemporaryFile(mode='w+b') as tmp:
    saved = os.dup(2)
    os.dup2(tmp.fileno(), 2)
    try:
      yield out
    finally:
      os.dup2(saved, 2)
      os.close(saved)
      tmp.seek(0)
      out.append(tmp.read().decode('utf-8', errors='replace'))
