"""Run N * G torch.distributed (gloo) workers on a testbed, one per GPU, inside node namespaces.

Letters: N nodes, G GPUs per node (= rails), W = N * G ranks; global rank = node * G + local.

Process groups inside a worker (see :func:`make_groups`):
    default group  every rank; gloo device bound to the rank's own rail NIC
                   (``GLOO_SOCKET_IFNAME``), rendezvous on node 0's management address. gloo binds
                   only its listening socket, so a cross-rail pair's connection runs on the rail of
                   the listening side (the kernel picks the node's NIC on that subnet).
    node group n   the G ranks of node n; device bound to ``lo`` (node-local, the NVLink stand-in,
                   never shaped).
    rail group l   rank (n, l) of every node n; device bound to rail l's NIC, so its traffic
                   crosses rail l's leaf switch only.
    control group  every rank, on the unshaped management network (:func:`make_control_group`):
                   barriers and small control collectives that must survive a failed rail NIC.
torch 2.13 reads ``GLOO_SOCKET_IFNAME`` each time it builds a gloo backend, and ``new_group``
ignores ``pg_options`` for gloo (so ``ProcessGroupGloo._Options._devices`` cannot be passed through
it); :func:`make_groups` therefore sets the variable around each ``new_group`` call. Node-local
pairs use ``lo`` either way: the kernel routes between a namespace's own addresses over loopback.
"""

from __future__ import annotations

import importlib
import os
import pickle
import random
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from megatron_railwave.lab.testbed.netns import TestbedSpec

__all__ = [
    "RailGroups",
    "WorkerContext",
    "current_context",
    "make_control_group",
    "make_groups",
    "run_workers",
]

_STDERR_TAIL = 3000
_REPO_ROOT = str(Path(__file__).resolve().parents[3])


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerContext:
    """What a worker knows about itself; passed as the first argument of the target function."""

    spec: TestbedSpec
    rank: int
    """Global rank = node * G + local."""
    node: int
    local: int
    """Local GPU index on the node; also its rail index."""

    @property
    def rail_ifname(self) -> str:
        return self.spec.rail_ifname(self.local)

    @property
    def rail_ip(self) -> str:
        return self.spec.rail_ip(self.node, self.local)


@dataclass(frozen=True, kw_only=True, slots=True)
class RailGroups:
    """Process groups of one worker. Collective creation: every rank gets every group object;
    entries for groups the rank is not in are ``GroupMember.NON_GROUP_MEMBER``."""

    node: Any
    """This rank's node group (G ranks, loopback)."""
    rail: Any
    """This rank's rail group (N ranks, rail NIC)."""
    node_groups: tuple[Any, ...]
    """Node group of every node, index = node."""
    rail_groups: tuple[Any, ...]
    """Rail group of every rail, index = rail."""


_context: WorkerContext | None = None


def current_context() -> WorkerContext:
    """The context of the running worker (raises outside a testbed worker)."""
    if _context is None:
        raise RuntimeError("current_context() is only available inside a testbed worker")
    return _context


@contextmanager
def _gloo_ifname(ifname: str) -> Iterator[None]:
    old = os.environ.get("GLOO_SOCKET_IFNAME")
    os.environ["GLOO_SOCKET_IFNAME"] = ifname
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)
        else:
            os.environ["GLOO_SOCKET_IFNAME"] = old


def make_groups(ctx: WorkerContext | None = None) -> RailGroups:
    """Create the N node groups (loopback) and G rail groups (rail NICs), in the same order on all
    ranks.

    Collective: yes (default group; every rank must call it).
    """
    import torch.distributed as dist

    ctx = ctx or current_context()
    nodes, gpus = ctx.spec.nodes, ctx.spec.gpus_per_node
    node_groups = []
    with _gloo_ifname("lo"):
        for n in range(nodes):
            node_groups.append(dist.new_group([n * gpus + g for g in range(gpus)], backend="gloo"))
    rail_groups = []
    # Only members build a backend, and every member of rail group l owns NIC l.
    with _gloo_ifname(ctx.rail_ifname):
        for rail in range(gpus):
            rail_groups.append(
                dist.new_group([n * gpus + rail for n in range(nodes)], backend="gloo")
            )
    return RailGroups(
        node=node_groups[ctx.node],
        rail=rail_groups[ctx.local],
        node_groups=tuple(node_groups),
        rail_groups=tuple(rail_groups),
    )


def make_control_group(ctx: WorkerContext | None = None) -> Any:
    """A group of every rank on the management network (not shaped, not a rail).

    Use it for barriers and small control collectives that must keep working, and stay out of
    the rail NICs' byte counters, when a rail is taken down mid-run.

    Collective: yes (default group; every rank must call it, in the same order as other groups).
    """
    import torch.distributed as dist

    ctx = ctx or current_context()
    with _gloo_ifname(ctx.spec.mgmt_ifname):
        return dist.new_group(list(range(ctx.spec.world_size)), backend="gloo")


