"""The deviceless GPU check's parsing and verdicts, on ptxas logs written here; the compile itself
needs the CUDA plugin (`python -m experiments.gpu_check --deviceless`, run by CI's last stage)."""

import subprocess
import sys

import pytest

from bench import deviceless, ptxas

# Shaped like the logs ptxas writes through nvJitLink and Mosaic GPU's MOSAIC_GPU_DUMP_PTXAS.
LOG = """\
ptxas info    : (C7504) Potential Performance Loss: 'setmaxnreg' ignored to maintain compatibility.
ptxas warning : Registers are spilled to local memory in function 'k_one', 608 bytes spill stores
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'k_one' for 'sm_90a'
ptxas info    : Function properties for k_one
ptxas         .     616 bytes stack frame, 608 bytes spill stores, 624 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers, 17 bytes smem
ptxas info    : Compile time = 372.133 ms
I1202 nvjitlink.cc:273] libnvjitlink info log output: ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'k_two' for 'sm_90a'
ptxas info    : Function properties for k_two
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 226 registers, used 1 barriers
"""


def test_each_entry_gets_its_registers_spills_and_the_notes_printed_before_it():
  one, two = ptxas.parse_log(LOG)
  assert (one.name, one.registers, one.spill_stores, one.spill_loads) == ('k_one', 168, 608, 624)
  assert one.smem_bytes == 17
  assert len(one.warnings) == 1 and one.warnings[0].startswith('C7504')
  assert (two.name, two.registers, two.spills, two.warnings) == ('k_two', 226, 0, [])


def test_mosaic_dump_adds_its_smem_scratch(tmp_path):
  (tmp_path / 'sparrow_mgpu_dq_1.ptxas').write_text(
    LOG.split('I1202')[0].replace('k_one', 'sparrow_mgpu_dq_mosaic_gpu_kernel')
  )
  (tmp_path / 'sparrow_mgpu_dq_1.resources.txt').write_text(
    'Resources(smem_scratch_bytes=133120, x=0)'
  )
  (kernel,) = ptxas.mosaic_kernels(str(tmp_path))
  assert kernel.name == 'sparrow_mgpu_dq_mosaic_gpu_kernel' and kernel.smem_bytes == 133120 + 17


def _case(impl='pallas_mosaic', h=128, kernels=(), ok=True, **kw):
  case = deviceless.AttentionCase(
    impl, h, kw.pop('mask', 'causal'), kw.pop('dtype', 'bfloat16'), True, **kw
  )
  return {
    'implementation': impl,
    'head_dim': h,
    'mask': case.mask,
    'dtype': case.dtype,
    'kv_heads': case.kv_heads,
    'length': case.length,
    'name': case.name,
    'ok': ok,
    'error': '' if ok else 'Error: x',
    'kernels': [k.as_dict() for k in kernels],
  }


def _kernel(name='sparrow_mgpu_dkv_mosaic_gpu_kernel', regs=200, spill=0, warnings=()):
  return ptxas.Kernel(name, regs, spill, spill, 0, list(warnings))


def test_problems_name_spills_notes_ceilings_and_steps_that_stop_fitting():
  clean = {'attention': [_case(kernels=[_kernel()])], 'steps': []}
  assert deviceless.problems(clean) == []
  spill = {'attention': [_case(kernels=[_kernel(spill=8)])], 'steps': []}
  assert 'spills 8 bytes (limit 0)' in deviceless.problems(spill)[0]
  note = {
    'attention': [_case(kernels=[_kernel(warnings=['C7504 setmaxnreg ignored'])])],
    'steps': [],
  }
  assert 'C7504' in deviceless.problems(note)[0]
  # Known limits: the head-dim-256 backward may spill, up to its limit only.
  big = _kernel(regs=255, spill=1700)
  assert deviceless.problems({'attention': [_case(h=256, kernels=[big])], 'steps': []}) == []
  # Every other Mosaic GPU kernel is held to zero, grouped queries under a window too.
  grouped = _case(h=128, kernels=[_kernel(regs=255, spill=20)], mask='window', kv_heads=2)
  assert (
    'spills 20 bytes (limit 0)' in deviceless.problems({'attention': [grouped], 'steps': []})[0]
  )
  worse = _kernel(regs=255, spill=4000)
  assert deviceless.problems({'attention': [_case(h=256, kernels=[worse])], 'steps': []})
  triton = _case('pallas_triton', 64, [_kernel('sparrow_flash_forward', regs=255)])
  assert 'uses 255 registers' in deviceless.problems({'attention': [triton], 'steps': []})[0]
  failed = {'attention': [_case('pallas_triton', ok=False)], 'steps': []}
  assert 'did not compile' in deviceless.problems(failed)[0]
  step = {
    'preset': 'gpt_1b',
    'mesh': '1 GPU',
    'ok': True,
    'fits': False,
    'must_fit': True,
    'total_bytes': 200 * 2**30,
  }
  assert 'gpt_1b on 1 GPU' in deviceless.problems({'attention': [], 'steps': [step]})[0]
  assert deviceless.problems({'attention': [], 'steps': [dict(step, must_fit=False)]}) == []


