"""A rail-optimized cluster in Linux network namespaces: N nodes x G GPUs, one shaped NIC per GPU.

Letters: N nodes, G GPUs per node, R rails per node (R = G here: GPU l owns rail l).

Layout made by :func:`up` (nothing is created in the caller's namespace):

    node namespace n (one per node)            fabric namespace (all leaf switches)
      lo        node-local traffic (the NVLink stand-in), never shaped
      <name>r<l> = 10.77.l.(n+1)/24  <--veth-->  <name>n<n>r<l>  --port of bridge-->  <name>b<l>
                                                                         (rail l's leaf switch,
                                                                          router 10.77.l.254)
      <name>m = 10.77.255.(n+1)/24   <--veth-->  <name>n<n>m    --port of bridge-->  <name>bm
                                                                         (management network)

The management network is unshaped and carries no rail traffic: rendezvous (TCPStore) and control
collectives (barriers, the exchange's count all-gather) that must keep working when a rail NIC is
taken down (:func:`fail_rail`), as a cluster's front-end network does. It has no router, so
nothing is forwarded between it and the rails.

Shaping (``tc``, both directions of every NIC):
    node -> switch   HTB at ``rail_mbit`` on the node-side veth (egress); the sender's own queue.
    switch -> node   HTB at ``rail_mbit`` on the switch-side veth (egress) with a ``bfifo`` of
                     ``port_buffer_bytes``: the receiver-facing switch port. Several senders into
                     one port overflow it, packets drop and TCP loses goodput (incast), mostly
                     through retransmission timeouts (``rto_min_ms``, kernel default 200 ms).
GSO is limited to one segment per packet on every veth: queues hold MTU-sized packets, as on a
switch.
``mtu`` sets the packet size of the rails (1500 by default; RoCE fabrics run 4096).

Routing: same-rail traffic crosses one bridge. A socket bound to GPU (n, l)'s address always leaves
through rail l (policy rule ``from 10.77.l.(n+1)`` -> table 100 + l, default via the fabric router),
so traffic between different rails crosses the fabric namespace, which forwards between bridges
(the spine). An unbound socket towards rail l' is routed directly on the node's own rail-l' NIC.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = [
    "TestbedSpec",
    "check_prerequisites",
    "down",
    "fail_rail",
    "forget_spec",
    "list_leftovers",
    "load_spec",
    "nic_counters",
    "restore_rail",
    "save_spec",
    "up",
]

_IFNAMSIZ = 15
_SUBNET = "10.77"
_MGMT_OCTET = 255  # rails use 10.77.0-63.x; the management subnet is 10.77.255.0/24
_TABLE_BASE = 100


@dataclass(frozen=True, kw_only=True, slots=True)
class TestbedSpec:
    """Size, shaping and names of one testbed; the same spec brings it up, runs on it, takes it
    down."""

    __test__ = False  # not a pytest test class despite the name

    nodes: int
    """N: node namespaces."""
    gpus_per_node: int
    """G: worker processes per node; also the number of rails (GPU l uses rail l)."""
    rail_mbit: float = 200.0
    """Line rate of every NIC in Mbit/s, in each direction. Keep N * G * rail_mbit modest on small
    machines: the kernel forwards every byte on the host CPUs."""
    port_buffer_bytes: int = 16 * 1024
    """Queue of each receiver-facing switch port (switch -> node) in bytes; overflow drops. Small
    buffers make synchronized senders into one port lose goodput (TCP retransmission timeouts)."""
    rto_min_ms: int | None = None
    """TCP minimum retransmission timeout on the rail routes (``ip route ... rto_min``); None keeps
    the kernel default (200 ms). The incast penalty per lost window scales with it."""
    sender_queue_bytes: int | None = None
    """Bytes one TCP socket may keep queued below it on its node's NIC (TCP small queues,
    ``net.ipv4.tcp_limit_output_bytes`` of the node namespaces); None keeps the kernel default
    (4 MiB). The NIC's HTB queue holds what the sockets push into it: at a low shaped rate the
    default lets one socket queue seconds of data, and the acknowledgements that a node sends to
    its peers (in the same TCP stream as its own payload) wait behind it, so a bidirectional
    exchange stalls in slow start. An RDMA NIC has no such queue."""
    mtu: int = 1500
    """MTU of every rail NIC and switch port (RoCE fabrics use 4096). Larger packets cost the host
    fewer per-packet kernel cycles per byte; scale ``port_buffer_bytes`` with it."""
    prefix: str = "rw"
    """Start of every namespace and interface name (lowercase letters and digits, 1-4 chars);
    ``down(prefix)`` removes everything starting with it."""
    run_id: str = field(default_factory=lambda: secrets.token_hex(2))
    """Short unique id appended to ``prefix`` (lowercase hex, 1-4 chars)."""

    def __post_init__(self) -> None:
        if not isinstance(self.nodes, int) or not 1 <= self.nodes <= 250:
            raise ValueError(f"nodes must be an integer in 1..250, got {self.nodes!r}")
        if not isinstance(self.gpus_per_node, int) or not 1 <= self.gpus_per_node <= 64:
            raise ValueError(
                f"gpus_per_node must be an integer in 1..64, got {self.gpus_per_node!r}"
            )
        if not self.rail_mbit > 0:
            raise ValueError(f"rail_mbit must be > 0 (Mbit/s), got {self.rail_mbit!r}")
        if not isinstance(self.mtu, int) or not 1280 <= self.mtu <= 9000:
            raise ValueError(f"mtu must be an integer in 1280..9000 bytes, got {self.mtu!r}")
        if not isinstance(self.port_buffer_bytes, int) or self.port_buffer_bytes < self.mtu + 100:
            raise ValueError(
                f"port_buffer_bytes must be an integer >= mtu + 100 = {self.mtu + 100} (one "
                f"MTU-sized packet), got {self.port_buffer_bytes!r}"
            )
        if self.rto_min_ms is not None and not (
            isinstance(self.rto_min_ms, int) and 1 <= self.rto_min_ms <= 200
        ):
            raise ValueError(
                f"rto_min_ms must be None (kernel default) or an integer in 1..200, "
                f"got {self.rto_min_ms!r}"
            )
        if self.sender_queue_bytes is not None and not (
            isinstance(self.sender_queue_bytes, int) and self.sender_queue_bytes >= 2 * self.mtu
        ):
            raise ValueError(
                f"sender_queue_bytes must be None (kernel default) or an integer >= 2 x mtu = "
                f"{2 * self.mtu}, got {self.sender_queue_bytes!r}"
            )
        if not re.fullmatch(r"[a-z][a-z0-9]{0,3}", self.prefix):
            raise ValueError(
                f"prefix must be 1-4 lowercase letters/digits starting with a letter, "
                f"got {self.prefix!r}"
            )
        if not re.fullmatch(r"[0-9a-f]{1,4}", self.run_id):
            raise ValueError(f"run_id must be 1-4 lowercase hex digits, got {self.run_id!r}")
        # Longest name: 4 + 4 + "n249" + "r63" = 15 chars, the Linux limit (IFNAMSIZ - 1).
        assert len(self.switch_ifname(self.nodes - 1, self.gpus_per_node - 1)) <= _IFNAMSIZ

    # Names and addresses -------------------------------------------------------------------
    @property
    def name(self) -> str:
        """Unique name of this testbed: ``prefix + run_id``."""
        return self.prefix + self.run_id

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def fabric_ns(self) -> str:
        return f"{self.name}-fab"

    def node_ns(self, node: int) -> str:
        return f"{self.name}-n{node}"

    def rail_ifname(self, rail: int) -> str:
        """Node-side NIC of rail ``rail`` (same name in every node namespace)."""
        return f"{self.name}r{rail}"

    def switch_ifname(self, node: int, rail: int) -> str:
        """Switch port (fabric side of the veth) facing node ``node`` on rail ``rail``."""
        return f"{self.name}n{node}r{rail}"

    def bridge_name(self, rail: int) -> str:
        return f"{self.name}b{rail}"

    def rail_ip(self, node: int, rail: int) -> str:
        """Address of GPU (node, rail) on rail ``rail``'s subnet."""
        return f"{_SUBNET}.{rail}.{node + 1}"

    def router_ip(self, rail: int) -> str:
        """Fabric router address on rail ``rail``'s subnet (forwards between rails)."""
        return f"{_SUBNET}.{rail}.254"

    @property
    def mgmt_ifname(self) -> str:
        """Node-side NIC of the unshaped management network (same name in every node namespace)."""
        return f"{self.name}m"

    def mgmt_switch_ifname(self, node: int) -> str:
        return f"{self.name}n{node}m"

    @property
    def mgmt_bridge_name(self) -> str:
        return f"{self.name}bm"

    def mgmt_ip(self, node: int) -> str:
        """Address of node ``node`` on the management network."""
        return f"{_SUBNET}.{_MGMT_OCTET}.{node + 1}"

    @property
    def master_addr(self) -> str:
        """Rendezvous (TCPStore) address: node 0 on the management network (survives rail
        faults)."""
        return self.mgmt_ip(0)


