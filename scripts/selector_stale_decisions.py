"""What a path-model decision loses when it is taken from another call's counts (docs/selector.md,
"A decision taken one call ahead").

A dispatcher could decide a layer's next call from this call's gathered counts after this call's
dispatch is posted, taking the decision off the critical path. This measures the price on the
flow model: every held-out request of a `railwave validate --json` run (workload step 0, its
medians per path) decided (a) from its own counts and (b) from the counts of the same layer, T and
arrangement at another workload step (the generator redraws token counts, expert popularity and
preferences every step; only the layer's skew level persists, so this is the worst case of a
stationary drift). Prints, per decision step: decisions that agree with (a), requests over 1.03x
of their best path, the saving per layer against always-JOINT (all requests and all-pairs-at-once
requests, the training-step input), and writes them as JSON.

    PYTHONPATH=. .venv/bin/python scripts/selector_stale_decisions.py configs/anchors/h800_4x8_c2.yaml \
        out/val_h800_14000.json 1,2,3 out/stale_h800.json
"""
import json
import sys

import torch
import yaml

from megatron_railwave.lab import calibration
from megatron_railwave.selector.anchors import load_anchors
from megatron_railwave.selector import ModelSelector
from megatron_railwave.topology import RailTopology
from megatron_railwave.traffic import dtype_bytes

torch.set_num_threads(1)
anchors, validation, steps, out_path = sys.argv[1], sys.argv[2], [int(s) for s in sys.argv[3].split(",")], sys.argv[4]
doc = yaml.safe_load(open(anchors))
topo = RailTopology.from_dict(doc["context"]["topology"])
anchor_set = load_anchors(anchors, topo)
if anchor_set.path_model is None:
    sys.exit(f"{anchors}: no path model (context.settings.selector.model); this script measures the path model")
selector = ModelSelector(anchor_set.path_model, topo)
measured = json.load(open(validation))
held = measured["held_out"]
rows = {r["request"]: r for r in measured["requests"]}
if not all("-s0-" in name for name in rows):
    sys.exit(f"{validation}: expected the requests of workload step 0 (railwave validate)")
record_bytes = anchor_set.context.hidden_size * dtype_bytes(anchor_set.context.dtype)  # as railwave validate


def decisions(step: int) -> dict[str, str]:
    """Step 0's request name -> the path decided from the counts of the same request at ``step``."""
    requests = calibration.glm_requests(topo, layers=held["layers"], step=step, seed=held["seed"],
                                        payload_scales=held["payload_scales"], record_bytes=record_bytes,
                                        tokens=held["tokens"], arrangements=held["arrangements"])
    return {r.name.replace(f"-s{step}-", "-s0-"): str(selector.select_layer(None, r.demand, record_bytes=r.record_bytes,
                                                                          windows=r.windows)).lower()
            for r in requests}


fresh = decisions(0)
report = {"anchors": anchors, "validation": validation, "held_out": held, "steps": {}}
for step in [0] + [s for s in steps if s != 0]:
    chosen = fresh if step == 0 else decisions(step)
    result = {}
    for kind, keep in (("all", lambda name: True), ("all_pairs", lambda name: "-none-" in name)):
        names = [n for n in rows if keep(n)]
        joint = sum(rows[n]["joint_s"] for n in names)
        selected = sum(rows[n]["median_s"][chosen[n]] for n in names)
        best = sum(rows[n]["best_s"] for n in names)
        result[kind] = {"requests": len(names),
                        "saving_us_per_layer": (joint - selected) / len(names) * 1e6,
                        "best_saving_us_per_layer": (joint - best) / len(names) * 1e6,
                        "selected_vs_joint": selected / joint,
                        "over_tolerance": sum(rows[n]["median_s"][chosen[n]] / rows[n]["best_s"] > calibration.MAX_RATIO_TO_BEST
                                              for n in names),
                        "agree_with_own_counts": sum(chosen[n] == fresh[n] for n in names)}
    report["steps"][step] = result
    a, t = result["all"], result["all_pairs"]
    print(f"decided from step {step}: agree {a['agree_with_own_counts']}/{a['requests']}, over 1.03x {a['over_tolerance']}, "
          f"saving vs JOINT {a['saving_us_per_layer']:.1f} us/layer (best {a['best_saving_us_per_layer']:.1f}); "
          f"all pairs: {t['saving_us_per_layer']:.1f} us/layer (best {t['best_saving_us_per_layer']:.1f}), "
          f"over {t['over_tolerance']}")
json.dump(report, open(out_path, "w"), indent=1)