# Parent side -----------------------------------------------------------------------------------
def _tail(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return "<no log>"
    return data[-_STDERR_TAIL:].decode(errors="replace")


def _kill_all(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def run_workers(
    spec: TestbedSpec, target: str, args: dict[str, Any] | None = None, timeout_s: float = 120.0
) -> list[Any]:
    """Run ``target(ctx, **args)`` on every rank of a testbed that is up; return per-rank results.

    Args:
        spec: a testbed already brought up with :func:`~megatron_railwave.lab.testbed.netns.up`.
        target: ``"package.module:function"``, importable in the worker (the repo root and the
            current directory are on its ``PYTHONPATH``). Its return value must pickle.
        args: keyword arguments for ``target`` (must pickle).
        timeout_s: hard limit for the whole run, rendezvous included.

    Returns:
        ``results[rank]`` for rank 0..W-1.

    Raises:
        RuntimeError: a worker exited non-zero; all others are killed; the message carries the
            first failing rank's stderr tail.
        TimeoutError: ``timeout_s`` passed; all workers are killed; tails of the ranks that were
            still running are included.
    """
    if ":" not in target:
        raise ValueError(f"target must look like 'module:function', got {target!r}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    run_dir = Path(tempfile.mkdtemp(prefix=f"{spec.name}-run-"))
    port = random.randint(20000, 40000)  # namespaces are private: any port is free
    (run_dir / "config.pkl").write_bytes(
        pickle.dumps(
            {"spec": asdict(spec), "target": target, "args": args or {}, "timeout_s": timeout_s}
        )
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (_REPO_ROOT, os.getcwd(), env.get("PYTHONPATH", "")) if p
    )
    env.update(
        MASTER_ADDR=spec.master_addr,
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[Path] = []
    try:
        for rank in range(spec.world_size):
            node, local = divmod(rank, spec.gpus_per_node)
            log = run_dir / f"rank{rank}.log"
            logs.append(log)
            rank_env = dict(env, GLOO_SOCKET_IFNAME=spec.rail_ifname(local))
            with open(log, "wb") as fh:
                procs.append(
                    subprocess.Popen(
                        [
                            "ip",
                            "netns",
                            "exec",
                            spec.node_ns(node),
                            sys.executable,
                            "-m",
                            "megatron_railwave.lab.testbed._worker",
                            str(run_dir),
                            str(rank),
                        ],
                        stdin=subprocess.DEVNULL,
                        stdout=fh,
                        stderr=subprocess.STDOUT,
                        env=rank_env,
                        start_new_session=True,
                    )
                )
        deadline = time.monotonic() + timeout_s
        while True:
            codes = [p.poll() for p in procs]
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank = failed[0]
                _kill_all(procs)
                node, local = divmod(rank, spec.gpus_per_node)
                others = {r: procs[r].returncode for r in range(len(procs)) if r != rank}
                raise RuntimeError(
                    f"testbed worker rank {rank} (node {node}, gpu {local}) of {target} exited "
                    f"with rc={codes[rank]}; killed the others (rc {others}). Log tail:\n"
                    f"{_tail(logs[rank])}"
                )
            if all(c == 0 for c in codes):
                break
            if time.monotonic() > deadline:
                running = [r for r, c in enumerate(codes) if c is None]
                _kill_all(procs)
                tails = "\n".join(f"--- rank {r}:\n{_tail(logs[r])[-800:]}" for r in running)
                raise TimeoutError(
                    f"testbed run of {target} exceeded timeout_s={timeout_s}; killed all workers; "
                    f"ranks still running: {running}\n{tails}"
                )
            time.sleep(0.05)
        results = []
        for rank in range(spec.world_size):
            path = run_dir / f"result{rank}.pkl"
            if not path.exists():
                raise RuntimeError(
                    f"testbed worker rank {rank} exited 0 but wrote no result; log tail:\n"
                    f"{_tail(logs[rank])}"
                )
            results.append(pickle.loads(path.read_bytes()))
        return results
    finally:
        _kill_all(procs)
        for path in run_dir.iterdir():
            path.unlink()
        run_dir.rmdir()


# Worker side -----------------------------------------------------------------------------------
def _worker_main(run_dir: str, rank: int) -> None:
    global _context
    import torch.distributed as dist

    cfg = pickle.loads((Path(run_dir) / "config.pkl").read_bytes())
    spec = TestbedSpec(**cfg["spec"])
    node, local = divmod(rank, spec.gpus_per_node)
    _context = WorkerContext(spec=spec, rank=rank, node=node, local=local)
    module_name, func_name = cfg["target"].split(":", 1)
    func = getattr(importlib.import_module(module_name), func_name)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
        rank=rank,
        world_size=spec.world_size,
        timeout=timedelta(seconds=cfg["timeout_s"]),
    )
    try:
        result = func(_context, **cfg["args"])
        tmp = Path(run_dir) / f"result{rank}.pkl.tmp"
        tmp.write_bytes(pickle.dumps(result))
        tmp.rename(Path(run_dir) / f"result{rank}.pkl")
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        # Exit now: a clean destroy_process_group would wait for peers that are still blocked.
        os._exit(1)
    dist.destroy_process_group()
