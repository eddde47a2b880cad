"""Multi-process gloo tests of the exchange: every path matches a dense reference and the four
paths are bitwise identical to each other (outputs and gradients)."""

from __future__ import annotations

import pytest
import torch

from megatron_railwave.names import ROUTES
from tests.helpers.dist import DistributedRankError, run_distributed
from tests.helpers.exchange_worker import run_bad_input, run_exchange

PATHS = list(map(str, ROUTES))


def _check(results, rtol=1e-5):
    for rank, res in enumerate(results):
        for path, counted in res["wire"].items():
            # What the transport really handed to gloo, per phase, equals the schedule's bytes.
            assert counted["measured"] == counted["schedule"], (rank, path, counted)
        ref_out, ref_gx, ref_gp = map(torch.from_numpy, res["ref"])
        base = [torch.from_numpy(a) for a in res["paths"]["native"]]
        for path, arrays in res["paths"].items():
            out, gx, gp = map(torch.from_numpy, arrays)
            torch.testing.assert_close(
                out, ref_out, rtol=rtol, atol=1e-6, msg=f"rank {rank} {path} out"
            )
            torch.testing.assert_close(
                gx, ref_gx, rtol=rtol, atol=1e-6, msg=f"rank {rank} {path} dx"
            )
            torch.testing.assert_close(
                gp, ref_gp, rtol=rtol, atol=1e-5, msg=f"rank {rank} {path} dp"
            )
            assert (
                torch.equal(out, base[0]) and torch.equal(gx, base[1]) and torch.equal(gp, base[2])
            ), f"rank {rank}: path {path} is not bitwise equal to native"


@pytest.mark.parametrize(
    "topo,kw",
    [
        (
            dict(num_nodes=2, gpus_per_node=2),
            dict(tokens=[24] * 4, experts=8, topk=3, hidden=8, seed=1),
        ),
        # 4 nodes x 2 GPUs, uneven token counts, a rank with zero tokens, ranks skipping nodes.
        # Also with point-to-point phases only (no flat all-to-alls on gloo): bitwise the same.
        (
            dict(num_nodes=4, gpus_per_node=2),
            dict(
                tokens=[20, 0, 33, 7, 16, 25, 1, 12],
                experts=16,
                topk=4,
                hidden=8,
                seed=2,
                skip_nodes={2: [1, 3], 5: [0], 7: [2, 3, 1]},
                point_to_point_too=True,
            ),
        ),
        # A failed rail: node 1 rail 0 down; everything leaves node 1 (and enters it) on rail 1.
        (
            dict(num_nodes=4, gpus_per_node=2, failed_rails=frozenset({(1, 0)})),
            dict(tokens=[18] * 8, experts=16, topk=4, hidden=8, seed=3),
        ),
        # Rail chunks: PERM / JOINT send each wave in 3 parts (9 rail phases), with the failed rail.
        (
            dict(num_nodes=4, gpus_per_node=2, failed_rails=frozenset({(1, 0)})),
            dict(
                tokens=[18, 5, 30, 0, 11, 18, 27, 9], experts=16, topk=4, hidden=8, seed=4, chunks=3
            ),
        ),
        # Streamed relay: relay part u moves what rail phase u sends (RAIL / FLOW over 3 chunks,
        # PERM / JOINT / FLOW_WAVES over 9 rail phases), with the failed rail and an empty rank.
        (
            dict(num_nodes=4, gpus_per_node=2, failed_rails=frozenset({(1, 0)})),
            dict(
                tokens=[18, 5, 30, 0, 11, 18, 27, 9],
                experts=16,
                topk=4,
                hidden=8,
                seed=4,
                chunks=3,
                streamed=True,
            ),
        ),
    ],
    ids=["2x2", "4x2-uneven", "4x2-failed-rail", "4x2-failed-rail-chunks3", "4x2-streamed"],
)
def test_exchange_paths_match_reference_and_each_other(topo, kw):
    results = run_distributed(
        run_exchange, topo["num_nodes"] * topo["gpus_per_node"], topo, PATHS, kw, timeout_s=240
    )
    _check(results)
    if kw.get("point_to_point_too"):
        assert {f"{p}/p2p" for p in PATHS} <= set(results[0]["paths"])
        for res in results:
            # NATIVE (one wave): in dispatch, combine and both backwards, the rail phase and the
            # two delivery rounds (independent in the schedule, so joined) ran as one all-to-all
            # each (2 x 4), plus the count exchange; with the flat collectives off only the count
            # exchange is an all-to-all.
            assert (
                res["all_to_all_calls"]["native"] == 9
                and res["all_to_all_calls"]["native/p2p"] == 1
            )
    if topo.get("failed_rails") and not kw.get("chunks"):
        for rank, res in enumerate(results):
            # Rail 0 failed on node 1: the rail-0 group's phase stays point-to-point (an all-to-all
            # would reach the member whose NIC is down); NATIVE's 4 x 2 delivery rounds and the
            # count exchange remain all-to-alls there (each direction's two joined into one),
            # rail 1 also moves its rail phase as one.
            assert res["all_to_all_calls"]["native"] == (5 if rank % 2 == 0 else 9), (
                rank,
                res["all_to_all_calls"],
            )


