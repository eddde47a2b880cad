"""Replay a flow set in SimGrid and write its completion times: a *solver check* of `maxmin`.

It solves the same max-min fair-sharing problem with another solver; it checks the engine's
arithmetic, not the model against a network (no packets, no incast: both are flow models).

Runs under the *system* interpreter, which has Debian's ``python3-simgrid`` (3.32); the
package's own code never imports this module. Usage::

    /usr/bin/python3 simgrid_check.py IN.json OUT.json

IN.json::

    {"capacity_Bps": [float, ...],          # [L] link capacities, bytes/s
     "flows": [{"size_bytes": int,          # bytes (SimGrid takes an integer size)
                "links": [int, ...],        # link ids the flow crosses, in any order
                "start_s": float}, ...]}    # optional, default 0

OUT.json: ``{"finish_s": [float, ...], "simgrid_version": str}``, one time per flow.

From the package's interpreter use `simgrid_available` and `simulate_in_simgrid`, which run
this file through a subprocess (they import nothing from SimGrid themselves).

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
import os
import subprocess
import sys
import tempfile

__all__ = ["SYSTEM_PYTHON", "simgrid_available", "simulate_in_simgrid"]

SYSTEM_PYTHON = "/usr/bin/python3"
"""Interpreter that has Debian's python3-simgrid (``apt-get install -y python3-simgrid``)."""


def simgrid_available(python: str = SYSTEM_PYTHON) -> bool:
    """True when ``python`` exists and can ``import simgrid``."""
    if not os.path.exists(python):
        return False
    probe = subprocess.run([python, "-c", "import simgrid"], capture_output=True, timeout=60)
    return probe.returncode == 0


def simulate_in_simgrid(
    capacity_Bps_L,
    size_bytes_F,
    links_FH,
    *,
    start_s_F=None,
    python: str = SYSTEM_PYTHON,
    timeout_s: float = 600.0,
):
    """Completion times of the flows in SimGrid (CM02, zero latency; see the module docstring).

    Args:
        capacity_Bps_L: [L] link capacities, bytes/s.
        size_bytes_F: [F] flow sizes; rounded to whole bytes (SimGrid's size is an integer).
        links_FH: [F, H] link ids per flow, -1 = padding.
        start_s_F: [F] start times in seconds; None = all 0.
        python: interpreter with python3-simgrid.
        timeout_s: limit for the SimGrid run.

    Returns:
        [F] float64 completion times, seconds.

    Raises:
        RuntimeError: the SimGrid run failed (its stderr is included).
    """
    import numpy as np

    links_FH = np.asarray(links_FH)
    flows = []
    for f, size in enumerate(np.asarray(size_bytes_F, dtype=np.float64)):
        flow = {"size_bytes": int(round(size)), "links": [int(l) for l in links_FH[f] if l >= 0]}
        if start_s_F is not None:
            flow["start_s"] = float(start_s_F[f])
        flows.append(flow)
    spec = {"capacity_Bps": [float(c) for c in capacity_Bps_L], "flows": flows}
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = os.path.join(tmp, "in.json"), os.path.join(tmp, "out.json")
        with open(src, "w", encoding="utf-8") as f:
            json.dump(spec, f)
        proc = subprocess.run(
            [python, os.path.abspath(__file__), src, dst],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if proc.returncode != 0:
            raise RuntimeError(
                f"SimGrid run failed (exit {proc.returncode}) with {python}: {proc.stderr[-2000:]}"
            )
        with open(dst, encoding="utf-8") as f:
            return np.asarray(json.load(f)["finish_s"], dtype=np.float64)


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
