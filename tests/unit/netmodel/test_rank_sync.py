"""Per-rank phase dependencies (``NetModelConfig.phase_sync='rank'``, `program.rank_synced`):
hand-worked times where one rank's next phase starts before another rank's current phase is
done, the receiver gating a transfer as much as the sender, the ranks' program order, the
equivalence with the global model when every rank is ready at once, and the size limit.

1 GB/s rails (8 Gbit/s), 1 MB records, no fixed costs, no incast, exact engine (rel_tol = 0).
"""

from dataclasses import replace

import numpy as np
import pytest
import torch

from megatron_railwave.lab.netmodel import NetModelConfig, execute_plan
from megatron_railwave.lab.netmodel.execute import fabric_for
from megatron_railwave.lab.netmodel.program import (
    ProgramBuilder,
    phase_times,
    rank_synced,
    run_program,
)
from megatron_railwave.planner import PlanOptions, build_plan, schedule_from_windows
from megatron_railwave.topology import RailTopology
from megatron_railwave.traffic import DemandCounts

MB = 1e6
PLAIN = NetModelConfig(
    alpha=0.0,
    k_sat=None,
    wave_latency_s=0.0,
    count_exchange_s=0.0,
    railbalance_barrier_s=0.0,
    railbalance_quota_s=0.0,
    num_experts=1,
    rel_tol=0.0,
)
RANK = replace(PLAIN, phase_sync="rank")


def approx(value, rel=1e-9):
    return pytest.approx(value, rel=rel)


def _windowed(pairs_MB: dict[tuple[int, int], int], windows: list[list[tuple[int, int]]]):
    """4 nodes x 1 GPU (rank = node, one rail, no NVLink stage): ``pairs_MB[(s, d)]`` records of
    1 MB from s to d, NATIVE in the given sending windows (the pairs without records are added
    to the last window: a schedule lists every pair)."""
    topo = RailTopology(num_nodes=4, gpus_per_node=1, rail_gbps=8.0, nvlink_gBps=2.0)
    listed = {p for win in windows for p in win}
    windows = windows[:-1] + [
        windows[-1]
        + [(s, d) for s in range(4) for d in range(4) if s != d and (s, d) not in listed]
    ]
    rec = torch.zeros(4, 4, 2, dtype=torch.int64)
    for (s, d), c in pairs_MB.items():
        rec[s, d, 1] = c
    demand = DemandCounts(records_WNM=rec, experts_WE=torch.zeros(4, 4, dtype=torch.int64))
    plan = build_plan(
        demand, topo, "native", options=PlanOptions(windows=schedule_from_windows(4, windows))
    )
    return plan, demand


def _run(plan, demand, model):
    # 1 MB payload rows: combine rows are the payload only, dispatch rows carry 16 more bytes.
    return execute_plan(plan, record_bytes=int(MB), model=model, demand=demand)


def test_a_rank_starts_its_next_window_while_others_are_in_the_current_one():
    # Window 0: 0->1 3 MB, 2->3 1 MB. Window 1: 3->2 3 MB, 2->1 2 MB (all on distinct NIC ports).
    # Global: window 0 ends at 3 ms for everyone, window 1 takes 3 ms: dispatch 6 ms.
    # Rank: ranks 2 and 3 are done with window 0 at 1 ms, so 3->2 runs 1..4 ms; 2->1 needs its
    # receiver, rank 1, which is busy in window 0 until 3 ms: 3..5 ms (sender-only gating would
    # give 1..3 ms). Dispatch 5 ms.
    # Combine (exchange order crail[0], crail[1]; each rank after its own dispatch): crail[0] is
    # 1->0 3 MB (ranks 0 and 1 done at 3 and 5 ms: 5..8) and 3->2 1 MB (rank 3 done at 4 ms, rank
    # 2 at 5 ms: 5..6); crail[1] is 2->3 3 MB (both done with crail[0] at 6 ms: 6..9) and 1->2
    # 2 MB (rank 1 done with crail[0] at 8 ms: 8..10). Total 10 ms, combine 5 ms.
    # Global combine: 3 ms + 3 ms after dispatch's 6 ms: 12 ms.
    plan, demand = _windowed(
        {(0, 1): 3, (2, 3): 1, (3, 2): 3, (2, 1): 2}, [[(0, 1), (2, 3)], [(3, 2), (2, 1)]]
    )
    glob = _run(plan, demand, PLAIN)
    assert glob.dispatch_s == approx(6e-3, rel=1e-4) and glob.total_s == approx(12e-3, rel=1e-4)
    rank = _run(plan, demand, RANK)
    assert rank.dispatch_s == approx(5e-3, rel=1e-4)
    assert rank.combine_s == approx(5e-3, rel=1e-4)
    # Per wave: from the earliest rank ready (0 ms; 1 ms for window 1) to the last transfer.
    assert rank.rail_s_V == approx((3e-3, 4e-3), rel=1e-4)
    assert rank.total_s >= rank.bound_s and rank.combine_s >= rank.bound_combine_s


