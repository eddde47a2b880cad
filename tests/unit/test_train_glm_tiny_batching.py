"""examples/train_glm_tiny.py's batching (no training): the per-rank token counts it plans."""

import importlib.util
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "train_glm_tiny", Path(__file__).resolve().parents[2] / "examples" / "train_glm_tiny.py"
)
tiny = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(tiny)


def _args(*argv):
    return tiny._parse_args(["--nprocs", "8", *argv])


def test_fixed_batches_are_equal_on_every_rank():
    plan = tiny.micro_batch_plan(_args("--batching", "fixed", "--micro-batch-size", "3"), 0)
    assert plan == [[[32, 32, 32]]] * 8


def test_packed_rollouts_follow_the_clipped_length_law_and_differ_per_rank():
    args = _args(
        "--batching", "packed", "--seq-length", "64", "--micro-batch-size", "4", "--len-min", "5"
    )
    plan = tiny.micro_batch_plan(args, 3)
    lengths = [n for rank in plan for n in rank[0]]
    assert all(len(rank) == 1 and len(rank[0]) == 4 for rank in plan)
    assert min(lengths) >= 5 and max(lengths) <= 64
    assert len({sum(rank[0]) for rank in plan}) > 1
    assert (
        plan == tiny.micro_batch_plan(args, 3) != tiny.micro_batch_plan(args, 4)
    )  # seeded per step
    batch = tiny._batch(args, 1, 3, 0, plan[1][0])
    s = sum(plan[1][0])
    assert batch["input_ids"].shape == (1, s) and batch["attention_mask"].shape == (1, 1, s, s)
    first = plan[1][0][0]
    # Block-diagonal causal: the second rollout's first token sees only itself.
    assert batch["attention_mask"][0, 0, first].tolist() == [True] * first + [False] + [True] * (
        s - first - 1
    )


@pytest.mark.parametrize("balance", [False, True])
def test_budget_runs_the_same_micro_batch_count_everywhere(balance):
    extra = ["--balance-ranks"] if balance else []
    args = _args(
        "--batching",
        "budget",
        "--seq-length",
        "128",
        "--samples-per-rank",
        "6",
        "--max-tokens-per-gpu",
        "256",
        *extra,
    )
    for step in range(5):
        plan = tiny.micro_batch_plan(args, step)
        unbalanced = tiny.micro_batch_plan(
            _args(
                "--batching",
                "budget",
                "--seq-length",
                "128",
                "--samples-per-rank",
                "6",
                "--max-tokens-per-gpu",
                "256",
            ),
            step,
        )
        totals = [sum(map(sum, rank)) for rank in plan]
        assert len({len(rank) for rank in plan}) == 1  # one M for every rank (the EP all-to-alls)
        assert len(plan[0]) == max(-(-t // 256) for t in totals)
        assert all(len(mb) >= 1 for rank in plan for mb in rank)
        assert all(sum(len(mb) for mb in rank) == 6 for rank in plan)
        # Balancing deals the same rollouts back: the step's multiset of lengths is unchanged.
        assert sorted(n for rank in plan for mb in rank for n in mb) == sorted(
            n for rank in unbalanced for mb in rank for n in mb
        )
        if balance:
            assert max(totals) - min(totals) <= 128  # within one longest rollout


def test_bad_budget_is_refused():
    with pytest.raises(SystemExit):
        _args("--batching", "budget", "--seq-length", "512", "--max-tokens-per-gpu", "256")