# Shell helpers ---------------------------------------------------------------------------------
def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(
            f"testbed command failed (rc={proc.returncode}): {' '.join(argv)}\n"
            f"{proc.stderr.strip()}"
        )
    return proc


def _sysctl(ns: str, key: str, value: str) -> None:
    _run("ip", "netns", "exec", ns, "sysctl", "-qw", f"{key}={value}")


def check_prerequisites() -> str | None:
    """Return None if the testbed can run here, else a sentence saying what is missing."""
    missing = []
    if os.geteuid() != 0:
        missing.append("root privileges (network namespaces need CAP_NET_ADMIN; run as root)")
    for tool in ("ip", "tc", "sysctl"):
        if shutil.which(tool) is None:
            missing.append(f"the `{tool}` command (install iproute2 / procps)")
    if missing:
        return "testbed unavailable: missing " + "; ".join(missing)
    probe = f"rwprobe{os.getpid() % 100000}"
    proc = _run("ip", "netns", "add", probe, check=False)
    if proc.returncode != 0:
        return f"testbed unavailable: `ip netns add` failed: {proc.stderr.strip()}"
    _run("ip", "netns", "del", probe, check=False)
    return None


# Bring-up / tear-down --------------------------------------------------------------------------
_live: dict[str, TestbedSpec] = {}
_handlers_installed = False
_lock = threading.Lock()


