"""megatron-railwave: rail-balanced, incast-bounded expert-parallel communication.

Legend of the shape letters used in every module:
    N  nodes                     G  GPUs per node (local ranks)
    R  rails (NIC ports) per node W  world size = N * G (expert-parallel ranks)
    T  tokens on one rank        K  top-k
    E  experts (global)          H  hidden size
    M  target-GPU masks of one node (2**G)
    V  waves of a schedule (V = 1 for the all-at-once window)

Layers (imports point down only; ``lint-imports`` checks them, docs/architecture.md):
    topology -> traffic -> planner -> selector -> exchange -> dispatcher / plugin
Tools on top: replay, netmodel, testbed, bench; then commands and cli.
"""

__version__ = "0.1.0"


def install(config=None, **kwargs):  # noqa: ANN001, ANN201 - thin lazy re-export
    """Register ``moe_token_dispatcher_type='railwave'`` with Megatron-Core (see
    ``plugin.install``)."""
    from megatron_railwave.plugin import install as _install

    return _install(config, **kwargs)


__all__ = ["install", "__version__"]
