"""A resolver that never answers makes torch's first store connect of a process wait for its
timeout; ``ddpkit.init`` then names it, once a node, with the hosts line that mends it.

Real: two ranks of ``ddpkit.init`` (processes forked from one interpreter that imported torch
once) in a mount namespace of the test's own, whose resolv.conf
names a nameserver that reads every query and never answers (a cluster whose DNS does not),
then the same with a hosts file holding the mapped loopback address.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.distutil import free_port, torchrun_env
from tests.support.resolver import (
    private_files_or_skip,
    silent_nameserver,
    system_hosts,
    with_files,
    with_mapped_loopback,
)

ROOT = Path(__file__).resolve().parents[3]

# Inside the namespace: torch imported once, each rank forked from there (as from a fork server:
# no lookup has run yet, so each rank reads resolv.conf and hosts afresh), its stderr piped back.
DRIVER = """
import json, os, sys, traceback
import torch
envs = json.loads(sys.argv[1])
code = "import ddpkit; ddpkit.init(); ddpkit.shutdown()"
ranks = []
for env in envs:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        os.dup2(write, 2)
        os.environ.clear()
        os.environ.update(env)
        status = 0
        try:
            exec(code, {"__name__": "__main__"})
        except BaseException:
            traceback.print_exc()
            status = 1
        sys.stderr.flush()
        os._exit(status)
    os.close(write)
    ranks.append((pid, os.fdopen(read, errors="replace")))
seen = [(rank_err.read(), pid) for pid, rank_err in ranks]
print(json.dumps([(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), err) for err, pid in seen]))
"""


@pytest.mark.multiproc
def test_init_names_a_resolver_that_kept_its_store_waiting_and_the_line_that_mends_it(
    tmp_path: Path,
) -> None:
    private_files_or_skip()
    resolv = tmp_path / "resolv.conf"  # each lookup 2 x 2 s: past init's 3 s, short for a test
    mended = with_mapped_loopback(tmp_path)
    seen, plain = {}, system_hosts()
    with silent_nameserver(100) as nameserver:
        resolv.write_text(f"nameserver {nameserver}\noptions timeout:2 attempts:2\n")
        for hosts in (plain, mended):
            base = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "DDPKIT_PEER_TIMEOUT": "off"}
            port = free_port()
            envs = [{**base, **torchrun_env(rank, 2, port)} for rank in range(2)]
            command = [sys.executable, "-c", DRIVER, json.dumps(envs)]
            done = subprocess.run(
                with_files(resolv, hosts, command),
                capture_output=True, text=True, timeout=150, check=False,
            )  # fmt: skip
            assert done.returncode == 0, done.stdout + done.stderr
            seen[hosts] = json.loads(done.stdout.splitlines()[-1])
    (code0, err0), (code1, err1) = seen[plain]
    assert code0 == code1 == 0, (err0, err1)
    # rank 0 hosts: torch's store connects a client to itself, which waits for the resolver
    assert "ddpkit: rank 0's rendezvous store took " in err0, err0
    assert "the resolver took over 1 s to name ::ffff:127.0.0.1" in err0, err0
    assert "add a line '::ffff:127.0.0.1 " in err0 and "to /etc/hosts on every node" in err0
    assert "rendezvous store took" not in err1, err1  # once a node: its first rank only
    for code, err in seen[mended]:
        assert code == 0 and "rendezvous store took" not in err, err
