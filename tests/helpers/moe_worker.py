"""Workers that run a real Megatron MoELayer with the railwave dispatcher (spawned ranks)."""

from __future__ import annotations

from typing import Any

from tests.helpers.moe_layer import build_and_run_moe_layer


def run_layer_all_dispatchers(
    rank: int, world: int, railwave: dict, paths: list[str], kw: dict
) -> dict[str, Any]:
    """alltoall once, then railwave once per path; returns each run's arrays."""
    from megatron_railwave.testing.megatron_cpu import apply_megatron_cpu_shims

    apply_megatron_cpu_shims()
    import megatron_railwave

    out = {"alltoall": build_and_run_moe_layer(rank, world, "alltoall", **kw)}
    for path in paths:
        megatron_railwave.install({**railwave, "path": path})
        out[path] = build_and_run_moe_layer(rank, world, "railwave", **kw)
    return out


def run_layer_with_capture(rank: int, world: int, capture_dir: str, kw: dict) -> dict[str, Any]:
    """One railwave MoELayer forward/backward with routing capture on every call.

    Returns the routing the layer really dispatched: every routing map the dispatcher received in
    ``dispatch_preprocess`` ([T, E] bool, numpy), with its layer number and EP rank.
    """
    from megatron_railwave.testing.megatron_cpu import apply_megatron_cpu_shims

    apply_megatron_cpu_shims()
    import megatron_railwave
    from megatron_railwave.dispatcher import RailWaveTokenDispatcher, flush_captures

    seen = []
    original = RailWaveTokenDispatcher.dispatch_preprocess

    def spy(self, tokens, routing_map, probs):
        seen.append(
            {
                "layer": self.layer_number,
                "ep_rank": self.ep_rank,
                "routing_map": routing_map.detach().cpu().numpy().copy(),
            }
        )
        return original(self, tokens, routing_map, probs)

    RailWaveTokenDispatcher.dispatch_preprocess = spy
    try:
        megatron_railwave.install(
            {"gpus_per_node": 2, "path": "joint", "capture_dir": capture_dir, "capture_interval": 1}
        )
        build_and_run_moe_layer(rank, world, "railwave", **kw)
        flush_captures()
    finally:
        RailWaveTokenDispatcher.dispatch_preprocess = original
    return {"calls": seen}


def run_layer_flex_railwave_backend(
    rank: int, world: int, railwave: dict, kw: dict
) -> dict[str, Any]:
    """The same layer built as type 'railwave' and as type 'flex' with backend 'railwave'."""
    from megatron_railwave.testing.megatron_cpu import apply_megatron_cpu_shims

    apply_megatron_cpu_shims()
    import megatron_railwave

    megatron_railwave.install(railwave)
    return {
        "railwave": build_and_run_moe_layer(rank, world, "railwave", **kw),
        "flex": build_and_run_moe_layer(
            rank, world, "flex", extra_config={"moe_flex_dispatcher_backend": "railwave"}, **kw
        ),
    }
