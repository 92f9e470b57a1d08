"""rank_layout / format_plan: node-major ranks in both launch modes, and the plan text."""

from __future__ import annotations

import re

import pytest
import yaml

from ddpkit.jobs.layout import LayoutRow, format_layout, format_plan, rank_layout
from ddpkit.jobs.spec import JobSpec


def make(**fields: object) -> JobSpec:
    return JobSpec.model_validate(
        {"name": "j", "command": "t.py", "workdir": "/w", "python": "/py", **fields}
    )


# fields -> (node, local_rank, rank, device) of every row
LAYOUTS: list[tuple[dict[str, object], list[tuple[int, int, int, str]]]] = [
    ({}, [(0, 0, 0, "cpu")]),
    (
        {"nodes": 2, "procs_per_node": 2},
        [(0, 0, 0, "cpu"), (0, 1, 1, "cpu"), (1, 0, 2, "cpu"), (1, 1, 3, "cpu")],
    ),
    ({"nodes": 3}, [(0, 0, 0, "cpu"), (1, 0, 1, "cpu"), (2, 0, 2, "cpu")]),
    (
        {"nodes": 2, "gpus_per_node": 2},
        [(0, 0, 0, "cuda:0"), (0, 1, 1, "cuda:1"), (1, 0, 2, "cuda:0"), (1, 1, 3, "cuda:1")],
    ),
    ({"procs_per_node": 3}, [(0, 0, 0, "cpu"), (0, 1, 1, "cpu"), (0, 2, 2, "cpu")]),
]


@pytest.mark.parametrize("launch", ["srun", "torchrun"])
@pytest.mark.parametrize(("fields", "expected"), LAYOUTS)
def test_rank_layout(
    launch: str, fields: dict[str, object], expected: list[tuple[int, int, int, str]]
) -> None:
    rows = rank_layout(make(launch=launch, rdzv_port="auto", **fields))
    assert [(r.node, r.local_rank, r.rank, r.device) for r in rows] == expected
    assert [r.host for r in rows] == [f"node{r.node}" for r in rows]


@pytest.mark.parametrize(("nodes", "procs"), [(1, 1), (4, 8), (16, 3)])
def test_layout_is_node_major_and_covers_every_rank(nodes: int, procs: int) -> None:
    job = make(nodes=nodes, procs_per_node=procs)
    rows = rank_layout(job)
    assert [r.rank for r in rows] == list(range(job.world_size))
    for row in rows:
        assert row.rank == row.node * procs + row.local_rank
        assert 0 <= row.local_rank < procs


def test_format_layout_aligns_columns() -> None:
    rows = [LayoutRow(n, f"node{n}", 0, n, "cuda:0") for n in (0, 1, 10)]
    lines = format_layout(rows).splitlines()
    assert lines[0].split() == ["node", "host", "local_rank", "rank", "device"]
    starts = {tuple(m.start() for m in re.finditer(r"\S+", line)) for line in lines}
    assert len(starts) == 1, f"columns not aligned:\n{format_layout(rows)}"
    assert lines[-1].split() == ["10", "node10", "0", "10", "cuda:0"]


def test_format_plan_has_every_field_and_the_table() -> None:
    job = make(nodes=2, gpus_per_node=2, launch="torchrun", rdzv_port=29400, env={"A": "x"})
    text = format_plan(job)
    spec_text, layout_text = text.split("\n\n# rank layout")
    assert yaml.safe_load(spec_text) == job.model_dump(exclude={"min_nodes"})
    # every key a spec may have (min_nodes is not one: nodes: MIN-MAX sets it)
    assert set(yaml.safe_load(spec_text)) == set(JobSpec.model_fields) - {"min_nodes"}
    assert "procs_per_node: null" in spec_text  # defaults are shown, not left out
    summary, *table = layout_text.splitlines()
    assert "2 node(s) x 2 process(es) = world size 4 (launch: torchrun" in summary
    assert table[0].split() == ["node", "host", "local_rank", "rank", "device"]
    assert [line.split() for line in table[1:]] == [
        ["0", "node0", "0", "0", "cuda:0"],
        ["0", "node0", "1", "1", "cuda:1"],
        ["1", "node1", "0", "2", "cuda:0"],
        ["1", "node1", "1", "3", "cuda:1"],
    ]
    assert text.endswith("\n") and not text.endswith("\n\n")


def test_a_node_range_is_planned_as_written_with_both_world_sizes() -> None:
    job = make(nodes="1-3", procs_per_node=2)
    text = format_plan(job)
    spec_text, layout_text = text.split("\n\n# rank layout")
    shown = yaml.safe_load(spec_text)
    assert shown["nodes"] == "1-3" and "min_nodes" not in shown
    assert make(**{k: v for k, v in shown.items() if k in ("nodes", "procs_per_node")}) == job
    summary, note, *table = layout_text.splitlines()
    assert summary.startswith(": 1-3 node(s) x 2 process(es) = world size 2-6 (launch: srun")
    assert note.startswith("# nodes 1-3: each attempt (a requeue too) runs on as many nodes")
    assert len(table) == 1 + 6  # the layout at MAX; an attempt on k nodes has the first k x 2


def test_format_plan_is_deterministic_and_pure() -> None:
    job = make(nodes=2)
    assert format_plan(job) == format_plan(job)
    assert "one SLURM task per process" in format_plan(job)
