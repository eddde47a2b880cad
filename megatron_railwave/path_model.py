"""RAIL or JOINT from the layer's counts: a calibrated log-linear model of their time ratio.

Why: the nearest-anchor rule sees only B, rho_g and kappa, and on the flow model whether RAIL or
(chunked) JOINT wins a layer also depends on things those three do not see: how each cyclic
wave's busiest node pair compares to the all-at-once rail load, how many NVLink copies the
busiest GPU receives per wave against all at once (the "delivery stretch" of docs/selector.md),
and how the fixed per-phase costs compare to the bandwidth time. This module computes those from
the gathered global counts, so every rank gets the same features and the same decision, and
predicts ``log(t_RAIL / t_JOINT)`` with coefficients fitted by ``railwave calibrate``
(least squares on the calibration requests' measured times; one coefficient vector for inputs
sent all node pairs at once, one for inputs in several sending windows).

Letters: N nodes, G GPUs per node, F features, P phases.

Per phase (RAIL: one per sending window; JOINT: one per cyclic wave k = 1 .. N - 1, node s to
s + k mod N), with B the record bytes:

* rail seconds: max over nodes of bytes sent or received in the phase / healthy rails of the
  pair / the rail rate (RailBalance spreads each pair evenly over its rails);
* relay seconds: max over GPUs of records moved to or from a proxy on the same node (owner-rail
  records above or below the even share) x B / NVLink rate;
* delivery seconds: max over destination GPUs of the (record, target GPU) copies they receive
  x B / NVLink rate.

Features (``FEATURE_NAMES``), with t_J = JOINT's rail + relay + delivery seconds summed over its
waves: a constant; x = log2(B_mean / 1 MiB) and x^2; log of RAIL's over JOINT's summed rail
seconds and summed delivery seconds; and the input's sending windows x 100 us / t_J (the fixed
per-phase costs against JOINT's bandwidth time). Chosen by leaving calibration seeds out on the
H800 and H20 4 x 8 calibrations (docs/selector.md): rho_g, kappa, the relay ratio, incast and
sender counts made the held-out seeds' predictions worse (rho_g most: seeds differ in skew
level, and RailBalance evens the rails on both paths anyway).

Cost: numpy over [N, G, N] arrays plus one pass per cyclic wave: 0.13 / 0.35 / 0.82 ms per layer
on 4 x 8 / 16 x 8 / 32 x 8 (one thread, the shared 2-core development machine, median of 20),
next to 0.3-0.4 ms for the descriptors; part of the planning time the dispatcher logs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from .planner import WaveSchedule, all_at_once
from .topology import RailTopology
from .traffic import DemandCounts, TrafficStats

__all__ = ["FEATURE_NAMES", "RailJointModel", "path_features", "delivery_copies_NNG", "fit_rail_joint"]

FEATURE_NAMES: tuple[str, ...] = ("const", "x", "x2", "log_rail", "log_delivery", "fixed")

_FIXED_S = 1e-4  # the scale of the fixed-cost features (about one layer's fixed costs)
_TINY = 1e-12


def delivery_copies_NNG(demand: DemandCounts) -> np.ndarray:
    """[N_src, N_dst, G] float64: (record, target GPU) copies node s sends to GPU j of node d
    (``DemandCounts.copies_WNG`` summed over the source node's ranks).

    Raises:
        ValueError: a node view gathered without delivery counts.
    """
    copies_WNG = demand.copies_WNG().to(torch.float64).numpy()
    n, g = copies_WNG.shape[1], copies_WNG.shape[2]
    return copies_WNG.reshape(n, g, n, g).sum(axis=1)


@lru_cache(maxsize=32)
def _healthy_rails_NN(topo: RailTopology) -> np.ndarray:
    """[N, N]: GPUs whose rail is healthy on both nodes of the pair (RailBalance's rails)."""
    n = topo.num_nodes
    return np.array([[sum(topo.pair_gpu_eligible(s, d)) for d in range(n)] for s in range(n)], dtype=np.float64)


@dataclass(frozen=True, slots=True)
class _Loads:
    """What every phase's loads are computed from (module docstring)."""

    per_rail_NN: np.ndarray
    """Records of each node pair per healthy rail."""
    excess_NGN: np.ndarray
    """Owner-rail records above the pair's even share (relayed out of the GPU)."""
    deficit_NGN: np.ndarray
    """Owner-rail records below it (relayed into the GPU)."""
    copies_NNG: np.ndarray
    record_bytes: int
    topo: RailTopology

    @classmethod
    def of(cls, records_NGN: np.ndarray, copies_NNG: np.ndarray, *, record_bytes: int, topo: RailTopology) -> _Loads:
        pair_NN = records_NGN.sum(axis=1)
        share_NGN = pair_NN[:, None, :] / records_NGN.shape[1]
        return cls(per_rail_NN=pair_NN / np.maximum(_healthy_rails_NN(topo), 1),
                   excess_NGN=np.maximum(records_NGN - share_NGN, 0.0),
                   deficit_NGN=np.maximum(share_NGN - records_NGN, 0.0), copies_NNG=copies_NNG,
                   record_bytes=record_bytes, topo=topo)

    def seconds(self, rail_NN: np.ndarray, relay_NG: np.ndarray, delivery_NG: np.ndarray) -> np.ndarray:
        """[3]: one phase's busiest-port rail, relay and delivery seconds from its port loads."""
        return np.array([rail_NN.max(initial=0.0) * self.record_bytes / self.topo.rail_bytes_per_s,
                         relay_NG.max(initial=0.0) * self.record_bytes / self.topo.nvlink_bytes_per_s,
                         delivery_NG.max(initial=0.0) * self.record_bytes / self.topo.nvlink_bytes_per_s])

    def windows(self, mask_PNN: np.ndarray) -> np.ndarray:
        """[P, 3] for phases given as node-pair masks (RAIL: the input's sending windows)."""
        out = []
        for mask in mask_PNN:
            rail = np.stack([(mask * self.per_rail_NN).sum(axis=1), (mask * self.per_rail_NN).sum(axis=0)])
            relay = np.maximum(np.einsum("nd,ngd->ng", mask, self.excess_NGN),
                               np.einsum("nd,ngd->ng", mask, self.deficit_NGN))
            out.append(self.seconds(rail, relay, np.einsum("sd,sdg->dg", mask, self.copies_NNG)))
        return np.array(out).reshape(len(out), 3)

    def cyclic(self) -> np.ndarray:
        """[N - 1, 3] for JOINT's cyclic waves (node s to s + k mod N): each node sends one pair
        and receives one, so the wave's ports are the pairs' own loads (no mask sums)."""
        n = self.per_rail_NN.shape[0]
        src = np.arange(n)
        out = []
        for k in range(1, n):
            dst = (src + k) % n
            out.append(self.seconds(self.per_rail_NN[src, dst],
                                    np.maximum(self.excess_NGN[src, :, dst], self.deficit_NGN[src, :, dst]),
                                    self.copies_NNG[src, dst, :]))
        return np.array(out).reshape(len(out), 3)


def _log_ratio(a: float, b: float) -> float:
    """log(a / b) for loads >= 0: 0 when both are 0, a zero side floored at 1e-9 of the other."""
    top = max(a, b)
    if top <= 0:
        return 0.0
    return math.log(max(a, 1e-9 * top) / max(b, 1e-9 * top))


def path_features(demand: DemandCounts, stats: TrafficStats, topo: RailTopology, *, record_bytes: int,
                  windows: WaveSchedule | None = None) -> np.ndarray:
    """[F] float64: the model's features of one layer (``FEATURE_NAMES``), identical on every rank.

    Args:
        demand: the gathered global counts (``records_WN`` plus delivery counts,
            ``delivery_copies_NNG``).
        stats: the layer's descriptors (``stats.demand_stats`` with the same ``windows``).
        record_bytes: payload bytes of one record (hidden x element size).
        windows: the input's sending windows (replay arrangements); None = all pairs at once.
    """
    loads = _Loads.of(demand.records_NGN().to(torch.float64).numpy(), delivery_copies_NNG(demand),
                      record_bytes=record_bytes, topo=topo)
    sending = windows if windows is not None else all_at_once(topo.num_nodes)
    window_NN = sending.pair_wave_NN().numpy()
    rail = loads.windows((window_NN[None] == np.arange(sending.num_waves)[:, None, None]).astype(np.float64))
    joint = loads.cyclic()
    sum_r, sum_j = rail.sum(axis=0), joint.sum(axis=0)
    t_joint = max(float(sum_j.sum()), _TINY)
    b = stats.B_mean_bytes
    x = math.log2(b / 2 ** 20) if b > 0 else 0.0
    return np.array([1.0, x, x * x, _log_ratio(float(sum_r[0]), float(sum_j[0])),
                     _log_ratio(float(sum_r[2]), float(sum_j[2])),
                     (windows.num_waves if windows is not None else 1) * _FIXED_S / t_joint])


@dataclass(frozen=True, kw_only=True, slots=True)
class RailJointModel:
    """Predicted ``log(t_RAIL / t_JOINT)`` = features . coef, one ``coef`` per input kind.

    Attributes:
        all_pairs: [F] coefficients for inputs sent all node pairs at once (a training step).
        windowed: [F] coefficients for inputs in several sending windows (replay arrangements);
            None: none were calibrated (such inputs then run JOINT).
    """

    all_pairs: tuple[float, ...]
    windowed: tuple[float, ...] | None = None

    def log_ratio(self, features: np.ndarray, *, input_windows: int = 1) -> float | None:
        """The prediction, None when no coefficients cover this input kind."""
        coef = self.all_pairs if input_windows == 1 else self.windowed
        return None if coef is None else float(np.dot(features, coef))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"target": "log(t_rail / t_joint)", "features": list(FEATURE_NAMES),
                               "all_pairs": [float(v) for v in self.all_pairs]}
        if self.windowed is not None:
            out["windowed"] = [float(v) for v in self.windowed]
        return out

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "path model") -> RailJointModel:
        """Parse ``to_dict``'s layout; a wrong one raises ValueError naming the field."""
        if not isinstance(data, dict):
            raise ValueError(f"{source}: must be a mapping, got {type(data).__name__}")
        if data.get("features") != list(FEATURE_NAMES):
            raise ValueError(f"{source}: field 'features' must be {list(FEATURE_NAMES)} (this version's features), "
                             f"got {data.get('features')!r}; re-run `railwave calibrate --retune`")

        def coef(key: str) -> tuple[float, ...] | None:
            raw = data.get(key)
            if raw is None and key == "windowed":
                return None
            if (not isinstance(raw, list) or len(raw) != len(FEATURE_NAMES)
                    or any(isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) for v in raw)):
                raise ValueError(f"{source}: field '{key}' must be a list of {len(FEATURE_NAMES)} finite numbers, "
                                 f"got {raw!r}")
            return tuple(float(v) for v in raw)

        return cls(all_pairs=coef("all_pairs"), windowed=coef("windowed"))  # type: ignore[arg-type]


def fit_rail_joint(features_RF: np.ndarray, windows_R: np.ndarray, log_ratio_R: np.ndarray) -> RailJointModel | None:
    """Least squares per input kind (all pairs at once / several windows); None without
    all-pairs requests. A kind with fewer requests than features gets no coefficients."""
    features_RF = np.asarray(features_RF, dtype=np.float64)
    windows_R, log_ratio_R = np.asarray(windows_R), np.asarray(log_ratio_R, dtype=np.float64)
    coefs = {}
    for kind, rows in (("all_pairs", windows_R == 1), ("windowed", windows_R != 1)):
        if int(rows.sum()) < features_RF.shape[1]:
            coefs[kind] = None
            continue
        beta = np.linalg.lstsq(features_RF[rows], log_ratio_R[rows], rcond=None)[0]
        coefs[kind] = tuple(float(v) for v in beta)
    if coefs["all_pairs"] is None:
        return None
    return RailJointModel(all_pairs=coefs["all_pairs"], windowed=coefs["windowed"])
