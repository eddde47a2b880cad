"""Why the FAST-style peer beats JOINT by ~2% on 4 x 8 (docs/results.md, "Schedule model", Peers).

FAST's program (`netmodel.peers.fast_program`, its RAIL plan) run with (a) its BvN waves, (b) the
cyclic waves JOINT runs (wave k: s -> (s + k) mod N, whole pairs), (c) its BvN waves merged by
permutation, (d) each cyclic wave cut into 2 or 3 equal waves (same pairs: only the wave count
changes); P50 over the first L RING layers next to JOINT's, payload scale PAPER_PAYLOAD_SCALE (make bench-paper).

    PYTHONPATH=. .venv/bin/python scripts/netmodel_fast_waves.py h800_4x8 configs/netmodel/h800_4x8.yaml 45
"""
import sys, statistics as st
import numpy as np, torch
from megatron_railwave.commands.bench import layer_demands
from megatron_railwave.topology import load_topology
from megatron_railwave.lab.netmodel import load_netmodel_config, execute_plan
from megatron_railwave.lab.netmodel.execute import fabric_for, synced_program
from megatron_railwave.lab.netmodel.program import run_program
from megatron_railwave.lab.netmodel.peers import bvn_waves, fast_program
from megatron_railwave.planner import build_plan, cyclic_schedule, PlanOptions
from megatron_railwave.lab.workloads import GLM45_AIR, PAPER_PAYLOAD_SCALE, arrange, scaled_demand
torch.set_num_threads(1)
cluster, mfile = sys.argv[1], sys.argv[2]; nl = int(sys.argv[3])
topo = load_topology(cluster); model = load_netmodel_config(mfile)
rb = GLM45_AIR.hidden_size * 2
fabric = fabric_for(topo, model.nodes_per_leaf, float(model.spine_oversubscription))
def run(plan, demand, waves):
    prog = synced_program(fast_program(plan, demand, waves, record_bytes=rb, model=model), model, topo.world_size)
    r = run_program(fabric, prog, incast=model.incast(), rel_tol=model.rel_tol, nvlink=model.nvlink)
    return r.total_s
res = {k: [] for k in ("joint", "fast_bvn", "fast_cyclic", "fast_bvn_merged", "fast_cyclic_x2", "fast_cyclic_x3", "nbvn", "nmerged")}
for layer in GLM45_AIR.layer_numbers[:nl]:
    demand, windows = arrange(layer_demands(topo, layer=layer, step=0, tokens=2048, seed=0), "ring", topo)
    demand = scaled_demand(demand, PAPER_PAYLOAD_SCALE); rec = demand.records_NGN()
    jp = build_plan(rec, topo, "joint", options=PlanOptions(fanin=1, windows=windows), phase=layer)
    res["joint"].append(execute_plan(jp, record_bytes=rb, model=model, demand=demand).total_s)
    rp = build_plan(rec, topo, "rail")
    pair = rp.records_NNG.sum(dim=-1).numpy()
    bvn = bvn_waves(pair); res["nbvn"].append(len(bvn))
    n = topo.num_nodes
    cyc = []
    for wave in cyclic_schedule(n).waves:  # JOINT's waves, whole pairs
        w = np.zeros((n, n), np.int64)
        for s, d in wave: w[s, d] = pair[s, d]
        cyc.append(w)
    merged = {}
    for w in bvn:
        key = tuple(int(np.nonzero(w[s])[0][0]) if w[s].any() else -1 for s in range(n))
        merged[key] = merged.get(key, 0) + w
    res["nmerged"].append(len(merged))
    res["fast_bvn"].append(run(rp, demand, bvn)); res["fast_cyclic"].append(run(rp, demand, cyc))
    res["fast_bvn_merged"].append(run(rp, demand, list(merged.values())))
    for m in (2, 3):  # each cyclic wave cut into m equal-size waves (same pairs): only the wave count changes
        cut = [w // m + (w % m > i) for w in cyc for i in range(m)]
        res[f"fast_cyclic_x{m}"].append(run(rp, demand, cut))
for k, v in res.items():
    print(k, round(st.median(v) * (1e3 if not k.startswith("n") else 1), 3))
j = np.array(res["joint"])
for k in ("fast_bvn", "fast_cyclic", "fast_bvn_merged", "fast_cyclic_x2", "fast_cyclic_x3"):
    print(k, "/ joint median", round(float(np.median(np.array(res[k]) / j)), 4))
