"""The grid of ``railwave sensitivity``: JOINT / baseline and RAIL / baseline over token skew x
fabric x pattern x seed on the flow model (``netmodel.sensitivity``: one cell, the summary, the
incast prediction), and the paper's incast experiment predicted on the same layers.

Letters: N nodes, G GPUs per node, W = N * G ranks.

Per (skew, seed, layer) the synthetic GLM-4.5-Air demand (``netmodel_bench.layer_demands`` at step
0), arranged into each pattern's windows and scaled by the payload factor; per fabric (an incast
alpha) one ``layer_cell``: the streamed NATIVE baseline, the paths and the peers (with
``deepep-balanced`` on the same step's tokens split equally over the ranks). The incast prediction
(NATIVE, RING -> EXTREME) reuses the skew-1.46 RING / EXTREME demands of the grid and builds the
missing layers' at the generator's default skew.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from megatron_railwave.lab.bench.netmodel_bench import RECORD_BYTES, layer_demands

__all__ = ["sensitivity_grid"]


def sensitivity_grid(
    topo: Any,
    base: Any,
    baseline: Any,
    *,
    fabrics: dict[str, float],
    skews: list[float],
    seeds: list[int],
    layers: list[int],
    patterns: list[str],
    tokens: int,
    payload_scale: float,
    path_delivery: str,
    peers: list[str],
    incast_layers: list[int] | None,
    progress: bool = True,
    chunks: int = 1,
    streamed: bool = False,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any] | None]:
    """(rows, summary, incast prediction): one row per (skew, fabric, pattern, seed, layer) cell,
    ``summarize_grid`` of them, and per fabric the predicted NATIVE EXTREME / RING slowdown over
    ``incast_layers`` (None: not predicted).

    ``base``: the paths' flow model (its alpha and delivery are set per fabric); ``baseline``: the
    baseline's (streamed NATIVE; alpha set per fabric); ``fabrics``: name -> incast alpha;
    ``chunks`` / ``streamed``: the paths' rail chunks and streamed relay (``PlanOptions``).
    """
    from tqdm.auto import tqdm

    from megatron_railwave.lab.netmodel.sensitivity import (
        layer_cell,
        predict_incast_slowdown,
        summarize_grid,
    )
    from megatron_railwave.lab.workloads import arrange, scaled_demand

    record_bytes = RECORD_BYTES
    rows: list[dict[str, Any]] = []
    total = len(skews) * len(seeds) * len(layers) * len(patterns) * len(fabrics)
    arranged: dict[
        tuple[int, int], dict[str, tuple[Any, Any]]
    ] = {}  # (seed, layer): skew 1.46 RING / EXTREME
    with tqdm(total=total, desc="sensitivity", disable=not progress, leave=False) as bar:
        for skew in skews:
            for seed in seeds:
                for layer in layers:
                    demand0 = layer_demands(
                        topo, layer=layer, step=0, tokens=tokens, seed=seed, token_skew=skew
                    )
                    even0 = (
                        layer_demands(
                            topo,
                            layer=layer,
                            step=0,
                            tokens=tokens,
                            seed=seed,
                            token_skew=skew,
                            balanced_tokens=True,
                        )
                        if "deepep-balanced" in peers
                        else None
                    )
                    for pattern in patterns:
                        demand, windows = (
                            (demand0, None)
                            if pattern == "none"
                            else arrange(demand0, pattern, topo)
                        )
                        demand = scaled_demand(demand, payload_scale)
                        balanced = None
                        if even0 is not None:
                            even, even_w = (
                                (even0, None)
                                if pattern == "none"
                                else arrange(even0, pattern, topo)
                            )
                            balanced = (scaled_demand(even, payload_scale), even_w)
                        if skew == 1.46 and pattern in ("ring", "extreme"):
                            arranged.setdefault((seed, layer), {})[pattern] = (demand, windows)
                        for fabric, a in fabrics.items():
                            cell = layer_cell(
                                demand,
                                windows,
                                topo,
                                baseline=replace(baseline, alpha=a),
                                paths_model=replace(base, alpha=a, delivery=path_delivery),
                                record_bytes=record_bytes,
                                peers=peers,
                                balanced=balanced,
                                chunks=chunks,
                                streamed=streamed,
                            )
                            rows.append(
                                {
                                    "skew": skew,
                                    "fabric": fabric,
                                    "pattern": pattern,
                                    "seed": seed,
                                    "layer": layer,
                                    **cell,
                                }
                            )
                            bar.update(1)
    summary = summarize_grid(rows)
    incast = None
    if incast_layers is not None:

        def layer_sets(seed: int):
            out = []
            for layer in incast_layers:
                if set(arranged.get((seed, layer), ())) != {"ring", "extreme"}:
                    demand0 = layer_demands(topo, layer=layer, step=0, tokens=tokens, seed=seed)
                    arranged[(seed, layer)] = {
                        p: (scaled_demand(d, payload_scale), w)
                        for p in ("ring", "extreme")
                        for d, w in [arrange(demand0, p, topo)]
                    }
                v = arranged[(seed, layer)]
                out.append((v["ring"][0], v["ring"][1], v["extreme"][0], v["extreme"][1]))
            return out

        incast = {
            fabric: {
                **predict_incast_slowdown(
                    topo,
                    replace(baseline, alpha=a),
                    seeds=seeds,
                    layer_sets=layer_sets,
                    record_bytes=record_bytes,
                ),
                "layers": len(incast_layers),
            }
            for fabric, a in fabrics.items()
        }
    return rows, summary, incast
