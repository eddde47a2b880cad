"""Refit an anchors file's path model after its estimate changed (a new ``path_model.FEATURE_NAMES``
version), from RAIL / JOINT rows of its calibration requests (scripts/selector_lab_rows.py), without
running the flow model again: the rows' RAIL / JOINT seconds, B_mean and windows do not depend on
the estimate, so only the features are recomputed (the file's calibration requests, rebuilt from
`context.settings.requests`; ~8 min for 10,304 requests on one core, most of it building them).

Writes the rows with the new features (the second argument), prints the leave-one-seed-out score
of the old and the new features (no payload gate, `calibration.score_path_model`) and, with
--write, puts the new coefficients into the file (`context.settings.selector.model`, gates cleared:
choose them with scripts/selector_gate_loso.py --write next) and says so in `method`.

    PYTHONPATH=. .venv/bin/python scripts/selector_refit.py configs/anchors/h800_4x8_c2.yaml \
        configs/anchors/rows/h800_4x8_c2.jsonl.gz /tmp/h800_4x8_c2.jsonl.gz [--write]
"""
import argparse
import datetime
import gzip
import json
import re
import tempfile
import time

import numpy as np
import torch
import yaml

from megatron_railwave.lab import calibration
from megatron_railwave.selector.anchors import load_anchors, save_anchors
from megatron_railwave.selector.path_model import FEATURE_NAMES, PathCosts, fit_rail_joint, path_features
from megatron_railwave.topology import RailTopology
from megatron_railwave.traffic import dtype_bytes

from _selector_rows import load_rows, row_arrays

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("anchors")
parser.add_argument("rows", help="the file's rows (gzipped JSON lines of scripts/selector_lab_rows.py)")
parser.add_argument("out", help="the rows with the new features")
parser.add_argument("--write", action="store_true", help="write the refitted model into the anchors file")
parser.add_argument("--reuse", action="store_true", help="take the new features from `out` (written by an earlier run "
                    "of this script with this code's estimate: not checked) instead of recomputing them")
args = parser.parse_args()
torch.set_num_threads(1)
doc = yaml.safe_load(open(args.anchors))
context = doc["context"]
selector = context["settings"]["selector"]
old_model = selector.get("model")
if old_model is None:
    raise SystemExit(f"{args.anchors}: no path model (context.settings.selector.model)")
if abs(1.0 + float(selector.get("tolerance", 0.03)) - calibration.MAX_RATIO_TO_BEST) > 1e-12:
    raise SystemExit(f"{args.anchors}: tolerance {selector.get('tolerance')} is not the 3% this script scores with")
topo = RailTopology.from_dict(context["topology"])
costs = PathCosts.from_dict(old_model["costs"])
record_bytes = int(context["hidden_size"]) * dtype_bytes(context["dtype"])
old_rows = {row["name"]: row for row in load_rows(args.rows)}
if args.reuse:
    rows = load_rows(args.out)
    if sorted(r["name"] for r in rows) != sorted(old_rows) or any(
            {k: v for k, v in r.items() if k != "features"} != {k: v for k, v in old_rows[r["name"]].items()
                                                                 if k != "features"} for r in rows):
        raise SystemExit(f"{args.out}: not the rows of {args.rows} with new features")
else:
    requests = calibration.calibration_requests(topo, context["settings"]["requests"], record_bytes=record_bytes)
    missing = [r.name for r in requests if r.name not in old_rows]
    if missing or len(requests) != len(old_rows):
        raise SystemExit(f"{args.rows}: not this file's calibration rows ({len(old_rows)} rows, {len(requests)} "
                         f"requests, {len(missing)} requests without a row, e.g. {missing[:3]})")
    t0 = time.time()
    rows = []
    for r in requests:
        row = dict(old_rows[r.name])
        row["features"] = path_features(r.demand, topo, record_bytes=r.record_bytes, windows=r.windows,
                                        costs=costs).tolist()
        rows.append(row)
    print(f"features of {len(rows)} requests in {time.time() - t0:.0f} s")
    with gzip.open(args.out, "wt") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")

a = row_arrays(rows)
windows_R, rail_R, joint_R, payload_R = a["windows"], a["rail_s"], a["joint_s"], a["payload"]
units_R, target_R, limit_R = a["units"], a["target"], a["limit"]
scores = {}
for label, features_RF in (("old", np.array([old_rows[r["name"]]["features"] for r in rows])),
                           ("new", np.array([r["features"] for r in rows]))):
    sc = calibration.score_path_model(features_RF, windows_R, target_R, payload_R, units_R, rail_R, joint_R, limit_R,
                                      costs=costs, gating="none")
    scores[label] = sc
    print(f"{label} features ({'/'.join(old_model['features']) if label == 'old' else '/'.join(FEATURE_NAMES)}): "
          f"leave-one-seed-out {sc['over_tolerance']} over 1.03x, "
          f"total / always-JOINT {sc['total_s'] / joint_R.sum():.6f}")
fits = np.isfinite(target_R)  # as calibration fits: a row without both times teaches nothing
model = fit_rail_joint(np.array([r["features"] for r in rows])[fits], windows_R[fits], target_R[fits], costs=costs)
if model is None:
    raise SystemExit("no all-pairs rows with both times: nothing to fit")
print(f"new coefficients: all pairs {model.all_pairs}, windowed {model.windowed}")
if args.write:
    selector["model"] = model.to_dict()
    new = scores["new"]
    method = selector["method"].split("; payload gat")[0]  # the gates are chosen again next
    refit = (f"the RAIL / JOINT path model ({FEATURE_NAMES[-1]}, refitted {datetime.date.today()} on the kept "
             f"RAIL / JOINT rows, scripts/selector_refit.py: leave-one-seed-out {new['over_tolerance']} requests over "
             f"1.03x of the better of RAIL and JOINT)")
    method, count = re.subn(r"the RAIL / JOINT path model \([^)]*\)", refit, method)
    if count != 1:
        raise SystemExit(f"{args.anchors}: method does not name the path model's score once: {method!r}")
    selector["method"] = method
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as tmp:
        yaml.safe_dump(doc, tmp, sort_keys=False)
        tmp.flush()
        anchor_set = load_anchors(tmp.name, topo)  # checks the file as the runtime reads it
    save_anchors(anchor_set, args.anchors)
    print(f"wrote {args.anchors}")
