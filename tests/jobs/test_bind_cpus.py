"""Each local rank's CPUs under ``cpu_bind`` (:mod:`ddpkit.jobs.bind_cpus`): what srun(1)
binds for a map, a mask and ``rank``, what plan says where srun picks, plan's ``# cpus`` line,
and the refusals of a list srun would refuse or read otherwise, or one naming a CPU past
``cpus_per_node``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ddpkit.jobs.bind_cpus import format_cpus, node_cpus, rank_items
from ddpkit.jobs.layout import format_plan
from ddpkit.jobs.spec import JobSpec
from ddpkit.jobs.spec_bind import _CPU_KEYWORDS
from tests.support.jobcli import submit_refused

BASE: dict[str, Any] = {"name": "b", "command": ["t.py"], "python": "/py", "workdir": "/w"}


def cpus_line(**fields: Any) -> str:
    """Plan's ``# cpus`` line for a spec of ``fields``."""
    plan = format_plan(JobSpec(**(BASE | fields)))
    (line,) = [line for line in plan.splitlines() if line.startswith("# cpus")]
    return line


def each(*cpus: int | tuple[int, ...]) -> tuple[frozenset[int], ...]:
    """Local task i's CPUs, one argument per task: an ID, or a tuple of IDs."""
    return tuple(frozenset(c if isinstance(c, tuple) else (c,)) for c in cpus)


# (value, tasks per node, cpus_per_task) -> each local task's CPUs (srun(1), task/affinity)
DECIDED = [
    ("map_cpu:1,0", 2, 1, each(1, 0)),
    ("map_cpu:1,0", 5, 1, each(1, 0, 1, 0, 1)),  # more tasks than entries: the list again
    ("map_cpu:4,5,6", 2, 1, each(4, 5)),  # fewer: the rest unused
    ("map_cpu:0x2,0x10,7", 3, 1, each(2, 16, 7)),  # 0x: hex, else decimal
    ("map_cpu:10", 2, 1, each(10, 10)),  # decimal even where hex would differ
    ("map_cpu:0*2,1*2", 6, 1, each(0, 0, 1, 1, 0, 0)),  # X*N: N copies, then the wrap
    ("map_cpu:3,0x1*2", 4, 2, each(3, 1, 1, 3)),  # a map is one CPU whatever cpus_per_task
    ("mask_cpu:0x3,0xC", 2, 2, each((0, 1), (2, 3))),
    ("mask_cpu:f0,1", 3, 1, each((4, 5, 6, 7), 0, (4, 5, 6, 7))),  # hex without 0x; the wrap
    ("mask_cpu:0x1*2,0x6", 4, 1, each(0, 0, (1, 2), 0)),
    ("mask_cpu:10", 1, 1, each(4)),  # always hex: 0x10
    ("rank", 3, 1, each(0, 1, 2)),
]


@pytest.mark.parametrize(("value", "tasks", "cpus_per_task", "expected"), DECIDED)
@pytest.mark.parametrize("prefix", ["", "verbose,", "quiet,", "v,", "q,verbose,"])
def test_a_map_a_mask_and_rank_decide_each_tasks_cpus(
    value: str, tasks: int, cpus_per_task: int, expected: tuple[frozenset[int], ...], prefix: str
) -> None:
    found = node_cpus(prefix + value, tasks, cpus_per_task)
    assert found.tasks == expected
    assert found.choice == ""


@pytest.mark.parametrize(
    ("value", "cpus_per_task", "words"),
    [
        ("cores", 1, "each task gets the whole cores of its 1 CPU (1 CPU where a core has one"),
        ("verbose,cores", 4, "whole cores of its 4 CPUs (4 CPUs where"),
        ("threads", 2, "srun's choice: each task gets 2 CPUs (threads)"),
        ("sockets", 1, "whole sockets"),
        ("ldoms", 1, "whole NUMA domains"),
        ("boards", 1, "whole boards"),
        ("rank", 2, "with 2 CPUs per task srun(1) does not say to which"),
        ("rank_ldom", 1, "the node's layout"),
        ("map_ldom:0,1", 1, "the node's layout"),
        ("mask_ldom:0x1", 1, "the node's layout"),
        ("none", 1, "not bound"),
        ("q,no", 1, "not bound"),
    ],
)
def test_where_srun_picks_plan_says_what_it_binds(
    value: str, cpus_per_task: int, words: str
) -> None:
    found = node_cpus(value, 2, cpus_per_task)
    assert found.tasks is None
    assert words in found.choice