def test_exact_times_with_exact_bytes():
    # The same case, to the byte: dispatch rows are 1e6 + 16 bytes (payload, fp32 prob, 3 int32
    # metadata words), combine rows 1e6 (1 GB/s rails). Dispatch ends at 5 dispatch rows' time
    # (window 0's 3 then 2->1's 2), combine at 5 combine rows after that.
    plan, demand = _windowed(
        {(0, 1): 3, (2, 3): 1, (3, 2): 3, (2, 1): 2}, [[(0, 1), (2, 3)], [(3, 2), (2, 1)]]
    )
    rank = _run(plan, demand, RANK)
    row_d, row_c = (MB + 16) / 1e9, MB / 1e9
    assert rank.dispatch_s == approx(5 * row_d)
    # Combine: 1->0 (3 rows) from 5 row_d, then 1->2 (2 rows) once rank 1 is done with it.
    assert rank.total_s == approx(5 * row_d + 5 * row_c)
    # Bounds: rank 1 receives 5 MB in dispatch and sends them back in combine, and its combine
    # cannot start before its dispatch is done: 5 row_d + 5 row_c (tight here). The least any
    # rank's combine needs: 3 rows (ranks 0, 2, 3).
    assert rank.bound_s == approx(5 * row_d + 5 * row_c)
    assert rank.bound_combine_s == approx(3 * row_c) and rank.bound_dispatch_s == approx(5 * row_d)


def test_rank_equals_global_when_every_rank_is_ready_at_once():
    # A rail-aligned all-to-all over cyclic waves: every rank has one send and one receive of
    # the same size in every wave, so each rank's part of a wave ends with everyone's.
    topo = RailTopology(num_nodes=4, gpus_per_node=2, rail_gbps=8.0, nvlink_gBps=2.0)
    rec = torch.zeros(8, 4, 4, dtype=torch.int64)
    for w in range(8):
        for d in range(4):
            if d != w // 2:
                rec[w, d, 1 << (w % 2)] = 1
    demand = DemandCounts(records_WNM=rec, experts_WE=torch.zeros(8, 8, dtype=torch.int64))
    for path in ("native", "joint"):
        plan = build_plan(demand, topo, path)
        glob, rank = (
            _run(plan, demand, replace(PLAIN, wave_latency_s=1e-5)),
            _run(plan, demand, replace(RANK, wave_latency_s=1e-5)),
        )
        assert rank.dispatch_s == approx(glob.dispatch_s) and rank.total_s == approx(glob.total_s)
        assert rank.rail_s_V == approx(glob.rail_s_V)


def test_program_order_holds_back_a_later_phase():
    # Rank 0 sends in three phases over its one NIC (1 GB/s): A 0->1 3 MB; C 0->3 1 MB after A;
    # B 0->2 1 MB with no dependency. Posted in the order A, C, B (as a rank program does), B
    # waits for C's post, i.e. for rank 0's part of A: A alone 0..3 ms, then B and C share the
    # NIC, 1 MB each at 0.5 GB/s: both 3..5 ms. Without the order B starts at once: A and B
    # share the NIC until B ends at 2 ms, A ends at 4 ms, C 4..5 ms.
    topo = RailTopology(num_nodes=4, gpus_per_node=1, rail_gbps=8.0, nvlink_gBps=2.0)
    fabric = fabric_for(topo, 32, 1.0)
    b = ProgramBuilder(fabric=fabric)
    a = b.phase("A", "rail", 0)
    c = b.phase("C", "rail", 0, (a,))
    bb = b.phase("B", "rail", 0)
    for phase, dst, size in ((a, 1, 3 * MB), (c, 3, MB), (bb, 2, MB)):
        b.rail(phase, np.array([0]), np.array([dst]), np.array([size]))
    program = b.build()
    times = {}
    for label, order in (("ordered", (a, c, bb)), ("free", ())):
        split = rank_synced(program, num_ranks=4, post_order=order)
        run = run_program(fabric, split, incast=PLAIN.incast(), rel_tol=0.0)
        at = {name: q for q, name in enumerate(split.names)}
        times[label] = {
            name: (run.result.phase_start_s_Q[at[name]], run.result.phase_finish_s_Q[at[name]])
            for name in ("A[0->1]", "B[0->2]", "C[0->3]")
        }
        assert run.total_s == approx(5e-3)
        # Phases of the program outside the split: its own phases' times (earliest rank, last part).
        start, finish = phase_times(split, run.result)
        assert finish[bb] == approx(times[label]["B[0->2]"][1]) and start[bb] == 0.0
    assert times["ordered"] == {
        "A[0->1]": approx((0.0, 3e-3)),
        "B[0->2]": approx((3e-3, 5e-3)),
        "C[0->3]": approx((3e-3, 5e-3)),
    }
    assert times["free"] == {
        "A[0->1]": approx((0.0, 4e-3)),
        "B[0->2]": approx((0.0, 2e-3)),
        "C[0->3]": approx((4e-3, 5e-3)),
    }


def test_rank_sync_refuses_large_clusters_and_bad_values():
    plan, demand = _windowed({(0, 1): 1}, [[(0, 1)]])
    with pytest.raises(ValueError, match=r"4 ranks is above rank_sync_max_ranks=2"):
        _run(plan, demand, replace(RANK, rank_sync_max_ranks=2))
    with pytest.raises(
        ValueError, match=r"NetModelConfig.phase_sync must be 'global' or 'rank', got 'node'"
    ):
        NetModelConfig(phase_sync="node")
    with pytest.raises(ValueError, match=r"rank_sync_max_ranks must be an int >= 1, got 0"):
        NetModelConfig(rank_sync_max_ranks=0)
