"""Choose an anchors file's payload gating leaving seeds out, from RAIL / JOINT rows of its
calibration requests (scripts/selector_lab_rows.py), as `railwave calibrate` does from its own
rows (`calibration.tune_selector`: `score_path_model` per `PAYLOAD_GATINGS`, `choose_gating`).
Checks first that the rows reproduce the file's coefficients (least squares on every row); with
--write puts the chosen gates into the file (`context.settings.selector.model`) and says so in
its `method`.

    PYTHONPATH=. .venv/bin/python scripts/selector_gate_loso.py configs/anchors/h20_4x8_c2.yaml \
        configs/anchors/rows/h20_4x8_c2.jsonl.gz [--write]
"""
import argparse
import dataclasses
import datetime
import numpy as np

from megatron_railwave.lab import calibration
from megatron_railwave.selector.anchors import load_anchors, save_anchors
from megatron_railwave.selector.path_model import fit_rail_joint
from megatron_railwave.traffic import MiB

from _selector_rows import load_rows, row_arrays

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("anchors")
parser.add_argument("rows", nargs="+", help="gzipped JSON lines of scripts/selector_lab_rows.py")
parser.add_argument("--write", action="store_true", help="write the chosen gates into the anchors file")
args = parser.parse_args()
anchor_set = load_anchors(args.anchors, None)
shipped = anchor_set.path_model
if shipped is None:
    raise SystemExit(f"{args.anchors}: no path model")
rows = load_rows(*args.rows)
a = row_arrays(rows)
features_RF = np.array([r["features"] for r in rows])
windows_R, rail_R, joint_R, payload_R = a["windows"], a["rail_s"], a["joint_s"], a["payload"]
units_R, target_R, limit_R = a["units"], a["target"], a["limit"]
refit = fit_rail_joint(features_RF, windows_R, target_R, costs=shipped.costs)
print(f"{len(rows)} rows, {len(set(units_R))} seeds; least squares on every row: all pairs {refit.all_pairs}, "
      f"windowed {refit.windowed}; the file's: {shipped.all_pairs}, {shipped.windowed}")
if not (np.allclose(refit.all_pairs, shipped.all_pairs, rtol=1e-9, atol=1e-12)
        and np.allclose(refit.windowed, shipped.windowed, rtol=1e-9, atol=1e-12)):
    raise SystemExit("the rows do not reproduce the file's coefficients: they are not its calibration's rows")
print(f"always-JOINT over 1.03x on {int((joint_R > limit_R).sum())} rows")
scores = {}
for gating in calibration.PAYLOAD_GATINGS:
    sc = calibration.score_path_model(features_RF, windows_R, target_R, payload_R, units_R, rail_R, joint_R, limit_R,
                                      costs=shipped.costs, gating=gating)
    gates = calibration.payload_gates(payload_R, joint_R > limit_R, windows_R == 1, gating=gating)
    scores[gating] = sc
    print(f"gating {gating:9s}: leave-one-seed-out {sc['over_tolerance']} over, total / always-JOINT "
          f"{sc['total_s'] / joint_R.sum():.6f}, decided {sc['decided']} of {len(rows)}; gates from every row "
          f"(all pairs, windowed) MiB: " + ", ".join("none" if g is None else f"{g / MiB:.2f}" for g in gates))
chosen = calibration.choose_gating(scores)
gate_all, gate_windowed = calibration.payload_gates(payload_R, joint_R > limit_R, windows_R == 1, gating=chosen)
print(f"chosen: {chosen}")
if args.write:
    settings = dict(anchor_set.context.settings)
    selector = dict(settings["selector"])
    model = dataclasses.replace(shipped, max_payload_bytes=gate_all, max_payload_bytes_windowed=gate_windowed)
    selector["model"] = model.to_dict()
    sc = scores[chosen]
    # Replaces what an earlier run (or the first gate, "; payload gate ...") wrote there.
    selector["method"] = selector["method"].split("; payload gat")[0] + (
        f"; payload gating {chosen} (scripts/selector_gate_loso.py on RAIL / JOINT rows of the calibration requests, "
        f"{datetime.date.today()}: leave-one-seed-out {sc['over_tolerance']} over, "
        + ", ".join(f"{g} {scores[g]['over_tolerance']} over / {scores[g]['decided']} decided"
                    for g in calibration.PAYLOAD_GATINGS) + ")")
    settings["selector"] = selector
    save_anchors(dataclasses.replace(anchor_set, context=dataclasses.replace(anchor_set.context, settings=settings)),
                 args.anchors)
    print(f"wrote {args.anchors}")
