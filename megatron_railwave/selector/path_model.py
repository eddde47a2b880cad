"""RAIL or JOINT from the layer's counts: an analytic estimate of both paths' time, calibrated.

Why: the nearest-anchor rule sees only B, rho_g and kappa, and on the flow model whether RAIL or
(chunked) JOINT wins a layer depends on what those three do not see: how each cyclic wave's
busiest node pair compares to the all-at-once rail load, how many NVLink copies the busiest GPU
receives per wave against all at once, how long the relay and the local round hold the NVLink
ports before the first rail phase may start, and how the fixed per-phase costs compare to the
bandwidth time. This module estimates the layer's time on each path from the gathered global
counts, phase by phase in the schedule's own order (``schedule.execution``), so every rank gets
the same estimate and the same decision, and predicts ``log(t_RAIL / t_JOINT)`` as an affine
function of ``log(est_RAIL / est_JOINT)`` fitted by ``railwave calibrate`` (least squares on the
calibration requests' measured times; one pair of coefficients for inputs sent all node pairs
at once, one for inputs in several sending windows).

Letters: N nodes, G GPUs per node, F features, P phases, B the record bytes.

Port loads per phase (RAIL: one per sending window; JOINT: one per cyclic wave k = 1 .. N - 1,
node s to s + k mod N, split into the plan's rail chunks):

* rail seconds: max over nodes of records sent or received in the phase / healthy rails of the
  pair x B / the rail rate (RailBalance spreads each pair evenly over its rails);
* delivery seconds per GPU port: the copies that cross NVLink in the round, into each target
  GPU and out of each arrival GPU, x B / NVLink rate; which copies arrive on which GPU (and in
  which rail chunk) comes from ``arrivals``: RailBalance's kept and moved parts of each owner's
  mask-sorted list, exact per mask class (the top two target bits), expected copies under
  independent low target bits inside a class. A copy that arrives on its
  target stays there. A round lasts as long as its busiest port's;
* before the first rail phase (the same on both paths): the relay (owner-rail records above or
  below the even share over the pair's healthy rails, moved to or from a proxy) and the local
  round (each owner's copies for the other GPUs of its own node, exact) share the NVLink ports:
  the busiest GPU port's relay + local-round load.

Estimate: per-layer cost + the relay and local round + dispatch's rail phases and delivery
rounds as a two-stage pipeline (delivery round v + 1 starts once rail phase v and round v are
done; rail phase v + 1 once rail phase v is; every rail phase pays the per-phase cost) + combine
in its own order (the delivery rounds back first, one after another; rail phase v back after
round v; the relay back after the last rail phase). Combine's local round back starts with the
first round back and shares both NVLink ports of every GPU with the rounds (out of an expert
GPU: its copies back; into a source GPU: its local records' copies, on a GPU that also takes the
round back of the records that arrived on it; dispatch's local round is over before its first
delivery round: it runs with the relay): where a port has both, a round waits for three
quarters of the overlap (``_COMBINE_LOCAL_SHARE``). The costs (``PathCosts``) are recorded
with the fitted coefficients: on the flow model they are its stated per-call costs
(``NetModelConfig``).

Features (``FEATURE_NAMES``): a constant and log(est_RAIL / est_JOINT). Chosen by leaving
calibration seeds out on the H800 and H20 4 x 8 calibrations (docs/selector.md): the first
path model (payload terms and log ratios of summed rail and delivery loads fitted separately)
put 80 / 33 of 10,304 requests over 1.03x of their best path, the estimate with combine as
dispatch's mirror 31 / 4, with the local round back on the rounds' ports 9 / 0, this one
(copies per arrival GPU and chunk, the exact local round, both ports) 3 / 0 (v3, one mask
class); adding the payload terms to the estimate changed little. v4 (mask classes) is scored in
docs/selector.md.

Cost: numpy over [N, N, G, G, G] arrays (the arrival model) plus a short step per phase in
dispatch and combine (docs/selector.md gives the measured time per layer); part of the planning
time the dispatcher logs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from megatron_railwave import ops
from megatron_railwave.planner import WaveSchedule, all_at_once
from megatron_railwave.planner.railbalance import eligible_NNG
from megatron_railwave.selector.arrivals import arrival_copies_NNCGG
from megatron_railwave.topology import RailTopology
from megatron_railwave.traffic import DemandCounts

__all__ = [
    "FEATURE_NAMES",
    "PathCosts",
    "RailJointModel",
    "path_features",
    "path_estimates",
    "class_copies_NGNKG",
    "fit_rail_joint",
]

FEATURE_NAMES: tuple[str, ...] = ("const", "log_estimate_v4")
"""The suffix versions the estimate: v4 walks each owner's list per mask class (``arrivals``:
copies per target GPU of the records sharing their top two target bits, which the count exchange
carries); v3 took the delivery rounds' copies per arrival GPU and rail chunk from copies per
target alone (one class) and charged combine's local round on both ports of every GPU (v2:
copies spread as 1 - 1/G, local round on the target side only). A calibration or model naming
other features is recomputed or refused."""

_COMBINE_LOCAL_SHARE = 0.75
"""The part of the overlap with combine's local round that a delivery round back waits for on a
GPU port (0: the local round costs the rounds nothing, 1: the port is split evenly between them).
Chosen among 0.5, 0.75 and 1 by leaving calibration seeds out on both clusters (fewest requests
over 1.03x and smallest errors; docs/selector.md, Results)."""

_TINY = 1e-12


@dataclass(frozen=True, kw_only=True, slots=True)
class PathCosts:
    """The fixed costs and JOINT's rail chunks the estimate charges (recorded with the model).

    Attributes:
        rail_phase_s: every rail phase, dispatch and combine (launch, notify, host wait).
        layer_s: once per layer on both paths (the count exchange, RailBalance's steps).
        chunks: JOINT's rail chunks per wave (``PlanOptions.chunks``; RAIL sends whole windows).
    """

    rail_phase_s: float = 30e-6
    layer_s: float = 35e-6
    chunks: int = 1

    def __post_init__(self) -> None:
        for name in ("rail_phase_s", "layer_s"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value < 0
            ):
                raise ValueError(
                    f"PathCosts.{name} must be a finite number of seconds >= 0, got {value!r}"
                )
        if isinstance(self.chunks, bool) or not isinstance(self.chunks, int) or self.chunks < 1:
            raise ValueError(
                f"PathCosts.chunks must be an integer >= 1 (JOINT's rail chunks per wave), "
                f"got {self.chunks!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "rail_phase_s": float(self.rail_phase_s),
            "layer_s": float(self.layer_s),
            "chunks": int(self.chunks),
        }

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "path costs") -> PathCosts:
        """Parse ``to_dict``'s layout; a wrong one raises ValueError naming the field."""
        if not isinstance(data, dict) or set(data) != {"rail_phase_s", "layer_s", "chunks"}:
            raise ValueError(
                f"{source}: must be a mapping with exactly 'rail_phase_s', 'layer_s' and 'chunks', "
                f"got {data!r}"
            )
        try:
            return cls(**data)
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None


def class_copies_NGNKG(demand: DemandCounts) -> np.ndarray:
    """[N_src, G_owner, N_dst, K, G] float64: (record, target GPU) copies owner (s, o) sends to
    GPU j of node d among its records of mask class k (``DemandCounts.class_copies_WNKG``).

    Raises:
        ValueError: a node view gathered without delivery counts.
    """
    copies_WNKG = demand.class_copies_WNKG().to(torch.float64).numpy()
    n, k, g = copies_WNKG.shape[1:]
    return copies_WNKG.reshape(n, g, n, k, g)


@lru_cache(maxsize=32)
def _rail_eligible_NNG(topo: RailTopology) -> torch.Tensor:
    """[N, N, G] bool: RailBalance's default rails of each pair
    (``planner.railbalance.eligible_NNG``:
    every GPU whose rail is healthy on both nodes; local pairs all True, never balanced). Cached:
    it depends on the topology only; never written to."""
    n, g = topo.num_nodes, topo.gpus_per_node
    return eligible_NNG(topo, torch.zeros(n, n, g, dtype=torch.int64))


@lru_cache(maxsize=64)
def _pair_window_NN(sending: WaveSchedule) -> torch.Tensor:
    """[N, N] int64: the sending window of each node pair (``WaveSchedule.pair_wave_NN``). Cached:
    the estimate runs on every layer call, most of them with the same windows (all pairs at
    once); never written to."""
    return sending.pair_wave_NN()


def _eligible_NGN(topo: RailTopology) -> np.ndarray:
    """[N, G, N] float64: 1 where GPU g's rail carries the pair (s, d)'s records (the local pairs'
    entries multiply zero loads)."""
    return _rail_eligible_NNG(topo).numpy().transpose(0, 2, 1).astype(np.float64)


@dataclass(frozen=True, slots=True)
class _Loads:
    """What every phase's port loads are computed from (module docstring)."""

    per_rail_NN: np.ndarray
    """Remote records of each node pair per healthy rail (0 on the diagonal)."""
    relay_out_NG: np.ndarray
    """Records GPU (s, g) relays out: its remote records above each pair's even share over the
    pair's healthy rails, summed over the destination nodes."""
    relay_in_NG: np.ndarray
    """Records it relays in: those below the share, summed the same way."""
    local_out_NG: np.ndarray
    """The local round's copies on the wire out of each source GPU (dispatch)."""
    local_in_NG: np.ndarray
    """The local round's copies on the wire into each target GPU (dispatch)."""
    wire_NNCGG: np.ndarray
    """[s, d, chunk, arrival l, target j]: expected copies from node s that arrive on GPU (d, l)
    in each rail chunk and cross NVLink to GPU (d, j) (``arrivals``; zero where l == j)."""
    record_bytes: int
    topo: RailTopology

    @classmethod
    def of(
        cls,
        records_NGN: np.ndarray,
        class_copies_NGNKG: np.ndarray,
        *,
        record_bytes: int,
        topo: RailTopology,
        chunks: int,
    ) -> _Loads:
        n, g = records_NGN.shape[0], records_NGN.shape[1]
        remote_NGN = records_NGN * (1.0 - np.eye(n))[:, None, :]  # local records never cross a rail
        pair_NN = remote_NGN.sum(axis=1)
        eligible_NGN = _eligible_NGN(topo)
        healthy_NN = np.maximum(eligible_NGN.sum(axis=1), 1.0)
        # The even share over the pair's healthy rails: a GPU on a failed rail relays all out.
        share_NGN = pair_NN[:, None, :] * eligible_NGN / healthy_NN[:, None, :]
        # The local round: owner (d, o) to GPU (d, j), exact; a copy for the owner itself stays.
        copies_NGNG = class_copies_NGNKG.sum(axis=3)  # counts: exact in any order
        local_NGG = copies_NGNG[np.arange(n), :, np.arange(n), :] * (1.0 - np.eye(g))
        wire = arrival_copies_NNCGG(records_NGN, class_copies_NGNKG, topo, chunks) * (
            1.0 - np.eye(g)
        )
        return cls(
            per_rail_NN=pair_NN / healthy_NN,
            relay_out_NG=np.maximum(remote_NGN - share_NGN, 0.0).sum(axis=2),
            relay_in_NG=np.maximum(share_NGN - remote_NGN, 0.0).sum(axis=2),
            local_out_NG=local_NGG.sum(axis=2),
            local_in_NG=local_NGG.sum(axis=1),
            wire_NNCGG=wire,
            record_bytes=record_bytes,
            topo=topo,
        )

    def _nvlink_s(self, copies: Any) -> Any:
        return copies * self.record_bytes / self.topo.nvlink_bytes_per_s

    def _rail_s(self, records: Any) -> Any:
        return records * self.record_bytes / self.topo.rail_bytes_per_s

    def windows(self, mask_PNN: np.ndarray) -> _Rounds:
        """Phases given as node-pair masks (RAIL's windows, whole): one round each."""
        sent_PNN = mask_PNN * self.per_rail_NN
        # A phase's busiest rail port: max over nodes of records sent or received per rail.
        busiest_P = np.maximum(
            sent_PNN.sum(axis=2).max(axis=1, initial=0.0),
            sent_PNN.sum(axis=1).max(axis=1, initial=0.0),
        )
        wire_PDLJ = np.einsum("psd,sdlj->pdlj", mask_PNN, self.wire_NNCGG.sum(axis=2))
        return _Rounds.of(self._rail_s(busiest_P), self._nvlink_s(wire_PDLJ))

    def cyclic(self) -> _Rounds:
        """JOINT's cyclic waves k = 1 .. N - 1 (node s to s + k mod N), each in its rail chunks:
        each node sends one pair and receives one, so a wave's rail ports are the pairs' own
        loads, split evenly over the chunks."""
        n, chunks = self.per_rail_NN.shape[0], self.wire_NNCGG.shape[2]
        dst_N = np.arange(n)
        src_PN = (dst_N[None, :] - np.arange(1, n)[:, None]) % n  # row d of wave k: node d's sender
        rail_P = np.repeat(
            self.per_rail_NN[src_PN, dst_N].max(axis=1, initial=0.0) / chunks, chunks
        )
        wire_PCDLJ = self.wire_NNCGG[src_PN, dst_N].transpose(
            0, 2, 1, 3, 4
        )  # [wave, chunk, d, l, j]
        return _Rounds.of(
            self._rail_s(rail_P), self._nvlink_s(wire_PCDLJ.reshape((-1,) + wire_PCDLJ.shape[2:]))
        )

    def local_round(self) -> tuple[np.ndarray, np.ndarray]:
        """([N, G] seconds out of each source GPU, [N, G] into each target GPU) of the local
        round."""
        return self._nvlink_s(self.local_out_NG), self._nvlink_s(self.local_in_NG)

    def relay_seconds(self) -> float:
        """The relay alone: its busiest GPU port (combine's relay back, after the last rail
        phase)."""
        return float(
            self._nvlink_s(
                max(self.relay_out_NG.max(initial=0.0), self.relay_in_NG.max(initial=0.0))
            )
        )

    def before_rail_seconds(self) -> float:
        """The relay and the local round together (they start at once and share the NVLink
        ports; the first rail phase waits for the relay): the busiest GPU port's load."""
        return float(
            self._nvlink_s(
                max(
                    (self.relay_out_NG + self.local_out_NG).max(initial=0.0),
                    (self.relay_in_NG + self.local_in_NG).max(initial=0.0),
                )
            )
        )


@dataclass(frozen=True, slots=True)
class _Rounds:
    """A path's rail phases and their delivery rounds (seconds)."""

    rail_P: np.ndarray
    """[P] each rail phase's busiest rail port."""
    into_PNG: np.ndarray
    """[P, N, G] seconds of each round's copies into each target GPU (dispatch; out of it in
    combine)."""
    out_PNG: np.ndarray
    """[P, N, G] seconds of each round's copies out of each arrival GPU (dispatch; into it in
    combine)."""
    busiest_P: np.ndarray
    """[P] each round's busiest GPU port."""

    @classmethod
    def of(cls, rail_P: np.ndarray, wire_PNLJ: np.ndarray) -> _Rounds:
        into, out = wire_PNLJ.sum(axis=2), wire_PNLJ.sum(axis=3)
        busiest = np.maximum(into.max(axis=(1, 2), initial=0.0), out.max(axis=(1, 2), initial=0.0))
        return cls(rail_P=rail_P, into_PNG=into, out_PNG=out, busiest_P=busiest)


def _dispatch_seconds(rail_P: np.ndarray, delivery_P: np.ndarray, phase_s: float) -> float:
    """Dispatch's rail phases and delivery rounds (``delivery_P``: each round's busiest GPU) as
    the schedule orders them: rail phase v + 1 after rail phase v (each paying ``phase_s``),
    delivery round v after rail phase v and round v - 1."""
    rail_end = delivery_end = 0.0
    for rail_s, delivery_s in zip(rail_P.tolist(), delivery_P.tolist()):
        rail_end += phase_s + rail_s
        delivery_end = max(rail_end, delivery_end) + delivery_s
    return delivery_end


def _combine_seconds(
    rounds: _Rounds,
    local_out_NG: np.ndarray,
    local_in_NG: np.ndarray,
    phase_s: float,
    relay_s: float,
) -> float:
    """Combine in the schedule's order: the delivery rounds back one after another from the
    start, rail phase v after round v and rail phase v - 1 (paying ``phase_s``), the relay back
    after the last rail phase. The local round back starts with the first round and shares both
    NVLink ports of every GPU with the rounds (out of the expert GPU: the round's copies back
    and its local copies back; into the arrival GPU: the round's copies and, on a source GPU,
    its local records' copies): where a port has both, a round is slowed by
    ``_COMBINE_LOCAL_SHARE`` of the overlap, and the local round runs alone between the port's
    round end and the round's end (once it is done, a round takes its busiest port). Ends with
    the later of the relay and the local round."""
    # Combine runs dispatch backwards: the local round back leaves the target GPUs (dispatch's
    # in-ports) and enters the source GPUs (dispatch's out-ports); the rounds likewise.
    left = [np.array(local_in_NG, dtype=np.float64), np.array(local_out_NG, dtype=np.float64)]
    busiest = rounds.busiest_P.tolist()
    round_end = rail_end = 0.0
    for v, rail_s in enumerate(rounds.rail_P.tolist()):
        if any(part.any() for part in left):  # the local round still runs somewhere: per port
            ports = (rounds.into_PNG[v], rounds.out_PNG[v])
            slowed = [
                _COMBINE_LOCAL_SHARE * np.minimum(port, rest) for port, rest in zip(ports, left)
            ]
            ends = [round_end + port + slow for port, slow in zip(ports, slowed)]
            end = max(float(e.max(initial=round_end)) for e in ends)
            left = [
                np.maximum(rest - slow - (end - e), 0.0)
                for rest, slow, e in zip(left, slowed, ends)
            ]
            round_end = end
        else:
            round_end += busiest[v]
        rail_end = max(rail_end, round_end) + phase_s + rail_s
    return max(rail_end + relay_s, round_end + max(float(part.max(initial=0.0)) for part in left))


def path_estimates(
    demand: DemandCounts,
    topo: RailTopology,
    *,
    record_bytes: int,
    windows: WaveSchedule | None = None,
    costs: PathCosts = PathCosts(),
) -> tuple[float, float]:
    """(RAIL, JOINT) estimated seconds of one layer's dispatch + combine (module docstring),
    identical on every rank.

    Args:
        demand: the gathered global counts (``records_WN`` plus delivery counts,
            ``class_copies_NGNKG``).
        record_bytes: payload bytes of one record (hidden x element size).
        windows: the input's sending windows (replay arrangements), kept by RAIL; None = all
            pairs at once.
        costs: the fixed costs and JOINT's rail chunks.
    """
    sending = windows if windows is not None else all_at_once(topo.num_nodes)
    compiled = ops.path_estimates(
        demand.records_WN,
        demand.class_copies_WNKG(),
        _rail_eligible_NNG(topo),
        _pair_window_NN(sending),
        num_windows=sending.num_waves,
        chunks=costs.chunks,
        record_bytes=record_bytes,
        nvlink_bytes_per_s=topo.nvlink_bytes_per_s,
        rail_bytes_per_s=topo.rail_bytes_per_s,
        rail_phase_s=costs.rail_phase_s,
        layer_s=costs.layer_s,
        combine_share=_COMBINE_LOCAL_SHARE,
    )
    if compiled is not None:
        rail_s, joint_s = compiled.tolist()
        return rail_s, joint_s
    return _estimates(
        demand.records_NGN().to(torch.float64).numpy(),
        class_copies_NGNKG(demand),
        sending,
        topo,
        record_bytes=record_bytes,
        costs=costs,
    )


def _estimates(
    records_NGN: np.ndarray,
    class_copies_NGNKG: np.ndarray,
    sending: WaveSchedule,
    topo: RailTopology,
    *,
    record_bytes: int,
    costs: PathCosts,
) -> tuple[float, float]:
    """``path_estimates`` in numpy: the meaning its compiled twin (``ops.path_estimates``)
    reproduces."""
    loads = _Loads.of(
        records_NGN, class_copies_NGNKG, record_bytes=record_bytes, topo=topo, chunks=costs.chunks
    )
    window_NN = sending.pair_wave_NN().numpy()
    rail_path = loads.windows(
        (window_NN[None] == np.arange(sending.num_waves)[:, None, None]).astype(np.float64)
    )
    before_rail, relay = loads.before_rail_seconds(), loads.relay_seconds()
    local_out, local_in = loads.local_round()

    def seconds(rounds: _Rounds) -> float:
        return (
            costs.layer_s
            + before_rail
            + _dispatch_seconds(rounds.rail_P, rounds.busiest_P, costs.rail_phase_s)
            + _combine_seconds(rounds, local_out, local_in, costs.rail_phase_s, relay)
        )

    return seconds(rail_path), seconds(loads.cyclic())


def path_features(
    demand: DemandCounts,
    topo: RailTopology,
    *,
    record_bytes: int,
    windows: WaveSchedule | None = None,
    costs: PathCosts = PathCosts(),
) -> np.ndarray:
    """[F] float64: the model's features of one layer (``FEATURE_NAMES``; arguments as
    ``path_estimates``)."""
    est_rail, est_joint = path_estimates(
        demand, topo, record_bytes=record_bytes, windows=windows, costs=costs
    )
    return np.array([1.0, math.log(max(est_rail, _TINY) / max(est_joint, _TINY))])


_GATE_FIELDS = ("max_payload_bytes", "max_payload_bytes_windowed")
"""``RailJointModel``'s payload gates: inputs sent all node pairs at once, inputs in windows."""


def _check_gate(name: str, gate: Any) -> None:
    if gate is not None and (
        isinstance(gate, bool)
        or not isinstance(gate, (int, float))
        or not math.isfinite(gate)
        or gate < 0
    ):
        raise ValueError(
            f"RailJointModel.{name} must be a finite number of bytes >= 0 or None, got {gate!r}"
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class RailJointModel:
    """Predicted ``log(t_RAIL / t_JOINT)`` = features . coef, one ``coef`` per input kind.

    Attributes:
        all_pairs: [F] coefficients for inputs sent all node pairs at once (a training step).
        windowed: [F] coefficients for inputs in several sending windows (replay arrangements);
            None: none were calibrated (such inputs then run JOINT).
        costs: the fixed costs and rail chunks the features were computed with.
        max_payload_bytes: the payload gate for inputs sent all node pairs at once: the model
            decides only layers whose mean remote payload per GPU (``TrafficStats.B_mean_bytes``)
            is at most this, every larger layer runs JOINT without an estimate (its decision costs
            more than it can earn there: calibration found JOINT within the tolerance of the best
            path on every request above it, ``calibration.payload_gate``). None: every layer of
            that kind is decided.
        max_payload_bytes_windowed: the same gate for inputs in several sending windows (the
            calibration fits the gates per kind where that scores as well leaving seeds out:
            ``calibration.tune_selector``).
    """

    all_pairs: tuple[float, ...]
    windowed: tuple[float, ...] | None = None
    costs: PathCosts = PathCosts()
    max_payload_bytes: float | None = None
    max_payload_bytes_windowed: float | None = None

    def __post_init__(self) -> None:
        for name in _GATE_FIELDS:
            _check_gate(name, getattr(self, name))

    def gate(self, *, input_windows: int) -> float | None:
        """The payload gate of this input kind (None: no gate)."""
        return self.max_payload_bytes if input_windows == 1 else self.max_payload_bytes_windowed

    def decides(self, payload_bytes: float, *, input_windows: int) -> bool:
        """Whether a layer of this input kind with this mean remote payload per GPU is decided by
        the model (inside its payload gate) rather than run as JOINT."""
        gate = self.gate(input_windows=input_windows)
        return gate is None or payload_bytes <= gate

    def log_ratio(self, features: np.ndarray, *, input_windows: int = 1) -> float | None:
        """The prediction, None when no coefficients cover this input kind."""
        coef = self.all_pairs if input_windows == 1 else self.windowed
        return None if coef is None else float(np.dot(features, coef))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "target": "log(t_rail / t_joint)",
            "features": list(FEATURE_NAMES),
            "costs": self.costs.to_dict(),
            "all_pairs": [float(v) for v in self.all_pairs],
        }
        if self.windowed is not None:
            out["windowed"] = [float(v) for v in self.windowed]
        if self.max_payload_bytes is not None or self.max_payload_bytes_windowed is not None:
            # Both keys once there is a gate: a file with the first alone (written before the gates
            # per kind) gates every input kind with it (from_dict).
            for name in _GATE_FIELDS:
                value = getattr(self, name)
                out[name] = None if value is None else float(value)
        return out

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "path model") -> RailJointModel:
        """Parse ``to_dict``'s layout; a wrong one raises ValueError naming the field."""
        if not isinstance(data, dict):
            raise ValueError(f"{source}: must be a mapping, got {type(data).__name__}")
        if data.get("features") != list(FEATURE_NAMES):
            raise ValueError(
                f"{source}: field 'features' must be {list(FEATURE_NAMES)} (this version's "
                f"features), "
                f"got {data.get('features')!r}; re-run `railwave calibrate --retune`"
            )
        costs = PathCosts.from_dict(data.get("costs"), source=f"{source}: field 'costs'")

        def coef(key: str) -> tuple[float, ...] | None:
            raw = data.get(key)
            if raw is None and key == "windowed":
                return None
            if (
                not isinstance(raw, list)
                or len(raw) != len(FEATURE_NAMES)
                or any(
                    isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                    for v in raw
                )
            ):
                raise ValueError(
                    f"{source}: field '{key}' must be a list of {len(FEATURE_NAMES)} finite "
                    f"numbers, "
                    f"got {raw!r}"
                )
            return tuple(float(v) for v in raw)

        for name in _GATE_FIELDS:
            if name in data:
                try:
                    _check_gate(name, data[name])
                except ValueError as exc:
                    raise ValueError(f"{source}: field '{name}': {exc}") from None
        # Files from before the gates per kind have one gate for every input kind.
        windowed_gate = data.get("max_payload_bytes_windowed", data.get("max_payload_bytes"))
        return cls(
            all_pairs=coef("all_pairs"),
            windowed=coef("windowed"),
            costs=costs,  # type: ignore[arg-type]
            max_payload_bytes=data.get("max_payload_bytes"),
            max_payload_bytes_windowed=windowed_gate,
        )


def fit_rail_joint(
    features_RF: np.ndarray,
    windows_R: np.ndarray,
    log_ratio_R: np.ndarray,
    *,
    costs: PathCosts = PathCosts(),
) -> RailJointModel | None:
    """Least squares per input kind (all pairs at once / several windows); None without
    all-pairs requests. A kind with fewer requests than features gets no coefficients.
    ``costs``: what the features were computed with (recorded in the model)."""
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
    return RailJointModel(all_pairs=coefs["all_pairs"], windowed=coefs["windowed"], costs=costs)