def up(spec: TestbedSpec, *, keep: bool = False) -> TestbedSpec:
    """Create the namespaces, bridges, veths, addresses, routes and shaping of ``spec``.

    Registers clean-up on interpreter exit, SIGINT and SIGTERM, unless ``keep`` is true (a testbed
    that outlives this process, e.g. ``railwave testbed up``; remove it with ``down(spec.name +
    "-")``). If anything fails half-way, whatever was made is removed before the error propagates.

    Raises:
        RuntimeError: the prerequisites are missing (message says which) or a command failed.
    """
    reason = check_prerequisites()
    if reason is not None:
        raise RuntimeError(reason)
    if any(ns.startswith(spec.name + "-") for ns in _list_netns()):
        raise RuntimeError(
            f"testbed {spec.name!r} already exists; call down({spec.name!r}) or use another run_id"
        )
    if not keep:
        _install_cleanup()
        with _lock:
            _live[spec.name] = spec
    try:
        _build(spec)
    except BaseException:
        down(spec)
        raise
    return spec


def _build(spec: TestbedSpec) -> None:
    fab = spec.fabric_ns
    _run("ip", "netns", "add", fab)
    for n in range(spec.nodes):
        _run("ip", "netns", "add", spec.node_ns(n))
    for ns in [fab] + [spec.node_ns(n) for n in range(spec.nodes)]:
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        # Replies may come back on another rail than the request left on; do not drop them.
        _sysctl(ns, "net.ipv4.conf.all.rp_filter", "0")
        _sysctl(ns, "net.ipv4.conf.default.rp_filter", "0")
        # No IPv6 chatter (router solicitations, MLD) in the NIC byte counters.
        for key in ("net.ipv6.conf.all.disable_ipv6", "net.ipv6.conf.default.disable_ipv6"):
            _run("ip", "netns", "exec", ns, "sysctl", "-qw", f"{key}=1", check=False)
    _sysctl(fab, "net.ipv4.ip_forward", "1")
    if spec.sender_queue_bytes is not None:
        for n in range(spec.nodes):
            _sysctl(
                spec.node_ns(n), "net.ipv4.tcp_limit_output_bytes", str(spec.sender_queue_bytes)
            )
    for rail in range(spec.gpus_per_node):
        br = spec.bridge_name(rail)
        _run("ip", "-n", fab, "link", "add", br, "type", "bridge")
        _run("ip", "-n", fab, "addr", "add", f"{spec.router_ip(rail)}/24", "dev", br)
        _run("ip", "-n", fab, "link", "set", br, "up")
    _run("ip", "-n", fab, "link", "add", spec.mgmt_bridge_name, "type", "bridge")
    _run("ip", "-n", fab, "link", "set", spec.mgmt_bridge_name, "up")
    for n in range(spec.nodes):
        node_ns = spec.node_ns(n)
        sw, nic = spec.mgmt_switch_ifname(n), spec.mgmt_ifname
        _run(
            "ip",
            "-n",
            fab,
            "link",
            "add",
            sw,
            "type",
            "veth",
            "peer",
            "name",
            nic,
            "netns",
            node_ns,
        )
        _run("ip", "-n", fab, "link", "set", sw, "master", spec.mgmt_bridge_name, "up")
        _run("ip", "-n", node_ns, "addr", "add", f"{spec.mgmt_ip(n)}/24", "dev", nic)
        _run("ip", "-n", node_ns, "link", "set", nic, "up")
        for rail in range(spec.gpus_per_node):
            sw, nic = spec.switch_ifname(n, rail), spec.rail_ifname(rail)
            _run(
                "ip",
                "-n",
                fab,
                "link",
                "add",
                sw,
                "type",
                "veth",
                "peer",
                "name",
                nic,
                "netns",
                node_ns,
            )
            # One MTU-sized segment per packet: queues count real packets, not 64 KB GSO blobs.
            _run(
                "ip",
                "-n",
                fab,
                "link",
                "set",
                sw,
                "gso_max_segs",
                "1",
                "mtu",
                str(spec.mtu),
                "master",
                spec.bridge_name(rail),
            )
            _run("ip", "-n", node_ns, "link", "set", nic, "gso_max_segs", "1", "mtu", str(spec.mtu))
            _run("ip", "-n", node_ns, "addr", "add", f"{spec.rail_ip(n, rail)}/24", "dev", nic)
            _run("ip", "-n", fab, "link", "set", sw, "up")
            _run("ip", "-n", node_ns, "link", "set", nic, "up")
            _run(
                "ip",
                "-n",
                node_ns,
                "rule",
                "add",
                "from",
                spec.rail_ip(n, rail),
                "table",
                str(_TABLE_BASE + rail),
                "pref",
                str(1000 + rail),
            )
            _add_rail_routes(spec, n, rail)
            _shape(fab, sw, spec.rail_mbit, spec.port_buffer_bytes, spec.mtu)
            _shape(node_ns, nic, spec.rail_mbit, None, spec.mtu)