@pytest.mark.parametrize("keyword", sorted(_CPU_KEYWORDS))
def test_every_keyword_the_spec_takes_has_an_answer(keyword: str) -> None:
    listed = keyword in ("map_cpu", "mask_cpu", "map_ldom", "mask_ldom")
    found = node_cpus(f"{keyword}:1" if listed else keyword, 2, 1)
    assert (found.tasks is not None) == (keyword in ("map_cpu", "mask_cpu", "rank"))
    assert (found.choice == "") == (found.tasks is not None)


def test_cpu_lists_are_written_as_the_kernel_writes_them() -> None:
    assert format_cpus(frozenset({11, 0, 1, 2, 3, 8, 10})) == "0-3,8,10-11"
    assert format_cpus(frozenset({5})) == "5"
    assert format_cpus(frozenset({1, 3})) == "1,3"


def test_runs_of_ranks_are_one_item() -> None:
    assert rank_items(each(0, 1, 2, 3)) == ["local ranks 0-3 in order -> 0-3"]
    assert rank_items(each((0, 1), (0, 1), (0, 1), 5)) == [
        "local ranks 0-2 each -> 0-1",
        "local rank 3 -> 5",
    ]
    # two alike are not a run; a run in order needs one CPU each, one more each time
    assert rank_items(each(1, 0, 2, 3)) == [
        "local rank 0 -> 1",
        "local rank 1 -> 0",
        "local rank 2 -> 2",
        "local rank 3 -> 3",
    ]
    assert rank_items(each(3, 2, 1, 0, 4, 5, 6)) == [
        "local rank 0 -> 3",
        "local rank 1 -> 2",
        "local rank 2 -> 1",
        "local rank 3 -> 0",
        "local ranks 4-6 in order -> 4-6",
    ]


@pytest.mark.parametrize(
    ("fields", "line"),
    [
        (
            {"procs_per_node": 2, "cpu_bind": "map_cpu:1,0"},
            "# cpus on each node: local rank 0 -> 1, local rank 1 -> 0",
        ),
        (
            {"procs_per_node": 2, "cpu_bind": "mask_cpu:0x1,0x2"},
            "# cpus on each node: local rank 0 -> 0, local rank 1 -> 1",
        ),
        (
            {"procs_per_node": 2, "cpu_bind": "cores"},
            "# cpus on each node: srun's choice: each task gets the whole cores of its 1 CPU "
            "(1 CPU where a core has one thread)",
        ),
        (
            {"nodes": 3, "procs_per_node": 5, "cpu_bind": "verbose,map_cpu:1,0"},
            "# cpus on each node: local rank 0 -> 1, local rank 1 -> 0; local ranks 2-4 start "
            "the list over (rank i as i mod 2)",
        ),
        (
            {"procs_per_node": 64, "cpu_bind": "rank"},
            "# cpus on each node: local ranks 0-63 in order -> 0-63",
        ),
        (
            {"procs_per_node": 4, "cpu_bind": "mask_cpu:0xff*4", "cpus_per_task": 2},
            "# cpus on each node: local ranks 0-3 each -> 0-7",
        ),
        (
            {"launch": "torchrun", "procs_per_node": 4, "cpu_bind": "mask_cpu:0xf,0xf0"},
            "# cpus on each node: the node's one task (ddpkit run and its 4 workers) -> 0-3",
        ),
        (
            {"launch": "torchrun", "procs_per_node": 2, "cpu_bind": "threads"},
            "# cpus on each node: srun's choice: each task gets 2 CPUs (threads) (a task: "
            "ddpkit run and its 2 workers)",
        ),
    ],
)
def test_plan_shows_each_local_ranks_cpus(fields: dict[str, Any], line: str) -> None:
    assert cpus_line(**fields) == line


