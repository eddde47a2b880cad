"""The saturating incast law: goodput falls with the sender count k, then levels off."""

import numpy as np
import pytest

from megatron_railwave.lab.netmodel import IncastModel, alpha_from_slowdowns


def test_saturating_law_levels_off_after_k_sat_excess_senders():
    # alpha 0.5, k_free 1, k_sat 2: k = 1 -> 1; k = 2 -> 1 / 1.5; k = 3 and beyond -> 1 / 2.
    law = IncastModel(alpha=0.5, k_free=1, k_sat=2)
    np.testing.assert_allclose(
        law.capacity_factor(np.array([0, 1, 2, 3, 4, 255])), [1, 1, 1 / 1.5, 0.5, 0.5, 0.5]
    )
    linear = IncastModel(alpha=0.5, k_free=1)
    assert linear.capacity_factor(255) == pytest.approx(1 / (1 + 0.5 * 254))


def test_alpha_from_slowdowns_uses_the_saturated_excess():
    # Slowdowns 1.5 (k=2), 2.0 (k=3), 2.0 (k=8) are exactly alpha 0.5 with k_sat 2; the linear
    # law cannot fit the flat tail and gives a smaller alpha.
    k, s = [2, 3, 8], [1.5, 2.0, 2.0]
    assert alpha_from_slowdowns(k, s, k_sat=2) == pytest.approx(0.5)
    assert alpha_from_slowdowns(k, s) < 0.2


def test_k_sat_must_be_positive():
    with pytest.raises(ValueError, match=r"IncastModel.k_sat must be an int >= 1 or None"):
        IncastModel(alpha=0.1, k_sat=0)
