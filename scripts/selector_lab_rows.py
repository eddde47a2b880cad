"""RAIL / JOINT rows of an anchors file's calibration requests: what its path model and payload
gates are fitted on, without the other two paths (docs/selector.md, "Payload gates chosen leaving
seeds out").

`railwave calibrate` times all four paths and keeps its rows in its JSON; where that JSON is not
kept (the shipped `_c2` files) this recomputes what the path model needs: per calibration request
(the file's `context.settings.requests`, every T unless --tokens), its flow-model seconds on RAIL
and JOINT (the file's netmodel and rail chunks), B_mean and the path-model features. NATIVE and
PERM are left out: on the calibrated clusters they are never the best path (check with
`railwave calibrate` before using this elsewhere). One line of JSON per request, gzipped.

    PYTHONPATH=. .venv/bin/python scripts/selector_lab_rows.py configs/anchors/h800_4x8_c2.yaml \
        configs/anchors/rows/h800_4x8_c2.jsonl.gz [--tokens 128,256] [--limit K]

~40 min per file for all 10,304 requests on one core of the development machine; building the
requests alone takes ~8 min (also with --limit, which keeps the first K after building them all).
"""
import argparse
import gzip
import json
import time

import torch
import yaml

from megatron_railwave.lab import calibration
from megatron_railwave.selector.anchors import load_anchors
from megatron_railwave.lab.netmodel import NetModelConfig
from megatron_railwave.selector.path_model import path_features
from megatron_railwave.planner import Path, PlanOptions
from megatron_railwave.topology import RailTopology
from megatron_railwave.traffic import SelectorScales, dtype_bytes

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("anchors")
parser.add_argument("out", help="rows, gzipped JSON lines")
parser.add_argument("--tokens", default=None, help="T per GPU to keep (default: the file's)")
parser.add_argument("--limit", type=int, default=None, help="the first K requests only (a smoke run)")
args = parser.parse_args()
torch.set_num_threads(1)
context = yaml.safe_load(open(args.anchors))["context"]
topo = RailTopology.from_dict(context["topology"])
anchor_set = load_anchors(args.anchors, topo)
if anchor_set.path_model is None:
    raise SystemExit(f"{args.anchors}: no path model; its rows would have nothing to fit")
settings = dict(context["settings"]["requests"])
if args.tokens:
    settings["tokens"] = [int(v) for v in args.tokens.split(",")]
backend = calibration.make_backend("netmodel", topo, options=PlanOptions(chunks=anchor_set.chunks),
                                   model=NetModelConfig.from_dict(context["settings"]["model"]))
ref, rho_scale, kappa_scale = anchor_set.scales
scales = SelectorScales(payload_ref_bytes=ref, rho_scale=rho_scale, kappa_scale=kappa_scale)
record_bytes = anchor_set.context.hidden_size * dtype_bytes(anchor_set.context.dtype)
requests = calibration.calibration_requests(topo, settings, record_bytes=record_bytes)[:args.limit]
costs = anchor_set.path_model.costs
t0 = time.time()
with gzip.open(args.out, "wt") as f:
    for i, r in enumerate(requests):
        row = {"name": r.name, "seed": r.meta["seed"], "T": r.meta["tokens"], "layer": r.meta["layer"],
               "windows": calibration.request_windows(r),
               "B_mean": calibration.request_stats(r, topo, scales).B_mean_bytes,
               "rail_s": backend.measure(r, Path.RAIL, 1)[0], "joint_s": backend.measure(r, Path.JOINT, 1)[0],
               "features": path_features(r.demand, topo, record_bytes=r.record_bytes, windows=r.windows,
                                         costs=costs).tolist()}
        f.write(json.dumps(row) + "\n")
        if i % 500 == 0:
            print(f"{i} / {len(requests)} requests, {time.time() - t0:.0f} s", flush=True)
print(f"wrote {len(requests)} rows to {args.out} in {time.time() - t0:.0f} s")
