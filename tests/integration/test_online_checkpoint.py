"""``selector: online`` on a real Megatron MoELayer under torch's activation checkpointing.

torch's default checkpoint (non-reentrant) stops the recompute once the tensors the backward
needs are back, before the combine; the reentrant mode replays the whole forward. In both, every
recompute replays its forward's path, no recompute takes a decision or reports a timing, and with
``max_bad: 1`` no call ever reports a bad timing (one would switch the layer to JOINT).
"""

from __future__ import annotations

import pytest

from tests.helpers.checkpoint_worker import run_checkpointed_online
from tests.helpers.dist import run_distributed

STEPS = 6
KW = dict(num_experts=4, topk=2, hidden=16, ffn_hidden=8, seq_len=6, seed=5)


CAPACITY = {"max_tokens_per_rank": 16, "online": {"capacity_sync_every": 2}}  # T = 12 per rank


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("mode", [{}, CAPACITY], ids=["counted", "fixed-capacity"])
def test_checkpointed_layer_replays_its_forward_path_and_reports_no_bad_timing(use_reentrant, mode):
    results = run_distributed(
        run_checkpointed_online, 2, KW, STEPS, use_reentrant, mode, timeout_s=300
    )
    # probes=1 over STEPS training forwards: each path once (fixed capacity: one path per epoch of
    # 2 calls), so a time was filed for each probe but the last.
    probed = STEPS if not mode else STEPS // 2
    for rank, res in enumerate(results):
        assert res["bad"] == 0 and res["fallback"] is None, (rank, res["problem"], res["fallback"])
        calls = res["calls"]
        forwards = {(s, m): p for kind, s, m, p in calls if kind == "train"}
        recomputes = {(s, m): p for kind, s, m, p in calls if kind == "recompute"}
        assert len(forwards) == STEPS and recomputes == forwards, (rank, calls)
        assert len(set(forwards.values())) == min(probed, 4), (rank, calls)
        assert all(key.startswith("train/") for key in res["filed"]), res["filed"]
    assert results[0]["calls"] == results[1]["calls"]