def test_every_preset_and_mesh_is_checked_and_must_fit():
  cases = deviceless.step_cases()
  assert {(p, m) for p, m, _ in cases} == {
    (p, m) for p in deviceless.PRESETS for m in deviceless.MESHES
  }
  for preset in deviceless.PRESETS:
    config = deviceless.load_preset(preset)
    for shape in deviceless.MESHES.values():  # the batch splits over the mesh's data axes
      assert config.data.batch_size % (shape[0] * shape[1]) == 0
    assert config.model.num_heads % 4 == 0  # tensor parallelism 4 ways splits the heads
  llama = deviceless.load_preset('llama_7b').model
  assert (llama.num_layers, llama.d_model, llama.num_heads, llama.num_kv_heads) == (32, 4096, 32, 8)
  assert llama.activation == 'swiglu'


def test_the_h200_target_describes_an_sm90_with_its_memory():
  text = deviceless.TARGETS['h200'].target_config()
  assert 'cuda_compute_capability { major: 9 minor: 0 }' in text
  assert 'device_description_str: "NVIDIA H200"' in text and 'core_count: 132' in text
  assert 'major: 8' in deviceless.TARGETS['a100'].target_config()


def test_markdown_has_the_kernel_and_step_tables():
  report = {
    'device': 'NVIDIA H200',
    'capability': '9.0',
    'jax': 'x',
    'seconds': 1.0,
    'memory_bytes': 140 * 2**30,
    'problems': [],
    'attention': [_case(kernels=[_kernel()]) | {'temp_bytes': 0}],
    'steps': [
      {
        'preset': 'gpt2_small',
        'mesh': '1 GPU',
        'mesh_shape': [1, 1, 1],
        'ok': True,
        'attention': 'pallas',
        'batch': 16,
        'length': 1024,
        'fits': True,
        'argument_bytes': 2**30,
        'temp_bytes': 2**31,
        'total_bytes': 3 * 2**30,
      }
    ],
  }
  text = deviceless.markdown(report)
  assert '| mgpu_dkv | 200 | 0 / 0 |' in text
  assert '| gpt2_small | 1 GPU (1, 1, 1) | pallas | 16 x 1024 | 1.00 | 2.00 | 3.00 | yes |' in text


def test_without_the_cuda_plugin_it_is_one_clear_error(tmp_path):
  import importlib.util

  try:
    plugin = importlib.util.find_spec('jax_plugins.xla_cuda12')
  except ModuleNotFoundError:
    plugin = None
  if plugin is not None:
    pytest.skip('the CUDA plugin is installed here; CI runs the real deviceless command')
  out = subprocess.run(
    [sys.executable, '-m', 'experiments.gpu_check', '--deviceless', f'--out={tmp_path}'],
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert out.returncode == 2
  assert out.stderr.strip().splitlines()[-1].startswith('error: --deviceless needs the CUDA plugin')


def test_the_device_run_reads_registers_and_setmaxnreg_from_its_own_dumps(tmp_path):
  from bench import device_check

  for name, sass in (
    ('sparrow_mgpu_dq', '  SETMAXNREG.INC 232\n'),
    ('sparrow_mgpu_dkv', '  HMMA\n'),
  ):
    log = LOG.split('I1202')[0].replace('k_one', f'{name}_mosaic_gpu_kernel')
    (tmp_path / f'{name}_1.ptxas').write_text(log)
    (tmp_path / f'{name}_1.sass').write_text(sass)
  rows = {r['name']: r for r in device_check.built_kernels(str(tmp_path))}
  assert rows['sparrow_mgpu_dq_mosaic_gpu_kernel']['setmaxnreg_in_sass'] is True
  assert rows['sparrow_mgpu_dkv_mosaic_gpu_kernel']['setmaxnreg_in_sass'] is False
  assert rows['sparrow_mgpu_dkv_mosaic_gpu_kernel']['registers'] == 168
