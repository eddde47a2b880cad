"""Wave schedules: cyclic permutation, bounded fan-in, sending windows and their validation."""

from __future__ import annotations

import pytest

from megatron_railwave.planner import (
    WaveSchedule,
    all_at_once,
    bounded_fanin_schedule,
    cyclic_schedule,
    schedule_from_windows,
)


def test_cyclic_schedule_four_nodes():
    # wave k (k = 1..3): s -> (s + k) mod 4
    sched = cyclic_schedule(4)
    assert sched.to_list() == [
        [[0, 1], [1, 2], [2, 3], [3, 0]],
        [[0, 2], [1, 3], [2, 0], [3, 1]],
        [[0, 3], [1, 0], [2, 1], [3, 2]],
    ]
    assert sched.kind == "cyclic" and sched.max_fanin() == 1
    assert sched.pair_wave_NN().tolist() == [
        [-1, 0, 1, 2],
        [2, -1, 0, 1],
        [1, 2, -1, 0],
        [0, 1, 2, -1],
    ]


def test_bounded_fanin_groups_consecutive_shifts():
    # 5 nodes, f = 2: wave 0 holds shifts 1, 2; wave 1 holds shifts 3, 4.
    sched = bounded_fanin_schedule(5, 2)
    assert sched.num_waves == 2 and sched.max_fanin() == 2 and sched.kind == "fanin2"
    assert sorted(sched.waves[0]) == sorted([(s, (s + k) % 5) for k in (1, 2) for s in range(5)])
    # f = 3 on 5 nodes: shifts {1, 2, 3} and {4}: ceil(4 / 3) = 2 waves
    assert [len(w) for w in bounded_fanin_schedule(5, 3).waves] == [15, 5]
    # f >= N - 1: one wave with every pair
    assert bounded_fanin_schedule(4, 7).num_waves == 1


def test_bounded_fanin_rejects_zero():
    with pytest.raises(ValueError, match=r"fan-in must be >= 1, got 0"):
        bounded_fanin_schedule(4, 0)


def test_single_node_has_no_waves():
    assert cyclic_schedule(1).num_waves == 0 and all_at_once(1).num_waves == 0
    assert cyclic_schedule(1).pair_wave_NN().tolist() == [[-1]]


def test_all_at_once_one_window_fanin_n_minus_1():
    sched = all_at_once(4)
    assert sched.num_waves == 1 and len(sched.waves[0]) == 12 and sched.max_fanin() == 3


def test_schedules_are_cached_and_pair_wave_is_a_copy():
    assert cyclic_schedule(8) is cyclic_schedule(8)
    table = cyclic_schedule(8).pair_wave_NN()
    table.fill_(7)  # must not corrupt the cached table
    assert cyclic_schedule(8).pair_wave_NN()[0, 1] == 0


def test_schedule_from_windows_drops_empty_windows():
    sched = schedule_from_windows(3, [[(0, 1), (1, 2), (2, 0)], [], [[0, 2], [1, 0], [2, 1]]])
    assert sched.num_waves == 2 and sched.kind == "windows"


@pytest.mark.parametrize(
    ("waves", "match"),
    [
        ((((0, 0),),), r"wave 0: pair \(0, 0\) is not a remote pair of 2 nodes"),
        ((((0, 2),),), r"wave 0: pair \(0, 2\) is not a remote pair"),
        ((((0, 1), (1, 0)), ((0, 1),)), r"pair \(0, 1\) appears in more than one wave"),
        ((((0, 1),),), r"schedule covers 1 of the 2 remote node pairs"),
    ],
)
def test_wave_schedule_validation(waves, match):
    with pytest.raises(ValueError, match=match):
        WaveSchedule(num_nodes=2, waves=waves)
