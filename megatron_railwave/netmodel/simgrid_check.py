"""Replay a flow set in SimGrid and write its completion times (cross-check of `maxmin`).

Runs under the *system* interpreter, which has Debian's ``python3-simgrid`` (3.32); the
package's own code never imports this module. Usage::

    /usr/bin/python3 simgrid_check.py IN.json OUT.json

IN.json::

    {"capacity_Bps": [float, ...],          # [L] link capacities, bytes/s
     "flows": [{"size_bytes": int,          # bytes (SimGrid takes an integer size)
                "links": [int, ...],        # link ids the flow crosses, in any order
                "start_s": float}, ...]}    # optional, default 0

OUT.json: ``{"finish_s": [float, ...], "simgrid_version": str}``, one time per flow.

Model settings, chosen so that SimGrid computes pure max-min fair sharing:
    * ``network/model:CM02`` -- no latency or bandwidth correction factors
      (LV08 multiplies latency by 13.01 and bandwidth by 0.97) and weight-S = 0.
    * every link latency = 0: in CM02 a flow's sharing penalty is its route latency
      (RTT-unfair sharing) and its rate is capped at TCP-gamma / (2 * latency); with zero
      latency every flow has penalty 1 and no window cap, i.e. plain (unweighted) max-min.
    * ``network/crosstraffic:0`` -- no 5% reverse-path (ACK) load on the back route.
    * ``network/optim:Full`` -- full re-solve at each event; the default lazy update can
      return times below the link bound.
Each flow gets its own pair of hosts with a one-way route made of its links, so the links
are the only shared resources.
"""

import json
import sys


def _run(spec: dict) -> dict:
    import simgrid  # system package python3-simgrid

    engine = simgrid.Engine(
        [
            "simgrid_check",
            "--cfg=network/model:CM02",
            "--cfg=network/crosstraffic:0",
            "--cfg=network/optim:Full",
            "--log=root.thresh:critical",
        ]
    )
    zone = simgrid.NetZone.create_full_zone("flows")
    links = []
    for link_id, capacity in enumerate(spec["capacity_Bps"]):
        link = zone.create_link(f"l{link_id}", float(capacity))
        link.set_latency(0.0)
        link.seal()
        links.append(link)

    flows = spec["flows"]
    finish_s = [float("nan")] * len(flows)
    pairs = []
    for flow_id, flow in enumerate(flows):
        src = zone.create_host(f"s{flow_id}", 1.0)
        dst = zone.create_host(f"d{flow_id}", 1.0)
        src.seal()
        dst.seal()
        route = [simgrid.LinkInRoute(links[link_id]) for link_id in flow["links"]]
        zone.add_route(src.netpoint, dst.netpoint, None, None, route, False)
        pairs.append((src, dst))
    zone.seal()

    def sender(flow_id: int) -> None:
        flow = flows[flow_id]
        start_s = float(flow.get("start_s", 0.0))
        if start_s > 0.0:
            simgrid.this_actor.sleep_for(start_s)
        src, dst = pairs[flow_id]
        simgrid.Comm.sendto(src, dst, int(flow["size_bytes"]))
        finish_s[flow_id] = simgrid.Engine.clock

    for flow_id, (src, _) in enumerate(pairs):
        simgrid.Actor.create(f"f{flow_id}", src, sender, flow_id)
    engine.run()
    return {"finish_s": finish_s, "simgrid_version": str(simgrid.simgrid_version)}


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(f"usage: {argv[0]} IN.json OUT.json", file=sys.stderr)
        return 2
    with open(argv[1], encoding="utf-8") as f:
        spec = json.load(f)
    result = _run(spec)
    with open(argv[2], "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
