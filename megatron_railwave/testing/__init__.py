"""Test doubles and CPU shims: what the tests, the examples and the lab use to run the runtime
without GPUs. No runtime module imports this package (the ``halves`` import contract in
pyproject.toml places it between the lab and the runtime).

* ``deepep_fake``: a CPU stand-in for ``deep_ep`` 2.1's internode ``Buffer`` on gloo, and the
  hooks that hand it to the DeepEP backend (``fake_deepep_api``, ``use_fake_deepep``).
* ``megatron_cpu``: shims that let Megatron-Core's MoE layers run on a CPU-only torch.

Import the module you need (``from megatron_railwave.testing.megatron_cpu import ...``): this
file imports nothing, so the shims load without the runtime.
"""
