"""The evaluation lab: everything that studies the runtime without being part of a training job.

``workloads`` (demands and GLM-4.5-Air-shaped generators), ``netmodel`` (the flow model),
``testbed`` (an emulated rail cluster in network namespaces), ``bench`` (CPU benchmarks and the
Megatron CPU shims) and ``calibration`` (the selector's anchors and their validation). The lab uses
the runtime's public APIs only; the runtime never imports the lab (``lint-imports``).
"""