def _add_rail_routes(spec: TestbedSpec, node: int, rail: int) -> None:
    """Policy table of GPU (node, rail): its own subnet on-link, everything else via the fabric.
    Also re-states the main table's on-link route of the rail, to carry ``rto_min``."""
    ns, nic, table = spec.node_ns(node), spec.rail_ifname(rail), str(_TABLE_BASE + rail)
    src, subnet = spec.rail_ip(node, rail), f"{_SUBNET}.{rail}.0/24"
    rto = [] if spec.rto_min_ms is None else ["rto_min", f"{spec.rto_min_ms}ms"]
    _run(
        "ip",
        "-n",
        ns,
        "route",
        "replace",
        subnet,
        "dev",
        nic,
        "proto",
        "kernel",
        "scope",
        "link",
        "src",
        src,
        *rto,
    )
    _run("ip", "-n", ns, "route", "replace", subnet, "dev", nic, "src", src, "table", table, *rto)
    _run(
        "ip",
        "-n",
        ns,
        "route",
        "replace",
        "default",
        "via",
        spec.router_ip(rail),
        "dev",
        nic,
        "src",
        src,
        "table",
        table,
        *rto,
    )


def _shape(ns: str, dev: str, mbit: float, queue_bytes: int | None, mtu: int = 1500) -> None:
    rate = f"{int(mbit * 1000)}kbit"
    _run(
        "ip",
        "netns",
        "exec",
        ns,
        "tc",
        "qdisc",
        "add",
        "dev",
        dev,
        "root",
        "handle",
        "1:",
        "htb",
        "default",
        "1",
    )
    _run(
        "ip",
        "netns",
        "exec",
        ns,
        "tc",
        "class",
        "add",
        "dev",
        dev,
        "parent",
        "1:",
        "classid",
        "1:1",
        "htb",
        "rate",
        rate,
        "ceil",
        rate,
        "quantum",
        str(mtu + 14),
    )
    if queue_bytes is not None:
        _run(
            "ip",
            "netns",
            "exec",
            ns,
            "tc",
            "qdisc",
            "add",
            "dev",
            dev,
            "parent",
            "1:1",
            "handle",
            "10:",
            "bfifo",
            "limit",
            str(queue_bytes),
        )