def test_exchange_bad_routing_map_raises_on_every_rank():
    with pytest.raises(DistributedRankError, match="malformed dispatcher input on EP rank"):
        run_distributed(run_bad_input, 4, dict(num_nodes=2, gpus_per_node=2), timeout_s=120)


def test_fixed_capacity_on_gloo_equals_normal_mode_without_host_sync():
    """max_tokens_per_rank on 4 gloo ranks (uneven T, a rank with none): outputs and gradients
    bitwise equal to the normal mode, no host sync in the forward, bytes = capacity schedule."""
    from tests.helpers.exchange_worker import run_fixed_capacity

    kw = dict(tokens=[20, 0, 13, 7], experts=8, topk=3, hidden=8, seed=5)
    results = run_distributed(
        run_fixed_capacity, 4, dict(num_nodes=2, gpus_per_node=2), "joint", 24, kw, timeout_s=240
    )
    for rank, res in enumerate(results):
        normal, fixed = res["normal"], res["fixed"]
        assert fixed["syncs"] == 0 and normal["syncs"] == 1, (rank, fixed["syncs"], normal["syncs"])
        assert fixed["tokens_per_expert"] == normal["tokens_per_expert"], rank
        for want, got, name in zip(normal["arrays"], fixed["arrays"], ("out", "dx", "dp")):
            assert torch.equal(torch.from_numpy(got), torch.from_numpy(want)), (rank, name)
        measured, scheduled = fixed["wire"]
        assert measured == scheduled, (rank, measured, scheduled)


@pytest.mark.parametrize("overflow_rank", [1, 0])
def test_fixed_capacity_overflow_named_on_every_rank(overflow_rank):
    """One rank exceeds max_tokens_per_rank and its process exits at once: every other rank
    raises CapacityOverflowError naming that rank, its 13 tokens, the capacity and the fix,
    from the status words (not a timeout naming whichever peer left first), well within
    timeout_s."""
    from tests.helpers.exchange_worker import run_capacity_overflow

    timeout_s = 3.0
    results = run_distributed(
        run_capacity_overflow,
        4,
        dict(num_nodes=2, gpus_per_node=2),
        timeout_s,
        overflow_rank,
        timeout_s=180,
    )
    res = results[overflow_rank]
    assert res["error"] == "CapacityOverflowError", res
    assert "13 tokens in this layer call exceed max_tokens_per_rank=12" in res["message"]
    for rank in set(range(4)) - {overflow_rank}:
        res = results[rank]
        assert res["error"] == "CapacityOverflowError", (rank, res)
        assert res["after_s"] < timeout_s, (rank, res)
        message = res["message"]
        assert f"EP rank {overflow_rank}: 13 tokens > max_tokens_per_rank=12" in message, message
        assert "raise max_tokens_per_rank to at least 13" in message, message
