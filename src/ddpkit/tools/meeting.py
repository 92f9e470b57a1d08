"""How the doctor's ranks meet: a TCP store formed as the runtime forms it, every wait bounded.

* under torchrun / ``ddpkit run`` (``TORCHELASTIC_USE_AGENT_STORE``): every rank is a client
  of the agent's store at MASTER_ADDR:MASTER_PORT, under a prefix of its own;
* a SLURM step without MASTER_PORT: the runtime's port search
  (:func:`~ddpkit.worker.rendezvous.portsearch.host_store` / ``find_store``);
* otherwise rank 0 hosts the store on MASTER_PORT, where a port already in use is a FAIL, and
  the other ranks first probe the master
  (:func:`~ddpkit.worker.rendezvous.store.probe_master`), where no answer is a FAIL.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]  # public, not in __all__
from torch.distributed.distributed_c10d import Store

from ddpkit.cluster.rankinfo import RankInfo
from ddpkit.cluster.rendezvous.ports import PortSearch
from ddpkit.errors import RendezvousError
from ddpkit.tools.doctor_checks import Check, from_error
from ddpkit.worker.rendezvous.portsearch import find_store, host_store
from ddpkit.worker.rendezvous.store import probe_master

__all__ = ["Meeting", "meet"]

_PREFIX = "ddpkit-doctor"
_POLL_S = 0.1


@dataclass
class Meeting:
    """The store every rank reached, the PASS line saying how, and the bounds."""

    store: Store
    check: Check
    rank: int
    world_size: int
    timeout_s: float
    # The ranks rank 0 waits for before closing its store: those that reported (set by rank 0).
    present: tuple[int, ...] | None = None

    def wait_for(self, key: str, timeout_s: float) -> str | None:
        """The value of ``key`` once set, or None when it is not set within ``timeout_s``.

        One wait the store answers when ``key`` is set, as torch's own store barrier waits:
        polling each rank's verdict would flood rank 0's one store thread at many ranks. The
        wait is in torch's C++ code: a Ctrl-C reaches this rank when it ends, at the bound or
        at once when rank 0 leaves (its store closes, see :meth:`store_closing`).
        """
        try:
            self.store.wait([key], timedelta(seconds=max(timeout_s, 0.001)))
        except dist.DistStoreError:  # "wait timeout after ...": not set within the bound
            if not self.store.check([key]):  # (or set just as it ran out)
                return None
        return self.store.get(key).decode()

    def count_reaches(self, key: str, target: int, timeout_s: float) -> bool:
        """Whether the counter ``key`` reaches ``target`` within ``timeout_s``: one store call
        a poll, whatever the world size."""
        deadline = time.monotonic() + timeout_s
        while int(self.store.add(key, 0)) < target:
            if time.monotonic() >= deadline:
                return False
            time.sleep(_POLL_S)
        return True

    @contextmanager
    def store_closing(self) -> Iterator[None]:
        """Rank 0 keeps its store up until every rank says it is done (bounded); not when it
        was interrupted (Ctrl-C, an error): the others' waits then end as its store closes."""
        finished = False
        try:
            yield
            finished = True
        finally:
            try:
                self.store.add("done", 1)
                if self.rank == 0 and finished:
                    present = self.world_size if self.present is None else len(self.present)
                    self.count_reaches("done", present, self.timeout_s)
            except (RuntimeError, dist.DistError):  # the host went away: nothing left to wait for
                pass


def meet(info: RankInfo, env: Mapping[str, str], timeout_s: float) -> Meeting | Check:
    """Reach the store (see the module docstring); a FAIL line when that is not possible."""
    timeout = timedelta(seconds=timeout_s)
    where = f"{info.master_addr}:{info.master_port}"
    name = "master reachable"
    try:
        if env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
            probe_master(info, timeout_s)
            store: Store = TCPStore(
                info.master_addr, info.master_port, is_master=False, timeout=timeout
            )
            run = f"{env.get('TORCHELASTIC_RUN_ID', '')}/{env.get('TORCHELASTIC_RESTART_COUNT', 0)}"
            store = PrefixStore(f"{_PREFIX}/{run}", store)
            how = f"the agent's store at {where} answers rank {info.rank}"
        elif info.port_search is not None:
            store, port = _search(info, info.port_search, timeout_s, timeout)
            how = f"the job's store at {info.master_addr}:{port} (port search) answers"
        elif info.rank == 0:
            name = "master port"
            store = _host(info, timeout)
            how = f"rank 0 hosts the store at {where}"
        else:
            probe_master(info, timeout_s)
            store = TCPStore(info.master_addr, info.master_port, is_master=False, timeout=timeout)
            how = f"rank 0's store at {where} answers rank {info.rank}"
    except RendezvousError as exc:
        return from_error(name, exc)
    check = Check("PASS", name, how)
    return Meeting(store, check, info.rank, info.world_size, timeout_s)


def _search(
    info: RankInfo, search: PortSearch, timeout_s: float, timeout: timedelta
) -> tuple[Store, int]:
    if info.rank == 0:
        return host_store(info.master_addr, search, timeout)
    return find_store(info.master_addr, search, timeout_s, timeout, who=f"rank {info.rank}")


def _host(info: RankInfo, timeout: timedelta) -> Store:
    try:
        return TCPStore(
            info.master_addr,
            info.master_port,
            None,
            is_master=True,
            timeout=timeout,
            wait_for_workers=False,
        )
    except dist.DistNetworkError as exc:
        if "EADDRINUSE" not in str(exc) and "address already in use" not in str(exc).lower():
            raise RendezvousError(
                f"rank 0 cannot host the store at {info.master_addr}:{info.master_port}: {exc}",
                hint="is MASTER_ADDR an address of rank 0's host?",
            ) from exc
        raise RendezvousError(
            f"MASTER_PORT={info.master_port} is already in use on rank 0's host "
            f"({info.master_addr}): rank 0 cannot host the rendezvous store there",
            hint="another job or a stale process holds it (`ss -ltnp | grep "
            f"{info.master_port}`): pick a free MASTER_PORT, or unset it under srun and let "
            "ddpkit derive one per job",
        ) from exc
