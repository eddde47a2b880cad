"""Does a fewer-phase path's advantage over JOINT grow as the payload shrinks at fixed shape? The
check behind the selector's "fewer-phase anchors reach down" rule (docs/selector.md, Runtime rule).

T = 128 all-pairs GLM-4.5-Air layers of a few workload seeds on the flow model; the payload is
scaled by the record size (counts, so rho_g and kappa, unchanged), and for two layers per seed by
the record counts (what `railwave calibrate --payload-scales` does). Prints RAIL / JOINT and
NATIVE / JOINT per scale and counts where either ratio falls as the payload grows.

    .venv/bin/python scripts/selector_payload_sweep.py [CLUSTER] [MODEL_YAML]
"""
import sys

from megatron_railwave.lab import calibration
from megatron_railwave.lab.calibration import NetmodelBackend, ReplayRequest
from megatron_railwave.lab.netmodel import NetModelConfig, load_netmodel_config
from megatron_railwave.planner import Path
from megatron_railwave.topology import load_topology
from megatron_railwave.lab.workloads import scaled_demand

topo = load_topology(sys.argv[1] if len(sys.argv) > 1 else "h800_4x8")
backend = NetmodelBackend(topo, model=load_netmodel_config(sys.argv[2]) if len(sys.argv) > 2 else NetModelConfig())
record_bytes = 4096 * 2
factors = (1 / 16, 1 / 8, 1 / 4, 1 / 2, 1, 2, 4)
rises = 0


def ratios(records, nbytes, name):
    lat = {p: backend.measure(ReplayRequest(name=name, records_NGN=records, record_bytes=nbytes), p, 1)[0]
           for p in (Path.NATIVE, Path.RAIL, Path.JOINT)}
    return lat[Path.RAIL] / lat[Path.JOINT], lat[Path.NATIVE] / lat[Path.JOINT]


for seed, layers in ((0, [1, 9, 17, 25, 33, 41]), (2, [1, 9, 17, 25, 33, 41]), (1000, [2, 10, 20, 30, 40])):
    reqs = calibration.glm_requests(topo, layers=layers, step=0, seed=seed, payload_scales=[1.0],
                                    record_bytes=record_bytes, tokens=[128], arrangements=["none"])
    for r in reqs:
        rail, native = zip(*(ratios(r.records_NGN, int(record_bytes * f), f"{r.name}-b{f}") for f in factors))
        rises += sum(b < a for a, b in zip(rail, rail[1:])) + sum(b < a for a, b in zip(native, native[1:]))
        x, y, _ = calibration.request_stats(r, topo).coords
        print(f"{r.name} x={x:.2f} y={y:.2f} RAIL/JOINT NATIVE/JOINT at payload x "
              + " ".join(f"{f:g}:{a:.3f}/{b:.3f}" for f, a, b in zip(factors, rail, native)), flush=True)
    for r in reqs[:2]:
        row = [ratios(scaled_demand(r.records_NGN, f), record_bytes, f"{r.name}-c{f}")[0] for f in (0.5, 0.75, 1.0, 1.5)]
        print(f"  record counts x 0.5, 0.75, 1, 1.5: RAIL/JOINT " + " ".join(f"{v:.3f}" for v in row), flush=True)
print(f"steps where RAIL/JOINT or NATIVE/JOINT falls as the payload grows: {rises}")
