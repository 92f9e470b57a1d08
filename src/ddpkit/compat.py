"""Every reach into a dependency's private or undocumented internals, in one place.

ddpkit asks for a range of torch (``>=2.4,<3``), of submitit and of torchx, and each of the
few things it takes from their insides can move in any release. Keeping them here means an
upgrade breaks this one file, loudly: ``tests/test_compat.py`` checks every reach below
against the installed version and names that version when one has moved. Each function's
docstring names what it reaches and what ddpkit does with it.

Each function imports its dependency when called: importing this module imports neither.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import pickle
import re
import struct
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    import argparse

    from torch.distributed.distributed_c10d import Store
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

_TAIL_PARAMETERS = ("header", "file", "dst", "finished", "interval_sec", "log_line_filter")


@contextmanager
def tee_read_by(tail_logfile: Callable[..., None]) -> Iterator[None]:
    """While the block runs, torch's tee of worker logs (``TailLog``, a thread a stream) reads
    each file with ``tail_logfile`` in place of ``tail_log.tail_logfile``, which
    ``TailLog.start`` looks up by that name: ``ddpkit run`` passes
    :func:`ddpkit.launch.tee.tail_whole_lines` (one rank prefix a line, whole lines, redraws in
    place). Restored afterwards; should torch rename the function or change its parameters,
    nothing is replaced and torch's own tee prints.
    """
    import inspect

    from torch.distributed.elastic.multiprocessing import tail_log

    original: Any = getattr(tail_log, "tail_logfile", None)
    if not callable(original) or tuple(inspect.signature(original).parameters) != _TAIL_PARAMETERS:
        yield
        return
    tail_log.tail_logfile = tail_logfile
    try:
        yield
    finally:
        tail_log.tail_logfile = original


@contextmanager
def rdzv_shared_store_made_by(create: Callable[[str, int], Any]) -> Iterator[None]:
    """While the block runs, torch's c10d (dynamic) rendezvous makes the store its workers
    share (TCPStore sharing: rank 0's agent hosts it, ``TORCHELASTIC_USE_AGENT_STORE=True``)
    with ``create(master_addr, port)``; torch's own listens on every interface.

    ``DynamicRendezvousHandler._create_tcp_store_server`` is the one place torch makes it;
    restored afterwards; should torch rename the method, nothing is replaced (its store then
    listens as torch makes it).
    """
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    handler = getattr(dynamic_rendezvous, "DynamicRendezvousHandler", None)
    original = getattr(handler, "_create_tcp_store_server", None)
    if handler is None or not callable(original):
        yield
        return

    def made(self: Any, master_addr: str, master_port: int) -> Any:
        return create(master_addr, master_port)

    handler._create_tcp_store_server = made
    try:
        yield
    finally:
        handler._create_tcp_store_server = original


# torch's TCPStore protocol (c10d/TCPStoreBackend.hpp; its libuv server speaks the same): a
# client opens with VALIDATE (query 0) and this magic number, then PING (query 13) with a nonce
# the server sends back; each value in the machine's byte order, unpadded.
_STORE_HELLO = struct.Struct("=BIBI")
_STORE_MAGIC, _STORE_VALIDATE, _STORE_PING = 0x3C85F7CE, 0, 13


def store_ping(nonce: int) -> tuple[bytes, bytes]:
    """(what torch's store client sends first, with ``nonce``; the 4 bytes a TCPStore server
    answers it with)."""
    nonce &= 0xFFFFFFFF
    hello = _STORE_HELLO.pack(_STORE_VALIDATE, _STORE_MAGIC, _STORE_PING, nonce)
    return hello, struct.pack("=I", nonce)


def launch_config_from_args(args: argparse.Namespace) -> tuple[Any, Any, list[str]]:
    """torchrun's own ``(LaunchConfig, entrypoint, args)`` for parsed torchrun arguments."""
    import torch.distributed.run as torch_run

    config, entrypoint, cmd_args = torch_run.config_from_args(args)
    return config, entrypoint, list(cmd_args)


@contextmanager
def torchrun_notice_muted(text: str = "OMP_NUM_THREADS") -> Iterator[None]:
    """Drop the records of torchrun's logger that contain ``text`` (its OMP banner)."""
    import torch.distributed.run as torch_run

    logger = logging.getLogger(torch_run.__name__)

    def muted(record: logging.LogRecord) -> bool:
        return text not in str(record.msg)

    logger.addFilter(muted)
    try:
        yield
    finally:
        logger.removeFilter(muted)


def recorded_traceback(failure: ProcessFailure) -> str | None:
    """The traceback a worker decorated with ``@record`` wrote into its error file.

    torch writes ``{"message": {"message": ..., "extraInfo": {"py_callstack": ...}}}``; torch
    puts "<N/A>" in ``error_file`` when none was written.
    """
    if not os.path.isfile(failure.error_file):
        return None
    message: object = failure.message
    if isinstance(message, dict):
        extra = message.get("extraInfo", {})
        message = extra.get("py_callstack") or message.get("message")
    return str(message).rstrip() if message else None


def default_store() -> Store:
    """The default process group's store (torch offers no public getter)."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def ddp_compute_s(model: Any) -> float | None:
    """This rank's forward + backward compute per step in seconds, as DDP measures it at its
    sampled iterations (CUDA events on GPUs); None before DDP has sampled one, or where the
    installed torch has no such figures."""
    try:
        data = model._get_ddp_logging_data()
        total_ns = int(data["avg_forward_compute_time"]) + int(data["avg_backward_compute_time"])
    except Exception:
        return None
    return total_ns / 1e9 if total_ns > 0 else None


def ddp_static_graph(model: Any) -> bool:
    """Whether a DDP module was made with ``static_graph=True`` (an undocumented attribute):
    its first backward must sync (torch asserts inside ``no_sync`` there)."""
    return getattr(model, "static_graph", False) is True


def foreach_mul_(tensors: list[Any], factor: float) -> None:
    """``tensors`` times ``factor`` in place, one kernel a device and dtype (DTensors too)."""
    import torch

    torch._foreach_mul_(tensors, factor)


def first_bucket_bytes() -> int:
    """DDP's first gradient bucket in bytes (1 MiB in torch 2.4 to 2.13): DDPOptimizer needs
    every bucket to reach it under torch.compile."""
    import torch.distributed as dist

    return int(getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", 1024 * 1024))


def flight_recorder(collectives: bool) -> dict[str, Any] | None:
    """torch's flight recorders, from their JSON dumps: each group's last enqueued and completed
    collective (``pg_status``) and, with ``collectives``, its entries (a dump of them all takes
    time: the status alone is what a frequent reader asks for). None where torch has no
    recorder (or every one fails). JSON, not the default dump: that is a pickle, which ddpkit
    never loads.

    torch keeps two recorders: ``_dump_fr_trace_json``, the generic one (gloo, CPU), and
    ``_dump_nccl_trace_json``, ProcessGroupNCCL's own (a CUDA build's only: an NCCL collective
    is never in the generic one, which an H200 showed: empty there after NCCL all_reduces).
    Both are read and merged into one dump: the entries by creation time, and each group's
    status. The two recorders number their groups and their sequence numbers apart (on an H200
    the gloo half of a second group over ``cpu:gloo,cuda:nccl`` was group 0 in the generic
    recorder, where NCCL's recorder had the default group as 0), so a group id that both use
    becomes ``nccl:<id>`` on the NCCL side, in its status and in its entries alike.
    """
    try:
        import json

        from torch._C import _distributed_c10d as c10d
    except Exception:
        return None
    dumps = []
    for name in ("_dump_fr_trace_json", "_dump_nccl_trace_json"):  # the generic one first
        dump_json = getattr(c10d, name, None)
        with contextlib.suppress(Exception):
            dump = json.loads(dump_json(collectives, False)) if dump_json else None
            if isinstance(dump, dict):
                dumps.append(dump)
    if len(dumps) < 2:
        return dumps[0] if dumps else None
    return _merged_recorders(*dumps)


def _merged_recorders(generic: dict[str, Any], nccl: dict[str, Any]) -> dict[str, Any]:
    """One dump out of the generic recorder's and the NCCL recorder's (``flight_recorder``)."""
    generic_status, nccl_status = generic.get("pg_status") or {}, nccl.get("pg_status") or {}
    shared = {str(group) for group in generic_status} & {str(group) for group in nccl_status}

    def renamed(group: object) -> str:
        return f"nccl:{group}" if str(group) in shared else str(group)

    merged = {**nccl, **generic}
    merged["pg_status"] = {**generic_status, **{renamed(g): n for g, n in nccl_status.items()}}
    if "entries" in merged:
        entries = [e for e in generic.get("entries") or [] if isinstance(e, dict)]
        entries += [
            {**e, "pg_id": renamed(e.get("pg_id"))} if str(e.get("pg_id")) in shared else e
            for e in nccl.get("entries") or []
            if isinstance(e, dict)
        ]
        merged["entries"] = sorted(entries, key=lambda e: int(e.get("time_created_ns") or 0))
    return merged


def matches_machine_hostname(host: str) -> bool:
    """Whether torch's c10d rendezvous takes ``host`` for this machine (and so hosts there)."""
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

    return bool(_matches_machine_hostname(host))


def submitit_sbatch_text(executor: Any, *, map_count: int | None = None) -> str:
    """The sbatch text submitit would write for ``executor`` (an AutoExecutor on SLURM),
    without submitting anything: submitit keeps its renderer private.

    ``map_count``: the number of items of a ``map_array``, which submitit submits as one array
    (``--array=0-N%P``, output files ``%A_%a_...``) by setting the private ``map_count``
    parameter on a copy of the executor; a single item it submits as a plain job, and so
    does this. ``executor`` itself is left as it was.
    """
    inner: Any = copy.copy(executor._executor)
    if map_count is not None and map_count > 1:
        inner.parameters = {**inner.parameters, "map_count": map_count}
    text: str = inner._make_submission_file_text(inner._submitit_command_str, "dry-run")
    return text


def submitit_sbatch_in_own_session(executor: Any) -> None:
    """``executor`` (SLURM) starts sbatch in a session of its own: a terminal's Ctrl-C reaches
    only ddpkit, which holds it until the job is recorded (``ddpkit.jobs.interrupts``)."""
    inner: Any = executor._executor
    made = inner._make_submission_command
    code = "import os,sys\ntry:os.setsid()\nexcept OSError:0\nos.execvp(sys.argv[1],sys.argv[1:])"
    inner._make_submission_command = lambda path: [sys.executable, "-c", code, *made(path)]


def submitit_sbatch_value(value: str) -> str:
    """``value`` as submitit must be given it for an ``#SBATCH`` line that sbatch reads back
    as ``value`` itself.

    submitit writes every ``#SBATCH`` value through ``shlex.quote``, for bash. sbatch's own
    directive parser reads the line, not bash, and takes a backslash as an escape even
    inside single quotes: ``'a\\'"'"' --export=...'`` ends the quoted word early and adds an
    option of its own, and any other backslash is dropped. Doubling every backslash is exact:
    ``shlex.quote`` single-quotes any value holding one and leaves backslashes as they are,
    and sbatch reads each ``\\\\`` as one ``\\``. Quotes, whitespace and ``#`` need nothing:
    inside ``shlex.quote``'s single quotes sbatch reads them as bash does. Line breaks cannot
    be written at all (JobSpec refuses them).
    """
    return value.replace("\\", "\\\\")


def torchx_slurm_sbatch_options(request: Any, role: str) -> list[dict[str, str | None]]:
    """The ``#SBATCH`` options torchx's slurm scheduler writes for each replica of ``role``,
    from its dry-run request (a ``SlurmBatchRequest``): one dict per replica (``<role>-<k>``),
    ``--key=value`` (None: a bare ``--key``), written unquoted; changing a dict changes what
    the request submits. ``[]`` for any other request."""
    replicas = getattr(request, "replicas", None)
    if not isinstance(replicas, dict):
        return []
    found: list[dict[str, str | None]] = []
    for name, replica in replicas.items():
        head, _, k = str(name).rpartition("-")
        if head == role and k.isdigit():
            found.append(replica.sbatch_opts)
    return found


# torch.compile's wrapper keeps the original module under this attribute, so its state dict
# keys start with "_orig_mod." (also inside a parent's keys when a submodule is compiled).
COMPILED_ATTRIBUTE = "_orig_mod"


def compiled_inner(module: object) -> Any:
    """The module ``torch.compile`` wrapped, when ``module`` is its wrapper; None otherwise.

    Without ``torch._dynamo`` imported no module can have been compiled, so this never
    imports it (it is slow to import).
    """
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    wrapper = getattr(eval_frame, "OptimizedModule", None)
    if wrapper is None or not isinstance(module, wrapper):
        return None
    return getattr(module, COMPILED_ATTRIBUTE)


# What the ``.metadata`` pickle of torch.distributed.checkpoint's FileSystemWriter names (torch
# 2.4 to 2.13): its metadata dataclasses, the writer's storage info, torch.Size, the layout
# helper torch's own weights_only unpickler allows, and the path the checkpoint was saved to.
# torch's dtypes (``torch.float32``) are allowed besides, by type. Building any of these runs
# no code but their constructors.
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_DCP_METADATA_CLASSES = """Metadata TensorStorageMetadata TensorProperties ChunkStorageMetadata
    BytesStorageMetadata MetadataIndex StorageMeta _MEM_FORMAT_ENCODING"""
DCP_METADATA_GLOBALS = frozenset(
    {
        *((_DCP_METADATA, name) for name in _DCP_METADATA_CLASSES.split()),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),
        ("torch", "Size"),
        ("pathlib", "PosixPath"),
    }
)


