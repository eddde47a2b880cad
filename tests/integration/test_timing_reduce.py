"""The online selector's timing all-reduce in fixed-capacity mode (``exchange.timing_reduce``) on
gloo: every rank reads the same (largest, smallest) word of each reduce, several in flight."""

from __future__ import annotations

import torch

from megatron_railwave.exchange import TIMING_REDUCE_BYTES, post_timing_reduce
from megatron_railwave.exchange.groups import virtual_rank_groups
from megatron_railwave.selector.online import TIMING_NAN
from megatron_railwave.topology import RailTopology
from tests.helpers.dist import run_distributed
from tests.helpers.exchange_worker import reduce_timing_words


def test_timing_reduce_gives_every_rank_the_largest_and_smallest_word():
    # words per rank: 5000, NaN code (-2), 7000, 1000; post k adds k to each word
    words = [5000, TIMING_NAN, 7000, 1000]
    results = run_distributed(reduce_timing_words, 4, words, 3, timeout_s=120)
    expected = [(7000 + k, TIMING_NAN + k) for k in range(3)]
    assert all(r == expected for r in results), results


def test_timing_reduce_without_a_process_group_is_this_rank_alone():
    groups = virtual_rank_groups(RailTopology(num_nodes=2, gpus_per_node=2), 1)
    posted = post_timing_reduce(1234, groups.ep, device=torch.device("cpu"))
    assert posted.work is None and posted.result() == (1234, 1234)
    assert posted.pair.numel() * posted.pair.element_size() == TIMING_REDUCE_BYTES