@pytest.mark.parametrize(
    "value", ["map_cpu:0x1f", "mask_cpu:0x3*2,c", "map_cpu:0*1024", "mask_cpu:0x1", "rank"]
)
def test_lists_srun_reads_as_written_are_taken(value: str) -> None:
    assert JobSpec(**(BASE | {"cpu_bind": value})).cpu_bind == value


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ("cpu_bind: map_cpu:1a", "has '1a' in its list: map_cpu takes CPU IDs (decimal, or hex"),
        ("cpu_bind: map_cpu:0x", "has '0x' in its list"),
        ("cpu_bind: mask_cpu:0", "has the mask '0', which names no CPU"),
        ("cpu_bind: mask_cpu:0x00", "has the mask '0x00', which names no CPU"),
        ("cpu_bind: map_cpu:0*0", "has '0*0': a repeat count is 1 to 1024"),
        ("cpu_bind: map_cpu:0*1025", "has '0*1025': a repeat count is 1 to 1024"),
        ("cpu_bind: mask_cpu:3*99999999999999999999", "a repeat count is 1 to 1024"),
        ("cpu_bind: map_cpu:1,,2", "has an empty entry in its list '1,,2'"),
        ("cpu_bind: 'map_cpu:1,'", "has an empty entry in its list"),
        ("cpu_bind: map_cpu:65535", "names CPU 65535: a node has at most 65535 CPUs (0-65534)"),
        ("cpu_bind: map_cpu:99999999999999999999", "no node has that many CPUs"),
        (f"cpu_bind: mask_cpu:1{'0' * 16384}", "no node has that many CPUs"),
        ("cpu_bind: cores:1", "has a list after cores, which takes none"),
        ("cpu_bind: verbose,map_cpu", "has no list after map_cpu"),
        ("cpu_bind: mask_ldom", "has no list after mask_ldom"),
        (
            "cpus_per_node: 2\nprocs_per_node: 2\ncpu_bind: map_cpu:0,2",
            "cpu_bind='map_cpu:0,2': names CPU 2, but a node has cpus_per_node=2 (CPUs 0-1)",
        ),
        (
            "cpus_per_node: 4\ncpu_bind: verbose,mask_cpu:0x1,0x30",
            "cpu_bind='verbose,mask_cpu:0x1,0x30': names CPU 5, but a node has cpus_per_node=4",
        ),
        ("cpus_per_node: 4\ncpu_bind: map_cpu:0x4", "names CPU 4, but a node has cpus_per_node=4"),
    ],
)
def test_a_list_srun_would_refuse_or_misread_is_refused(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    line: str,
    words: str,
) -> None:
    assert words in submit_refused(tmp_path, monkeypatch, capsys, line)


def test_the_profiles_cpus_per_node_bounds_the_map(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles" / "site.yaml").write_text("name: site\ncpus_per_node: 4\n")
    line = "profile: site\ncpu_bind: map_cpu:0,4"
    words = "names CPU 4, but a node has cpus_per_node=4 (CPUs 0-3)"
    assert words in submit_refused(tmp_path, monkeypatch, capsys, line)


def test_a_map_within_the_nodes_cpus_is_taken() -> None:
    job = JobSpec(**(BASE | {"cpus_per_node": 2, "procs_per_node": 2, "cpu_bind": "map_cpu:1,0"}))
    assert job.cpu_bind == "map_cpu:1,0"
    assert JobSpec(**(BASE | {"cpus_per_node": 2, "cpu_bind": "mask_cpu:0x3"})).cpus_per_node == 2


@pytest.mark.parametrize(
    ("value", "tasks", "cpus_per_task"),
    [
        ("map_cpu:1,0", 2, 1),
        ("mask_cpu:0x1,0x2", 2, 1),
        ("rank", 8, 1),
        ("mask_cpu:0xff*4,0x300", 5, 2),
        ("map_cpu:3,2,1,0,4,5,6", 7, 1),
    ],
)
def test_the_cluster_test_reads_plans_line_as_plan_means_it(
    value: str, tasks: int, cpus_per_task: int
) -> None:
    """test_bind_cluster.py compares each rank's CPUs with plan's line as it reads it."""
    from tests.jobs.test_bind_cluster import planned

    line = cpus_line(procs_per_node=tasks, cpus_per_task=cpus_per_task, cpu_bind=value)
    expected = node_cpus(value, tasks, cpus_per_task).tasks
    assert expected is not None
    assert planned(line) == {rank: set(cpus) for rank, cpus in enumerate(expected)}
