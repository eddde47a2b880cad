"""The asynchronous exchange on 4 gloo ranks (2 nodes x 2 GPUs): ``start_dispatch`` /
``start_combine`` return while their phases are in flight, the caller's work runs in between,
and ``finish_*`` gives the synchronous results bit for bit (outputs and gradients, every path);
the waits in ``finish`` keep their timeout."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

_REPO_ROOT = Path(__file__).resolve().parents[2]
if str(_REPO_ROOT) not in sys.path:  # spawned ranks inherit sys.path and import tests.helpers
    sys.path.insert(0, str(_REPO_ROOT))

from megatron_railwave.names import ROUTES  # noqa: E402
from tests.helpers.async_worker import run_async_matches_sync, run_async_timeout  # noqa: E402
from tests.helpers.dist import run_distributed  # noqa: E402

PATHS = list(map(str, ROUTES))


def test_async_exchange_returns_in_flight_and_matches_sync_bitwise():
    results = run_distributed(run_async_matches_sync, 4, PATHS, timeout_s=300)
    for rank, res in enumerate(results):
        for path in PATHS:
            sync, asy = res[path]["sync"], res[path]["async"]
            for key in ("out", "x_grad", "probs_grad"):
                assert np.array_equal(sync[key], asy[key]), f"rank {rank} {path} {key}"
                assert np.array_equal(sync[key], res["native"]["sync"][key]), (
                    f"rank {rank} {path} {key} != native"
                )
    # Rank 0 got past start while every peer was held back: its phases were still in flight.
    for path in PATHS:
        assert results[0][path]["async"]["dispatch_in_flight"], path
        assert results[0][path]["async"]["combine_in_flight"], path


def test_async_exchange_finish_times_out_naming_the_stage():
    results = run_distributed(run_async_timeout, 4, timeout_s=120)
    assert results[1] == "silent"
    assert results[0].startswith("ExchangeTimeoutError: RailWave exchange, EP rank 0: stage '"), (
        results[0]
    )
    assert "did not complete within 3.0 s" in results[0]
