"""The environment report of ``railwave doctor`` (and the first step of ``make gpu-check``).

``collect_environment`` gathers: the versions of Python, torch, CUDA (torch's and nvcc's), NCCL,
Megatron-Core, Transformer Engine and deep_ep; whether the compiled ops loaded, for CPU and
CUDA, and the CUDA architectures torch was built for; the GPUs and the RDMA NICs as the OS shows
them (``/sys/class/infiniband``; ``nvidia-smi topo -m`` where present); the launcher's
variables; the RailWave config it would use (given, else ``$RAILWAVE_CONFIG``, else the
defaults); and a self-test: every path of one small layer on the in-process virtual cluster
(2 nodes x 2 GPUs, CPU), bitwise equal across paths and within 1e-5 of the float64 reference.
Nothing here needs a GPU. Host only.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Any

__all__ = ["collect_environment", "read_nics", "self_test"]


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

    out: dict[str, Any] = {
        "cpu": ops.compiled_for(torch.device("cpu")),
        "load_error": ops.load_error(),
    }
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
        gpus.append(
            {
                "index": i,
                "name": p.name,
                "memory_gib": round(p.total_memory / 2**30, 1),
                "sm": f"{p.major}.{p.minor}",
                "multiprocessors": p.multi_processor_count,
            }
        )
    return gpus


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def read_nics(root: str = "/sys/class/infiniband") -> list[dict[str, Any]]:
    """RDMA devices and their ports as sysfs shows them (empty where there are none)."""
    if not os.path.isdir(root):
        return []
    nics = []
    for dev in sorted(os.listdir(root)):
        ports_dir = os.path.join(root, dev, "ports")
        ports = []
        for port in sorted(os.listdir(ports_dir)) if os.path.isdir(ports_dir) else []:
            base = os.path.join(ports_dir, port)
            ports.append(
                {
                    "port": port,
                    "state": _read(os.path.join(base, "state")),
                    "rate": _read(os.path.join(base, "rate")),
                    "link_layer": _read(os.path.join(base, "link_layer")),
                }
            )
        nics.append(
            {
                "device": dev,
                "numa_node": _read(os.path.join(root, dev, "device", "numa_node")),
                "ports": ports,
            }
        )
    return nics


def _config(path: str | None) -> dict[str, Any]:
    from megatron_railwave.config import load_config

    source = path or os.environ.get("RAILWAVE_CONFIG")
    try:
        cfg = load_config(source)
    except ValueError as exc:
        return {"source": source or "defaults", "error": str(exc)}
    return {"source": source or "defaults", "config": cfg.to_dict()}


def self_test() -> dict[str, Any]:
    """Every path of one small layer (forward + backward) once on the virtual cluster (2 x 2, CPU):
    bitwise equal across paths and within 1e-5 of the float64 closed form."""
    import time

    import torch

    from megatron_railwave.lab.bench.virtual_exchange import (
        VirtualSpec,
        dense_reference,
        make_virtual_inputs,
        run_virtual_layer,
    )
    from megatron_railwave.topology import RailTopology

    start = time.perf_counter()
    spec = VirtualSpec(
        topology=RailTopology(name="doctor-2x2", num_nodes=2, gpus_per_node=2),
        tokens=16,
        hidden=8,
        experts=8,
        topk=2,
        dtype="fp32",
        device="cpu",
    )
    keys = ("out", "grad_hidden", "grad_probs")
    try:
        inputs = make_virtual_inputs(spec)
        results = {path: run_virtual_layer(spec, inputs, path) for path in spec.paths}
        w = spec.topology.world_size
        base = results[spec.paths[0]]
        equal = all(
            torch.equal(res[k][r], base[k][r])
            for res in results.values()
            for k in keys
            for r in range(w)
        )
        worst = 0.0
        for r in range(w):
            ref = dense_reference(spec, inputs, r)
            for k in keys:
                scale = float(ref[k].abs().max()) or 1.0
                worst = max(worst, float((base[k][r].double() - ref[k]).abs().max()) / scale)
    except Exception as exc:  # noqa: BLE001 - the report names any failure
        return {
            "ok": False,
            "error": f"{type(exc).__name__}: {exc}",
            "seconds": round(time.perf_counter() - start, 2),
        }
    return {
        "ok": bool(equal and worst <= 1e-5),
        "all_bitwise_equal": equal,
        "max_rel_error": worst,
        "paths": list(spec.paths),
        "seconds": round(time.perf_counter() - start, 2),
    }


def collect_environment(*, config: str | None = None, run_self_test: bool = True) -> dict[str, Any]:
    """The report as a dict (JSON-ready)."""
    topo = _command(["nvidia-smi", "topo", "-m"])
    report: dict[str, Any] = {
        "schema": "railwave.doctor/1",
        "versions": _versions(),
        "compiled_ops": _compiled_ops(),
        "gpus": _gpus(),
        "nics": read_nics(),
        "nvidia_smi_topo": topo,
        "launcher": {
            k: os.environ.get(k)
            for k in (
                "RANK",
                "LOCAL_RANK",
                "LOCAL_WORLD_SIZE",
                "GROUP_RANK",
                "WORLD_SIZE",
                "MASTER_ADDR",
            )
        },
        "railwave_config": _config(config),
    }
    if run_self_test:
        report["self_test"] = self_test()
    return report
