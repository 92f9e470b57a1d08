"""SLURM hostlist and tasks-per-node parsing: table-driven, including every malformed shape."""

from __future__ import annotations

import pytest

from ddpkit.cluster.nodelist import (
    MAX_EXPANDED_HOSTS,
    count_hosts,
    expand_nodelist,
    expand_tasks_per_node,
    first_host,
)
from ddpkit.errors import ConfigError, NodelistError

EXPANSIONS = [
    ("n1", ["n1"]),
    ("alpha,beta", ["alpha", "beta"]),
    ("linux[1,2]", ["linux1", "linux2"]),
    ("n[1-3]", ["n1", "n2", "n3"]),
    ("n[1-3,7,10-11]", ["n1", "n2", "n3", "n7", "n10", "n11"]),
    ("n[08-10]", ["n08", "n09", "n10"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("n[001,02,3]", ["n001", "n02", "n3"]),
    (
        "rack[1-2]-node[01-02]",
        ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"],
    ),
    ("a[1-2]b[3-4]c", ["a1b3c", "a1b4c", "a2b3c", "a2b4c"]),
    ("n[1-2][5-6]", ["n15", "n16", "n25", "n26"]),
    ("gpu-node-[1-2].cluster.local", ["gpu-node-1.cluster.local", "gpu-node-2.cluster.local"]),
    ("node[1-2]-ib", ["node1-ib", "node2-ib"]),
    ("10.0.0.1,10.0.0.2", ["10.0.0.1", "10.0.0.2"]),
    ("10.0.0.[1-3]", ["10.0.0.1", "10.0.0.2", "10.0.0.3"]),
    ("[1-2]", ["1", "2"]),
    ("n[1-2],login,m[3]", ["n1", "n2", "login", "m3"]),
    ("b,a,b", ["b", "a", "b"]),
    ("n[1-2,1]", ["n1", "n2", "n1"]),
    ("  n[1-2] \n", ["n1", "n2"]),
    ("n1, n2", ["n1", "n2"]),
    ("n[ 1-2 , 4 ]", ["n1", "n2", "n4"]),
    ("n[5-5]", ["n5"]),
    ("n[0]", ["n0"]),
    ("under_score[9-10]", ["under_score9", "under_score10"]),
]


@pytest.mark.parametrize(("text", "hosts"), EXPANSIONS)
def test_expand_nodelist(text: str, hosts: list[str]) -> None:
    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize(("text", "hosts"), EXPANSIONS)
def test_first_host_and_count_agree_with_expansion(text: str, hosts: list[str]) -> None:
    assert first_host(text) == hosts[0]
    assert count_hosts(text) == len(hosts)


def test_first_host_and_count_do_not_expand_a_huge_range() -> None:
    text = "n[00000001-99999999],x"
    assert first_host(text) == "n00000001"
    assert count_hosts(text) == 99999999 + 1
    with pytest.raises(NodelistError, match=r"expands to 100000000 hosts"):
        expand_nodelist(text)


def test_expansion_limit_is_inclusive() -> None:
    assert len(expand_nodelist(f"n[1-{MAX_EXPANDED_HOSTS}]")) == MAX_EXPANDED_HOSTS


MALFORMED = [
    ("", "empty"),
    ("   ", "empty"),
    ("n[1-2", "never closed"),
    ("n1-2]", "without a matching"),
    ("n[1-[2]]", "nested"),
    ("n[]", "empty brackets"),
    ("n[ ]", "empty brackets"),
    ("n[5-3]", "reversed"),
    ("n[a-c]", "not a number"),
    ("n[1-c]", "not a number"),
    ("n[1-]", "has no end"),
    ("n[-3]", "not a number"),
    ("n[1,,2]", "empty entry"),
    ("n[1,]", "empty entry"),
    ("n[1-2-3]", "not a number"),
    ("n[١-٣]", "not a number"),
    ("a,,b", "empty item"),
    (",a", "empty item"),
    ("a,", "empty item"),
    ("node 1", "whitespace"),
]


@pytest.mark.parametrize(("text", "problem"), MALFORMED)
def test_malformed_nodelist(text: str, problem: str) -> None:
    with pytest.raises(NodelistError) as caught:
        expand_nodelist(text)
    message = str(caught.value)
    assert repr(text) in message, "the whole input is quoted"
    assert problem in message
    assert caught.value.hint
    # The error classes let callers catch it as a plain ValueError too.
    assert isinstance(caught.value, ConfigError)
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize(("text", "_problem"), MALFORMED)
def test_first_host_and_count_reject_malformed_too(text: str, _problem: str) -> None:
    with pytest.raises(NodelistError):
        first_host(text)
    with pytest.raises(NodelistError):
        count_hosts(text)


def test_error_names_the_variable_when_given() -> None:
    with pytest.raises(NodelistError, match=r"SLURM_STEP_NODELIST='n\[5-3\]' is malformed"):
        expand_nodelist("n[5-3]", source="SLURM_STEP_NODELIST")


@pytest.mark.parametrize(
    ("text", "counts"),
    [
        ("1", [1]),
        ("4", [4]),
        ("2(x3)", [2, 2, 2]),
        ("3,1(x2)", [3, 1, 1]),
        ("2(x3),1", [2, 2, 2, 1]),
        ("4(x2),3,2(x1)", [4, 4, 3, 2]),
        (" 2(x2) , 1 ", [2, 2, 1]),
        ("8(x128)", [8] * 128),
    ],
)
def test_expand_tasks_per_node(text: str, counts: list[int]) -> None:
    assert expand_tasks_per_node(text) == counts


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("", "not 'N' or 'N(xM)'"),
        ("a", "not 'N' or 'N(xM)'"),
        ("2,,1", "not 'N' or 'N(xM)'"),
        ("2(x3", "lacks ')'"),
        ("2(3)", "not 'N' or 'N(xM)'"),
        ("2(xa)", "not 'N' or 'N(xM)'"),
        ("2(x0)", "repeats zero times"),
        ("-1", "not 'N' or 'N(xM)'"),
        ("2x3", "not 'N' or 'N(xM)'"),
    ],
)
def test_malformed_tasks_per_node(text: str, problem: str) -> None:
    with pytest.raises(ConfigError) as caught:
        expand_tasks_per_node(text, source="SLURM_STEP_TASKS_PER_NODE")
    message = str(caught.value)
    assert f"SLURM_STEP_TASKS_PER_NODE={text!r}" in message
    assert problem in message