# torch's weights_only unpickler names what it refuses in these words (torch 2.4 to 2.13):
# a global it does not allow (or whose module it blocks), or an object it may not build.
_REFUSED = re.compile(
    r"GLOBAL (\S+) (?:was not an allowed global|whose module)"
    r"|allowlisted via `add_safe_globals`,? but got <class '([^']+)'>"
)


def refused_globals(error: BaseException, path: str | os.PathLike[str] | IO[bytes]) -> list[str]:
    """The globals (``module.name``) a ``torch.load(weights_only=True)`` of ``path`` that
    raised ``error`` refused, or [] when ``error`` is no such refusal (a damaged file). Call it
    under the same allowed globals as the load: torch's lister (2.5+), which reads the pickle's
    opcodes without running them, adds every other global of the file that is not allowed."""
    found = _REFUSED.search(str(error)) if isinstance(error, pickle.UnpicklingError) else None
    if found is None:
        return []
    name = found[1] or found[2]
    names = {name if "." in name else f"builtins.{name}"}  # torch drops "builtins." there
    import torch.serialization

    lister = getattr(torch.serialization, "get_unsafe_globals_in_checkpoint", None)
    if lister is not None:
        # should torch's own reader fail, the one name above is still right
        target = os.fspath(path) if isinstance(path, os.PathLike) else path
        with contextlib.suppress(Exception):
            if not isinstance(target, str):
                target.seek(0)  # the file the load read: from its start again
            names.update(lister(target))
    return sorted(names)
