"""Planning per layer, side by side in one process: JOINT build_plan vs the FAST-style peer (RAIL plan +
BvN decomposition), and the BvN step alone vs JOINT's cached cyclic waves (docs/results.md, Flow model).

    .venv/bin/python scripts/netmodel_plan_ratio.py
"""
import time, statistics
from megatron_railwave.topology import load_topology
from megatron_railwave.planner import build_plan, cyclic_schedule
from megatron_railwave.lab.netmodel.calibrate import arranged_layers, scaled_demand
from megatron_railwave.lab.netmodel.peers import bvn_waves
from megatron_railwave.lab.workloads import PAPER_PAYLOAD_SCALE as PAYLOAD_SCALE  # make bench-paper's scale
topo = load_topology("h800_4x8")
layers = arranged_layers(topo, "extreme", tokens=2048, layers=[8, 17, 36])
j, f, b, c = [], [], [], []
for rep in range(5):
    for layer, (demand, _) in layers.items():
        rec = scaled_demand(demand, PAYLOAD_SCALE).records_NGN()
        t0 = time.perf_counter(); build_plan(rec, topo, "joint"); t1 = time.perf_counter()
        p = build_plan(rec, topo, "rail"); t2 = time.perf_counter()
        bvn_waves(p.records_NNG.sum(dim=-1).numpy()); t3 = time.perf_counter()
        cyclic_schedule(4); t4 = time.perf_counter()
        if rep: j.append(t1 - t0); f.append(t3 - t1); b.append(t3 - t2); c.append(t4 - t3)
m = statistics.median
print(f"JOINT build_plan {m(j)*1e3:.3f} ms; FAST (RAIL plan + BvN) {m(f)*1e3:.3f} ms; BvN alone {m(b)*1e3:.3f} ms; cyclic_schedule (cached) {m(c)*1e6:.2f} us; BvN / cyclic lookup {m(b)/m(c):.0f}x; FAST / JOINT {m(f)/m(j):.2f}x")
