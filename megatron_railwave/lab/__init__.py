"""The evaluation lab: everything that studies the runtime without being part of a training job.

``workloads`` (demands and GLM-4.5-Air-shaped generators), ``netmodel`` (the flow model),
``testbed`` (an emulated rail cluster in network namespaces) and ``bench`` (CPU benchmarks, the
online selector's simulation and the Megatron CPU shims). The lab uses
the runtime's public APIs only; the runtime never imports the lab (``lint-imports``).
"""
