"""Summaries of RailWave's per-layer JSONL logs (``railwave report``).

A log directory may hold several runs (each run writes its own files and tags its records with
its ``run`` id, ``commlog.split_runs``); a summary is of one run, never a mix.

Per-rank logs repeat each layer call on every rank: the path and the descriptors are global, the
times rank-local, so a call (layer, step, micro-batch, pass) counts once and its time is the
slowest rank's dispatch + combine (``layer_calls``). Per layer (``summarize_logs``): calls, path
mix, P50/P95 of dispatch + combine, mean B, rho_g, kappa, relayed records, waves, bytes per rail,
expert load, overload factor and the rail shares (mean over nodes of the busiest and idlest
rail's share of remote egress), and with the online selector the share of calls that probed and
the fallbacks to JOINT; per path: calls, P50/P95 and the sorted NIC shares.

Letters: R rails.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

from megatron_railwave.names import ROUTES

__all__ = ["PATHS", "layer_calls", "summarize_logs"]

PATHS = tuple(map(str, ROUTES))


def layer_calls(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per layer call (layer, step, micro-batch, pass): the first record's globals, the
    slowest rank's time."""
    runs = {rec.get("run") for rec in records}
    if len(runs) > 1:
        raise ValueError(
            f"log records of {len(runs)} runs ({sorted(map(str, runs))}); summarise each run on "
            f"its "
            "own (commlog.split_runs)"
        )
    by_key: dict[tuple[int, int, int, str], dict[str, Any]] = {}
    for rec in records:
        for key in ("layer", "step", "path"):
            if key not in rec:
                raise ValueError(
                    f"log record without {key!r}: {sorted(rec)[:8]}...; not a RailWave log"
                )
        ms = float(rec.get("dispatch_ms", 0.0)) + float(rec.get("combine_ms", 0.0))
        key = (
            int(rec["layer"]),
            int(rec["step"]),
            int(rec.get("microbatch", 0)),
            str(rec.get("pass_kind", "train")),
        )
        if key not in by_key:
            by_key[key] = {**rec, "comm_ms": ms}
        else:
            by_key[key]["comm_ms"] = max(by_key[key]["comm_ms"], ms)
    return [by_key[k] for k in sorted(by_key)]


def _mean(calls: list[dict[str, Any]], key: str, default: float = 0.0) -> float:
    return float(np.mean([c.get(key, default) for c in calls]))


def _rail_bytes(calls: list[dict[str, Any]]) -> list[float]:
    """[R] mean over calls of the bytes each rail carries, summed over nodes (dispatch rows)."""
    rows = [
        np.asarray(c["rail_bytes"], dtype=np.float64).sum(axis=0)
        for c in calls
        if c.get("rail_bytes")
    ]
    return np.mean(rows, axis=0).tolist() if rows else []


def _sorted_shares(rec: dict[str, Any]) -> np.ndarray:
    """[R] mean over nodes of the rail shares sorted descending (nodes with no egress skipped)."""
    shares = np.asarray(rec.get("rail_shares") or [[0.0]], dtype=np.float64)
    active = shares[shares.sum(axis=1) > 0]
    if active.size == 0:
        return np.zeros(shares.shape[1])
    return np.sort(active, axis=1)[:, ::-1].mean(axis=0)


def summarize_logs(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-layer and per-path summary of log records (see the module docstring)."""
    calls = layer_calls(records)
    layers: dict[int, list[dict[str, Any]]] = defaultdict(list)
    paths: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for c in calls:
        layers[int(c["layer"])].append(c)
        paths[str(c["path"])].append(c)
    rows = []
    for layer in sorted(layers):
        cs = layers[layer]
        ms = np.array([c["comm_ms"] for c in cs])
        shares = np.array([_sorted_shares(c) for c in cs])
        rows.append(
            {
                "layer": layer,
                "calls": len(cs),
                "path_mix": {p: sum(c["path"] == p for c in cs) / len(cs) for p in PATHS},
                "p50_ms": float(np.percentile(ms, 50)),
                "p95_ms": float(np.percentile(ms, 95)),
                "dispatch_ms": _mean(cs, "dispatch_ms"),
                "combine_ms": _mean(cs, "combine_ms"),
                "B_mean_MiB": _mean(cs, "B_mean_bytes") / (1 << 20),
                "rho_g": _mean(cs, "rho_g", 1.0),
                "kappa": _mean(cs, "kappa", 1.0),
                "relayed_records": _mean(cs, "relayed_records"),
                "num_waves": _mean(cs, "num_waves"),
                "rail_bytes": _rail_bytes(cs),
                "tokens_per_expert_min": _mean(cs, "tokens_per_expert_min"),
                "tokens_per_expert_max": _mean(cs, "tokens_per_expert_max"),
                "tokens_per_expert_std": _mean(cs, "tokens_per_expert_std"),
                "overload_factor": _mean(cs, "overload_factor"),
                "rail_share_max": float(shares[:, 0].mean()),
                "rail_share_min": float(shares[:, -1].mean()),
                **_online_row(cs),
            }
        )
    per_path = {}
    for p, cs in sorted(paths.items()):
        ms = np.array([c["comm_ms"] for c in cs])
        per_path[p] = {
            "calls": len(cs),
            "p50_ms": float(np.percentile(ms, 50)),
            "p95_ms": float(np.percentile(ms, 95)),
            "nic_shares": np.mean([_sorted_shares(c) for c in cs], axis=0).tolist(),
        }
    run = str(records[0].get("run", "")) if records else ""
    passes = sorted({str(c.get("pass_kind", "train")) for c in calls})
    return {
        "run": run,
        "layers": rows,
        "paths": per_path,
        "num_calls": len(calls),
        "num_records": len(records),
        "passes": passes,
    }


def _online_row(calls: list[dict[str, Any]]) -> dict[str, Any]:
    """The online selector's share of probing calls and fallbacks of one layer ({} without it)."""
    modes = [c.get("selector_mode") or "" for c in calls]
    if not any(modes):
        return {}
    return {
        "online_probe_share": sum(m in ("probe", "reprobe") for m in modes) / len(modes),
        "online_fallback_calls": sum(m == "fallback" for m in modes),
    }
