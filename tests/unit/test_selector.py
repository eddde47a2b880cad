"""The selector of a config: a fixed path or the online selector; the count exchange's delivery
counts for min-max plans (``dispatch_modes.base.plans_min_max``); the retired offline selector is
gone from the package."""

from __future__ import annotations

import importlib

import pytest

from megatron_railwave.config import OnlineSettings, RailWaveConfig
from megatron_railwave.dispatch_modes import CapacityMode, OnlineCapacityMode, choose_dispatch_mode
from megatron_railwave.dispatch_modes.base import plans_min_max
from megatron_railwave.names import Route
from megatron_railwave.selector import FixedSelector, OnlineSelector, selector_from_config
from megatron_railwave.selector.online import PROCESS_SHARED
from tests.helpers.online_cases import SCALES, TOPO, stats


def test_fixed_selector_ignores_the_descriptors():
    sel = FixedSelector("rail")
    assert sel.path == Route.RAIL and sel.select(stats(64)) == Route.RAIL
    with pytest.raises(ValueError, match="unknown path 'railz'"):
        FixedSelector("railz")


def test_selector_from_config_online_per_layer_sharing_the_process_registry():
    a = selector_from_config(RailWaveConfig(), TOPO)
    b = selector_from_config(RailWaveConfig(online={"probes": 3}), TOPO)
    assert isinstance(a, OnlineSelector) and isinstance(b, OnlineSelector) and a is not b
    assert a.shared is PROCESS_SHARED and a.scales == SCALES
    assert b.settings == OnlineSettings(probes=3)
    no_share = selector_from_config(RailWaveConfig(online={"share": False}), TOPO)
    assert no_share.shared is None


def test_fixed_capacity_modes_follow_the_path():
    # path auto: the online selector's epochs (one host wait every capacity_sync_every calls);
    # a fixed path: the path once, no host sync.
    auto = choose_dispatch_mode(
        RailWaveConfig(max_tokens_per_rank=8), TOPO, selector=None, num_local_experts=1
    )
    fixed = choose_dispatch_mode(
        RailWaveConfig(path="perm", max_tokens_per_rank=8), TOPO, selector=None, num_local_experts=1
    )
    assert isinstance(auto, OnlineCapacityMode) and isinstance(auto.selector, OnlineSelector)
    assert type(fixed) is CapacityMode and fixed.selector.path == Route.PERM


def test_plans_min_max_asks_for_delivery_counts_only_where_a_min_max_plan_may_run():
    online = OnlineSelector(scales=SCALES)
    with_flow = OnlineSelector(OnlineSettings(candidates=("joint", "flow")), scales=SCALES)

    class Caller:  # a caller's PathSelector: decides from the descriptors
        def select(self, stats):
            return Route.RAIL

    assert not plans_min_max(online, None) and plans_min_max(with_flow, None)
    assert plans_min_max(FixedSelector("flow-waves"), None)
    assert not plans_min_max(FixedSelector("joint"), None)
    assert not plans_min_max(Caller(), None)
    # A recompute replays its forward's path: that path decides.
    assert plans_min_max(online, Route.FLOW) and not plans_min_max(with_flow, "rail")


@pytest.mark.parametrize(
    "module",
    [
        "megatron_railwave.selector.anchors",
        "megatron_railwave.selector.path_model",
        "megatron_railwave.selector.arrivals",
        "megatron_railwave.lab.calibration",
        "megatron_railwave.commands.calibrate",
        "megatron_railwave.commands.validate",
    ],
)
def test_the_offline_selector_is_retired(module):
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(module)
