"""``ddpkit env``: one report of the distributed setup, to paste into a bug.

Versions, GPUs, the launcher's rank record, the relevant variables, the network and (unless
``torch=False``) the backends: the one section that imports torch. Every string goes through
:mod:`ddpkit.masking` (a MASTER_ADDR or an error message may quote a URL with its password),
and the text form escapes control characters, so one value is one line.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import socket
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ddpkit.cluster.detect import detect
from ddpkit.cluster.rendezvous.lookup import route_to
from ddpkit.errors import DdpkitError
from ddpkit.masking import MASKED, mask, mask_tree, printable
from ddpkit.tools import netinfo

__all__ = ["MASKED", "PREFIXES", "build_report", "format_report", "mask", "relevant_variables"]

PREFIXES = (
    "SLURM_",
    "MASTER_",
    "NCCL_",
    "GLOO_",
    "TORCH_",
    "TORCHELASTIC_",
    "DDPKIT_",
    "PET_",
    "CUDA_",
    "OMPI_",
    "PMI_",
)
_EXACT = {
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "OMP_NUM_THREADS",
    "NVIDIA_VISIBLE_DEVICES",
}
_PACKAGES = ("ddpkit", "torch", "numpy", "submitit", "torchx", "pydantic")


def relevant_variables(env: Mapping[str, str]) -> dict[str, str]:
    """The launcher / backend variables of ``env``, sorted, masked."""
    return {
        name: mask(name, value)
        for name, value in sorted(env.items())
        if name in _EXACT or name.startswith(PREFIXES)
    }


def _versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {"python": platform.python_version()}
    for package in _PACKAGES:
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = None
    return found


def _gpus() -> dict[str, Any]:
    """GPUs the driver lists, without torch: nvidia-smi, else /proc/driver/nvidia."""
    smi = shutil.which("nvidia-smi")
    if smi:
        query = "--query-gpu=index,name,uuid,memory.total,driver_version"
        try:
            done = subprocess.run(
                [smi, query, "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=10,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return {"source": "nvidia-smi", "error": str(exc), "devices": []}
        rows = [[f.strip() for f in line.split(",")] for line in done.stdout.splitlines()]
        return {"source": "nvidia-smi", "devices": [", ".join(row) for row in rows if row]}
    proc = Path("/proc/driver/nvidia/gpus")
    if proc.is_dir():
        devices = []
        for info in sorted(proc.glob("*/information")):
            text = dict(line.split(":", 1) for line in info.read_text().splitlines() if ":" in line)
            devices.append(f"{text.get('Model', '?').strip()} ({info.parent.name})")
        return {"source": str(proc), "devices": devices}
    return {"source": "none (no nvidia-smi, no /proc/driver/nvidia)", "devices": []}


def _launcher(env: Mapping[str, str]) -> dict[str, Any]:
    try:
        info = detect(env)
    except DdpkitError as exc:
        return {"error": str(exc)}
    record = asdict(info)
    record.pop("port_search")
    record["notes"] = list(info.notes)
    if info.port_search is not None:
        record["port_candidates"] = list(info.port_search.ports)
    return record


def _network(env: Mapping[str, str], hostname: str) -> dict[str, Any]:
    found = netinfo.interfaces()
    master = env.get("MASTER_ADDR", "").strip()
    route: dict[str, Any] | None = None
    if master:
        addresses = netinfo.resolve(master)
        local = route_to(addresses[0]) if addresses else None
        route = {
            "master_addr": master,
            "resolves_to": addresses,
            "local_address": local,
            "interface": netinfo.interface_of(local, found) if local else None,
        }
    return {
        "hostname": hostname,
        "hostname_resolves_to": netinfo.resolve(hostname),
        "interfaces": [asdict(i) for i in found],
        "route_to_master": route,
        "gloo": asdict(netinfo.gloo_choice(env, found, hostname)),
        "nccl": asdict(netinfo.nccl_choice(env, found)),
    }


def _backends() -> dict[str, Any]:
    """What torch says: needs ``import torch`` (and torch.distributed)."""
    import torch
    import torch.distributed as dist

    from ddpkit.tools.commtest import nccl_version

    cuda = torch.cuda.is_available()
    return {
        "torch": str(torch.__version__),
        "cuda_build": torch.version.cuda,
        "cuda_available": cuda,
        "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if cuda
        else [],
        "distributed": dist.is_available(),
        "gloo": dist.is_available() and dist.is_gloo_available(),
        "nccl": dist.is_available() and dist.is_nccl_available(),
        "nccl_version": nccl_version(),
        "mpi": dist.is_available() and dist.is_mpi_available(),
    }


def build_report(env: Mapping[str, str] | None = None, *, torch: bool = True) -> dict[str, Any]:
    """The whole report as plain data (what ``--json`` prints), credentials masked."""
    snapshot = dict(os.environ if env is None else env)
    hostname = socket.gethostname()
    report = {
        "versions": _versions(),
        "platform": {"system": platform.platform(), "executable": sys.executable},
        "gpus": _gpus() | {"CUDA_VISIBLE_DEVICES": snapshot.get("CUDA_VISIBLE_DEVICES")},
        "backends": _backends() if torch else {"skipped": "--no-torch"},
        "launcher": _launcher(snapshot),
        "variables": relevant_variables(snapshot),
        "network": _network(snapshot, hostname),
    }
    return dict(mask_tree(report))


def _lines(value: Any, indent: str) -> list[str]:
    if isinstance(value, dict):
        out = []
        for key, item in value.items():
            if isinstance(item, dict | list) and item:
                out += [f"{indent}{key}:", *_lines(item, indent + "  ")]
            else:
                out.append(f"{indent}{key}: {_scalar(item)}")
        return out
    if isinstance(value, list):
        return [
            f"{indent}- {_scalar(item) if not isinstance(item, dict) else _flat(item)}"
            for item in value
        ]
    return [f"{indent}{_scalar(value)}"]


def _flat(record: dict[str, Any]) -> str:
    return ", ".join(f"{k}={_scalar(v)}" for k, v in record.items())


def _scalar(value: Any) -> str:
    if value is None or value in ([], (), {}):
        return "-"
    if isinstance(value, list | tuple):
        return " ".join(printable(str(v)) for v in value)
    return printable(str(value))


def format_report(report: Mapping[str, Any]) -> str:
    """The plain-text form: one ``## section`` per key, ``key: value`` lines below."""
    out: list[str] = []
    for section, body in report.items():
        out += [f"## {section}", *(_lines(body, "  ") or ["  (none)"]), ""]
    return "\n".join(out).rstrip() + "\n"
