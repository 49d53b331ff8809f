"""Build and benchmark helpers: attention timing and memory (timing), the GPU checks of a lent
machine (device_check), the deviceless compile for a GPU this machine lacks and its ptxas report
(deviceless, ptxas), and the PyTorch step that benchmarks compare against (torch_reference).

They measure the code; they hold no research claim. `research` uses them (the long-context and
memory sweeps time attention), never the reverse.
"""
