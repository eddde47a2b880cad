"""``railwave doctor``: an environment report to paste into a bug report (and the first step of
``make gpu-check``).

It reports: the versions of Python, torch, CUDA (torch's and nvcc's), NCCL, Megatron-Core,
Transformer Engine and deep_ep; whether the compiled ops loaded, for CPU and CUDA, and the CUDA
architectures torch was built for; the GPUs and the RDMA NICs as the OS shows them
(``/sys/class/infiniband``; ``nvidia-smi topo -m`` where present); the RailWave config it would
use (``--config``, else ``$RAILWAVE_CONFIG``, else the defaults); and a self-test: every path of
one small layer on the in-process virtual cluster (2 nodes x 2 GPUs, CPU), bitwise equal across
paths and within 1e-5 of the float64 reference (about a second). Nothing here needs a GPU.
Exit status: 0, or 1 when the self-test fails or the config does not load.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
from typing import Any

from megatron_railwave.commands import _outputs, _render

__all__ = ["register", "run", "collect"]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "doctor",
        help="environment report: versions, compiled ops, GPUs and NICs, config, a virtual-cluster self-test",
        description="Print what this environment gives RailWave (paste it into bug reports).",
    )
    parser.add_argument("--config", default=None, metavar="YAML",
                        help="RailWave config to report (default: $RAILWAVE_CONFIG, else the defaults)")
    parser.add_argument("--no-self-test", action="store_true", help="skip the virtual-cluster self-test")
    parser.add_argument("--json", default=None, metavar="FILE", help="write the report as JSON")
    _outputs.declare_outputs(parser, files=("json",))
    parser.set_defaults(handler=run)


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _command(argv: list[str], timeout_s: float = 5.0) -> str | None:
    """stdout of ``argv``, or None when the tool is missing or fails."""
    if shutil.which(argv[0]) is None:
        return None
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _versions() -> dict[str, Any]:
    import platform

    import torch

    nvcc = _command(["nvcc", "--version"])
    nccl = None
    if torch.cuda.is_available():
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001 - a torch without NCCL
            nccl = None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "nvcc": nvcc.splitlines()[-1] if nvcc else None,
        "nccl": nccl,
        "megatron_core": _version("megatron-core") or _version("megatron_core"),
        "transformer_engine": _version("transformer-engine") or _version("transformer_engine"),
        "deep_ep": _version("deep_ep") or _version("deep-ep"),
        "megatron_railwave": _version("megatron-railwave"),
    }


def _compiled_ops() -> dict[str, Any]:
    import torch

    from megatron_railwave import ops

    out: dict[str, Any] = {"cpu": ops.compiled_for(torch.device("cpu")), "load_error": ops.load_error()}
    out["cuda"] = ops.compiled_for(torch.device("cuda")) if torch.cuda.is_available() else None
    out["torch_cuda_arch_list"] = torch.cuda.get_arch_list() if torch.version.cuda else []
    out["TORCH_CUDA_ARCH_LIST"] = os.environ.get("TORCH_CUDA_ARCH_LIST")
    return out


def _gpus() -> list[dict[str, Any]]:
    import torch

    if not torch.cuda.is_available():
        return []
    gpus = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        gpus.append({"index": i, "name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                     "sm": f"{p.major}.{p.minor}", "multiprocessors": p.multi_processor_count})
    return gpus


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _nics(root: str = "/sys/class/infiniband") -> list[dict[str, Any]]:
    """RDMA devices and their ports as sysfs shows them (empty where there are none)."""
    if not os.path.isdir(root):
        return []
    nics = []
    for dev in sorted(os.listdir(root)):
        ports_dir = os.path.join(root, dev, "ports")
        ports = []
        for port in sorted(os.listdir(ports_dir)) if os.path.isdir(ports_dir) else []:
            base = os.path.join(ports_dir, port)
            ports.append({"port": port, "state": _read(os.path.join(base, "state")),
                          "rate": _read(os.path.join(base, "rate")),
                          "link_layer": _read(os.path.join(base, "link_layer"))})
        nics.append({"device": dev, "numa_node": _read(os.path.join(root, dev, "device", "numa_node")),
                     "ports": ports})
    return nics


def _config(path: str | None) -> dict[str, Any]:
    from megatron_railwave.config import load_config

    source = path or os.environ.get("RAILWAVE_CONFIG")
    try:
        cfg = load_config(source)
    except ValueError as exc:
        return {"source": source or "defaults", "error": str(exc)}
    return {"source": source or "defaults", "config": cfg.to_dict()}


def _self_test() -> dict[str, Any]:
    """Every path of one small layer on the virtual cluster (CPU): equal bitwise, close to float64."""
    import time

    from megatron_railwave.lab.bench.virtual_exchange import VirtualSpec, simulate_exchange
    from megatron_railwave.topology import RailTopology

    start = time.perf_counter()
    spec = VirtualSpec(topology=RailTopology(name="doctor-2x2", num_nodes=2, gpus_per_node=2), tokens=24,
                       hidden=16, experts=8, topk=2, dtype="fp32", device="cpu")
    try:
        report = simulate_exchange(spec)
    except Exception as exc:  # noqa: BLE001 - the report names any failure
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}", "seconds": time.perf_counter() - start}
    worst = max(max(e.values()) for e in report["max_rel_error"].values())
    return {"ok": bool(report["all_bitwise_equal"] and worst <= 1e-5), "all_bitwise_equal": report["all_bitwise_equal"],
            "max_rel_error": worst, "host_syncs_per_layer": report["host_syncs_per_layer"],
            "seconds": round(time.perf_counter() - start, 2)}


def collect(*, config: str | None = None, self_test: bool = True) -> dict[str, Any]:
    """The report as a dict (JSON-ready)."""
    topo = _command(["nvidia-smi", "topo", "-m"])
    report: dict[str, Any] = {
        "schema": "railwave.doctor/1",
        "versions": _versions(),
        "compiled_ops": _compiled_ops(),
        "gpus": _gpus(),
        "nics": _nics(),
        "nvidia_smi_topo": topo,
        "launcher": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                                      "WORLD_SIZE", "MASTER_ADDR")},
        "railwave_config": _config(config),
    }
    if self_test:
        report["self_test"] = _self_test()
    return report


def run(args: argparse.Namespace) -> int:
    from megatron_railwave.commands._common import write_json

    report = collect(config=args.config, self_test=not args.no_self_test)
    v, c = report["versions"], report["compiled_ops"]
    _render.print_table("railwave doctor: versions", ["component", "version"],
                        [[k, "-" if val is None else val] for k, val in v.items()])
    _render.print_text(f"compiled ops: cpu {c['cpu']}, cuda {c['cuda']}; torch CUDA archs "
                       f"{' '.join(c['torch_cuda_arch_list']) or '-'}"
                       + (f"; load error: {c['load_error']}" if c["load_error"] else ""))
    gpus = report["gpus"]
    _render.print_text("GPUs: " + ("; ".join(f"{g['index']}: {g['name']} {g['memory_gib']} GiB sm_{g['sm']}"
                                             for g in gpus) if gpus else "none visible to torch"))
    nics = report["nics"]
    _render.print_text("RDMA NICs (/sys/class/infiniband): " + (
        "; ".join(f"{n['device']} " + ",".join(f"port {p['port']} {p['state']} {p['rate']}" for p in n["ports"])
                  for n in nics) if nics else "none"))
    if report["nvidia_smi_topo"]:
        _render.print_text("nvidia-smi topo -m:\n" + report["nvidia_smi_topo"])
    cfg = report["railwave_config"]
    _render.print_text(f"RailWave config ({cfg['source']}): " + (f"ERROR {cfg['error']}" if "error" in cfg
                                                                else str(cfg["config"])))
    status = 1 if "error" in cfg else 0
    if "self_test" in report:
        st = report["self_test"]
        _render.print_text(f"self-test (virtual cluster 2x2, CPU): {'ok' if st['ok'] else 'FAILED'} "
                           f"in {st['seconds']} s" + (f" ({st['error']})" if "error" in st else
                                                      f" (bitwise equal {st['all_bitwise_equal']}, "
                                                      f"max rel. error {st['max_rel_error']:.2e})"))
        status = status or (0 if st["ok"] else 1)
    if args.json:
        write_json(args.json, report)
    return status