def _list_netns() -> list[str]:
    out = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def list_leftovers(spec_or_prefix: TestbedSpec | str) -> list[str]:
    """Namespaces and caller-namespace interfaces whose names start with the spec's name/prefix."""
    prefix = (
        spec_or_prefix.name + "-" if isinstance(spec_or_prefix, TestbedSpec) else spec_or_prefix
    )
    ifprefix = prefix.rstrip("-")
    found = [ns for ns in _list_netns() if ns.startswith(prefix)]
    links = json.loads(_run("ip", "-j", "link", "show", check=False).stdout or "[]")
    found += [f"link:{ln['ifname']}" for ln in links if ln.get("ifname", "").startswith(ifprefix)]
    return found


def down(spec_or_prefix: TestbedSpec | str) -> list[str]:
    """Remove a testbed, or every testbed whose names start with a prefix (crash leftovers).

    Kills the processes still running inside the matching namespaces (SIGKILL, by pid), deletes
    the namespaces (which destroys their bridges and veths) and any matching interface left in the
    caller's namespace. Idempotent.

    Returns:
        The removed namespace and interface names.
    """
    if isinstance(spec_or_prefix, TestbedSpec):
        prefix = spec_or_prefix.name + "-"
        with _lock:
            _live.pop(spec_or_prefix.name, None)
    else:
        if not spec_or_prefix:
            raise ValueError("down(prefix): prefix must be non-empty, got ''")
        prefix = spec_or_prefix
    removed = []
    for item in list_leftovers(prefix):
        if item.startswith("link:"):
            _run("ip", "link", "del", item[5:], check=False)
        else:
            pids = _run("ip", "netns", "pids", item, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _run("ip", "netns", "del", item, check=False)
        removed.append(item)
    return removed


def _cleanup_all() -> None:
    with _lock:
        specs = list(_live.values())
    for spec in specs:
        try:
            down(spec)
        except Exception:  # noqa: BLE001 - best effort at exit; never mask the real error
            pass


def _install_cleanup() -> None:
    """atexit + SIGINT/SIGTERM handlers that take down live testbeds, then chain to the old ones."""
    global _handlers_installed
    with _lock:
        if _handlers_installed:
            return
        _handlers_installed = True
    atexit.register(_cleanup_all)
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in (signal.SIGINT, signal.SIGTERM):
        previous = signal.getsignal(signum)

        def handler(sig, frame, _previous=previous):  # type: ignore[no-untyped-def]
            _cleanup_all()
            if callable(_previous):
                _previous(sig, frame)
            elif _previous == signal.SIG_DFL:
                signal.signal(sig, signal.SIG_DFL)
                os.kill(os.getpid(), sig)

        signal.signal(signum, handler)


# Measurement and faults ------------------------------------------------------------------------
def nic_counters(spec: TestbedSpec) -> dict[tuple[int, int], tuple[int, int]]:
    """Kernel byte counters of every NIC, read on the node side of each veth.

    Returns:
        ``{(node, rail): (tx_bytes, rx_bytes)}``: tx = node -> switch, rx = switch -> node.
    """
    out: dict[tuple[int, int], tuple[int, int]] = {}
    for n in range(spec.nodes):
        links = json.loads(_run("ip", "-n", spec.node_ns(n), "-j", "-s", "link", "show").stdout)
        by_name = {ln["ifname"]: ln["stats64"] for ln in links}
        for rail in range(spec.gpus_per_node):
            st = by_name[spec.rail_ifname(rail)]
            out[(n, rail)] = (int(st["tx"]["bytes"]), int(st["rx"]["bytes"]))
    return out


def _check_port(spec: TestbedSpec, node: int, rail: int) -> None:
    if not (0 <= node < spec.nodes and 0 <= rail < spec.gpus_per_node):
        raise ValueError(
            f"(node, rail) = ({node}, {rail}) is outside the testbed "
            f"({spec.nodes} nodes x {spec.gpus_per_node} rails)"
        )


def fail_rail(spec: TestbedSpec, node: int, rail: int) -> None:
    """Take NIC (node, rail) down (``ip link set down``): it neither sends nor receives."""
    _check_port(spec, node, rail)
    _run("ip", "-n", spec.node_ns(node), "link", "set", spec.rail_ifname(rail), "down")


def restore_rail(spec: TestbedSpec, node: int, rail: int) -> None:
    """Bring NIC (node, rail) back up and re-install its policy routes (the kernel drops them)."""
    _check_port(spec, node, rail)
    _run("ip", "-n", spec.node_ns(node), "link", "set", spec.rail_ifname(rail), "up")
    _add_rail_routes(spec, node, rail)


# ---------------------------------------------------------------------------- saved specs
def _spec_path(state_dir: str | Path, name: str) -> Path:
    return Path(state_dir) / f"{name}.json"


def save_spec(spec: TestbedSpec, state_dir: str | Path) -> Path:
    """Save the spec of a testbed that stays up (``up(keep=True)``) as ``STATE_DIR/NAME.json``."""
    path = _spec_path(state_dir, spec.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(spec)))
    return path


def load_spec(name: str, state_dir: str | Path) -> TestbedSpec:
    """The saved spec of the testbed ``name`` (``save_spec``)."""
    path = _spec_path(state_dir, name)
    if not path.exists():
        raise ValueError(
            f"--name {name!r}: no saved testbed at {path}; bring one up with `railwave testbed up`"
        )
    return TestbedSpec(**json.loads(path.read_text()))


def forget_spec(name: str, state_dir: str | Path) -> None:
    """Remove the saved spec of the testbed ``name``, if there is one."""
    _spec_path(state_dir, name).unlink(missing_ok=True)
