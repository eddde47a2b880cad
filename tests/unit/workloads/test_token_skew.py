"""Token skew of captured routing: counts from padded traces, the generator's units, the command."""

import json

import numpy as np
import pytest

from megatron_railwave.cli import main
from megatron_railwave.lab.workloads import (
    GlmAirWorkload,
    LayerTrace,
    Trace,
    TraceMeta,
    TraceRecorder,
    glm_air_trace,
    read_capture_steps,
    token_skew,
    token_skew_report,
    trace_tokens_per_rank,
)
from megatron_railwave.topology import RailTopology

TOPO = RailTopology(num_nodes=2, gpus_per_node=2)


def _meta() -> TraceMeta:
    return TraceMeta(model="tiny", topology=TOPO, num_experts=8, topk=2, hidden_size=16)


def _ids(tokens: int, seed: int) -> np.ndarray:
    """[tokens, 2] ascending distinct expert ids of 8."""
    rng = np.random.default_rng(seed)
    return np.sort(
        np.stack([rng.choice(8, 2, replace=False) for _ in range(tokens)]), axis=1
    ).astype(np.int16)


def _trace(counts: list[int], layers=(1, 2)) -> Trace:
    width = max(counts)
    out = []
    for layer in layers:
        ids = np.full((len(counts), width, 2), -1, dtype=np.int16)
        for r, n in enumerate(counts):
            ids[r, :n] = _ids(n, 10 * layer + r)
        out.append(LayerTrace(layer=layer, topk_ids_WTK=ids))
    return Trace(meta=_meta(), layers=tuple(out))


def test_tokens_per_rank_ignores_padding_rows_and_skew_is_std_of_log():
    trace = _trace([8, 2, 4, 8])
    tokens = trace_tokens_per_rank(trace)
    assert tokens.tolist() == [8, 2, 4, 8]
    # log2-spaced counts: logs are ln2 * [3, 1, 2, 3], sample std (ddof 1) = ln2 * std([3, 1, 2,
    # 3]).
    assert token_skew(tokens) == pytest.approx(np.log(2) * np.std([3, 1, 2, 3], ddof=1))
    assert token_skew([5, 5, 5, 5]) == 0.0


def test_layers_that_disagree_or_empty_ranks_are_refused():
    a, b = _trace([8, 2, 4, 8], layers=(1,)), _trace([8, 3, 4, 8], layers=(2,))
    with pytest.raises(
        ValueError, match=r"layers 1 and 2 .* routed different per-rank token counts"
    ):
        trace_tokens_per_rank(Trace(meta=_meta(), layers=a.layers + b.layers))
    with pytest.raises(ValueError, match=r"every rank to route >= 1 token"):
        token_skew([4, 0, 4, 4])
    with pytest.raises(ValueError, match=r">= 2 ranks"):
        token_skew([4])


def test_report_pools_per_step_variances():
    report = token_skew_report([[1, 2, 4, 8], [4, 4, 4, 4]])
    per_step = report["token_skew_per_step"]
    assert per_step[1] == 0.0
    assert report["token_skew"] == pytest.approx(np.sqrt((per_step[0] ** 2 + 0.0) / 2))
    assert report["max_over_mean"] == pytest.approx([8 / 3.75, 1.0])
    assert (report["steps"], report["world"]) == (2, 4)


def test_measures_the_generators_token_skew():
    # The generator's per-rank counts are lognormal with sigma = token_skew; the estimator pooled
    # over 40 steps x 32 ranks recovers it (relative standard error about 2%).
    topo = RailTopology(num_nodes=4, gpus_per_node=8)
    for skew in (0.0, 0.5, 1.46):
        counts = [
            GlmAirWorkload(token_skew=skew, num_tokens=4000, seed=3, step=s).tokens_per_rank(32)
            for s in range(40)
        ]
        assert token_skew_report(counts)["token_skew"] == pytest.approx(skew, abs=0.01, rel=0.08)
    # ... and the trace path sees the same counts as the generator drew.
    work = GlmAirWorkload(token_skew=1.0, num_tokens=16, layers=(3, 9), seed=1, step=2)
    assert (
        trace_tokens_per_rank(glm_air_trace(topo, work)).tolist()
        == work.tokens_per_rank(32).tolist()
    )


def test_token_skew_command_reads_a_capture(tmp_path, capsys):
    capture = tmp_path / "capture"
    with TraceRecorder(capture, 1, TOPO, _meta()) as rec:
        for step, counts in enumerate(([6, 6, 6, 6], [2, 4, 8, 4])):
            for layer in (1, 2):
                for rank, n in enumerate(counts):
                    rec.record(step, layer, rank, _ids(n, step + rank))
    assert [trace_tokens_per_rank(t).tolist() for t in read_capture_steps(capture)] == [
        [6, 6, 6, 6],
        [2, 4, 8, 4],
    ]
    out = tmp_path / "skew.json"
    assert main(["workloads", "token-skew", str(capture), "--json", str(out)]) == 0
    report = json.loads(out.read_text())[str(capture)]
    assert report["tokens_per_rank"] == [[6, 6, 6, 6], [2, 4, 8, 4]]
    assert report["token_skew_per_step"][0] == 0.0
    assert report["token_skew"] == pytest.approx(token_skew([2, 4, 8, 4]) / np.sqrt(2))
    assert "token skew of captured routing" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"holds no step\*/rank\*.npz parts"):
        read_capture_steps(tmp_path)
