"""A rank that stalls or leaves at any stage: every other rank ends within timeout_s plus a small
margin, with an error naming the stage and, where it waited on it, the unresponsive rank."""

from __future__ import annotations

import re

import pytest

from tests.helpers.dist import run_distributed
from tests.helpers.exchange_worker import run_fault

TIMEOUT_S = 3.0
MARGIN_S = 4.0  # survey grace (<= timeout / 4) + gloo teardown on a loaded 2-core machine
TOPO = dict(num_nodes=2, gpus_per_node=2)  # rank 1 = node 0 GPU 1: node peer 0, rail peer 3


@pytest.mark.parametrize(
    "stage,mode,named_by",
    [
        ("count exchange", "stall", {0, 2, 3}),  # everyone waits in the count all-to-all
        ("dispatch.rail[0]", "stall", {0, 3}),  # its rail peer and its node peer wait on it
        ("count exchange", "leave", {0, 2, 3}),  # the rank dies on its first call
    ],
    ids=["stall-before-counts", "stall-before-rail-send", "leave-first-call"],
)
def test_fault_ends_every_rank_in_time_naming_stage_and_peer(stage, mode, named_by):
    results = run_distributed(run_fault, 4, TOPO, 1, stage, mode, TIMEOUT_S, timeout_s=180)
    for rank, res in enumerate(results):
        if rank == 1:
            continue
        assert "error" in res, (rank, res)
        assert res["error"] in ("ExchangeTimeoutError", "ExchangeError"), (rank, res)
        assert res["after_s"] <= TIMEOUT_S + MARGIN_S, (rank, res)
        assert re.search(r"stage '[^']+' on ", res["message"]), res["message"]
        if rank in named_by:
            assert "unresponsive: EP rank(s) [1]" in res["message"], (rank, res["message"])
    if stage == "count exchange":
        assert all(f"stage '{stage}'" in results[r]["message"] for r in (0, 2, 3))
    else:
        assert f"stage '{stage}'" in results[3]["message"]  # the rail peer waits in that very stage
