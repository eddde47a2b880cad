"""The two water-filling implementations agree, and the link index stays consistent."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_railwave.lab.netmodel.fill import LinkIndex, max_min_rates, max_min_rates_indexed


def test_max_min_rates_hand_worked_chain():
    # Links 0 (10), 1 (100), 2 (100); sentinel 3. Classes: a=[0,1], b=[1,2] (weight 2), c=[2].
    # Link 0 freezes a at 10; link 2 then offers 100/3 to b's two flows and c; link 1 has
    # 90 left for b's two flows (45 each) -> b and c get 100/3.
    links_HA = np.array([[0, 1, 2], [1, 2, 3]], dtype=np.intp)
    weight_A = np.array([1.0, 2.0, 1.0])
    capacity_L1 = np.array([10.0, 100.0, 100.0, np.inf])
    expect = [10.0, 100.0 / 3, 100.0 / 3]
    np.testing.assert_allclose(max_min_rates(links_HA, weight_A, capacity_L1), expect)
    index = LinkIndex(links_HA, 4)
    np.testing.assert_allclose(
        max_min_rates_indexed(links_HA, weight_A, capacity_L1, index), expect
    )


def test_link_index_entries_and_compact():
    # Classes 0..3 with links [[2, 0, 2, 1], [3, 3, 1, 3]] (3 = sentinel).
    links_HA = np.array([[2, 0, 2, 1], [3, 3, 1, 3]], dtype=np.intp)
    index = LinkIndex(links_HA, 4)
    np.testing.assert_array_equal(index.ptr_L2, [0, 1, 3, 5, 8])
    pos, link = index.entries_of(np.array([2, 1]))
    assert sorted(zip(link.tolist(), pos.tolist())) == [(1, 2), (1, 3), (2, 0), (2, 2)]
    index.compact(np.array([1, 2]), 4)  # drop classes 0 and 3; 1 -> 0, 2 -> 1
    pos, link = index.entries_of(np.array([0, 1, 2]))
    assert sorted(zip(link.tolist(), pos.tolist())) == [(0, 0), (1, 1), (2, 1)]


@st.composite
def _problems(draw):
    num_links = draw(st.integers(1, 6))
    num_hops = draw(st.integers(1, 3))
    num_classes = draw(st.integers(1, 25))
    links = np.full((num_hops, num_classes), num_links, dtype=np.intp)
    for a in range(num_classes):
        path = draw(
            st.lists(
                st.integers(0, num_links - 1),
                min_size=1,
                max_size=min(num_hops, num_links),
                unique=True,
            )
        )
        links[: len(path), a] = path
    weight = np.array(
        draw(st.lists(st.integers(1, 3), min_size=num_classes, max_size=num_classes)), float
    )
    caps = draw(st.lists(st.integers(1, 30), min_size=num_links, max_size=num_links))
    return links, weight, np.append(np.array(caps, float), np.inf)


@settings(max_examples=200, deadline=None)
@given(_problems())
def test_indexed_water_filling_matches_plain(problem):
    links_HA, weight_A, capacity_L1 = problem
    plain = max_min_rates(links_HA, weight_A, capacity_L1)
    indexed = max_min_rates_indexed(
        links_HA, weight_A, capacity_L1, LinkIndex(links_HA, capacity_L1.size)
    )
    np.testing.assert_allclose(indexed, plain, rtol=1e-9)
    # Feasible: no link over capacity.
    load = np.bincount(
        links_HA.ravel(),
        weights=np.tile(weight_A * plain, links_HA.shape[0]),
        minlength=capacity_L1.size,
    )
    assert np.all(load[:-1] <= capacity_L1[:-1] * (1 + 1e-9))
