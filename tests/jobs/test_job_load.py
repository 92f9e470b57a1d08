"""load_spec / load_profile: YAML, --set overrides, precedence, profile lookup, paths, errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from ddpkit.errors import ConfigError
from ddpkit.jobs.layout import format_plan
from ddpkit.jobs.load import (
    build_spec,
    load_profile,
    load_spec,
    merge_layers,
    parse_overrides,
    profile_search_path,
    read_profile,
)
from ddpkit.jobs.spec import JobSpec
from ddpkit.jobs.spec_checks import shown

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"
SPECS = DATA / "specs"


def write(path: Path, data: dict[str, Any] | str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    return path


def load(
    spec: Path, *overrides: str, cwd: Path | None = None, env: dict[str, str] | None = None
) -> JobSpec:
    return load_spec(spec, overrides, cwd=cwd or spec.parent, env=env or {})


def load_error(
    spec: Path, *overrides: str, cwd: Path | None = None, env: dict[str, str] | None = None
) -> str:
    with pytest.raises(ConfigError) as info:
        load(spec, *overrides, cwd=cwd, env=env)
    message = str(info.value)
    assert "\n" not in message
    return message


# -- fixtures in tests/data ----------------------------------------------------------------


def test_full_spec_with_profile_found_in_cwd() -> None:
    job = load(SPECS / "full.yaml", cwd=DATA)
    assert job.command == ["-m", "pkg.train", "--lr", "0.1", "--out", "run dir/out"]
    assert (job.nodes, job.procs, job.world_size, job.launch) == (2, 4, 8, "torchrun")
    assert job.partition == "gpu"  # spec over profile
    assert job.env == {"NCCL_DEBUG": "INFO", "NCCL_SOCKET_IFNAME": "ib0", "OMP_NUM_THREADS": "8"}
    assert job.setup == ["module load cuda/12.4", "module load nccl", "source .venv/bin/activate"]
    assert job.sbatch == {"exclusive": True, "mail-type": "END", "overcommit": False}
    assert (job.python, job.profile, job.host_template) == (
        "/opt/venv/bin/python",
        "site",
        "{host}-ib",
    )


def test_minimal_spec_gets_defaults_and_cwd_workdir(tmp_path: Path) -> None:
    job = load(SPECS / "minimal.yaml", cwd=tmp_path)
    assert job == JobSpec(name="minimal", command="train.py", workdir=str(tmp_path))


def test_hostile_fixture_is_accepted() -> None:
    job = load(SPECS / "hostile.yaml")
    assert job.env["MSG"] == "a'b\"c; $(whoami) `id` $HOME"
    assert job.env["MULTI"] == "line one\nline two"
    assert job.command[2] == 'it\'s "quoted"; $(rm -rf /) `id` & | > <'
    assert job.setup[1] == "if true; then\n  echo multi-line\nfi\n"
    assert job.workdir == "/tmp/dir with spaces/it's"
    assert job.log_dir == "logs; $(id)"


FILE_ERRORS = [
    ("bad-syntax.yaml", ["bad-syntax.yaml: line 6, column 5: invalid YAML", "indentation"]),
    ("duplicate-key.yaml", ["line 5, column 1", "key 'nodes' appears twice", "each key once"]),
    ("typo.yaml", ["typo.yaml: unknown key 'node'", "did you mean 'nodes'?"]),
    ("list.yaml", ["list.yaml: the spec is a list, not a mapping"]),
    ("no-such-file.yaml", ["spec file", "no-such-file.yaml' not found"]),
]


@pytest.mark.parametrize(("name", "expected"), FILE_ERRORS)
def test_file_errors(name: str, expected: list[str]) -> None:
    message = load_error(SPECS / name)
    for part in expected:
        assert part in message


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", "the file is empty"),
        ("# only a comment\n", "the file is empty"),
        ("just a string\n", "the spec is a str, not a mapping"),
        ("name: a\ncommand: [t.py\n", "line 3, column 1: invalid YAML"),
        ('name: "a\n', "invalid YAML"),
        ("1: a\n", "key 1 is not a field name"),
        ("name: a\ncommand: x.py\nenv: {A: 1, A: 2}\n", "line 3, column 13: invalid YAML: key 'A'"),
        ("name: a\n\tcommand: x.py\n", "line 2, column 1: invalid YAML"),
    ],
)
def test_yaml_text_errors(tmp_path: Path, text: str, expected: str) -> None:
    spec = write(tmp_path / "s.yaml", text)
    message = load_error(spec)
    assert message.startswith(f"{spec}: ")
    assert expected in message


def test_directory_is_not_a_spec(tmp_path: Path) -> None:
    assert "cannot be read" in load_error(tmp_path)


# -- --set overrides -----------------------------------------------------------------------

OVERRIDES: list[tuple[str, dict[str, Any]]] = [
    ("nodes=2", {"nodes": 2}),
    ("mem_gb=1.5", {"mem_gb": 1.5}),
    ("sbatch.exclusive=true", {"sbatch": {"exclusive": True}}),
    ("env.NCCL_DEBUG=INFO", {"env": {"NCCL_DEBUG": "INFO"}}),
    ("env.X=a=b", {"env": {"X": "a=b"}}),
    ("env.TOKEN=#secret", {"env": {"TOKEN": "#secret"}}),
    ("env.MSG=a: b # c", {"env": {"MSG": "a: b # c"}}),
    ("env.Q='quoted # text'", {"env": {"Q": "quoted # text"}}),
    ("partition=", {"partition": None}),
    ("partition=null", {"partition": None}),
    ("rdzv_port=auto", {"rdzv_port": "auto"}),
    ("command=train.py --lr 0.1", {"command": "train.py --lr 0.1"}),
    ("command=[a.py, --x, 'b c']", {"command": ["a.py", "--x", "b c"]}),
    ("sbatch={exclusive: true}", {"sbatch": {"exclusive": True}}),
    ("name=yes", {"name": True}),  # YAML's own reading; validation then complains
]


@pytest.mark.parametrize(("item", "expected"), OVERRIDES)
def test_parse_overrides(item: str, expected: dict[str, Any]) -> None:
    assert parse_overrides([item]) == expected


def test_parse_overrides_combines_and_later_wins() -> None:
    items = ["nodes=1", "env.A=1", "env.B=x", "nodes=3", "env.A=2"]
    assert parse_overrides(items) == {"nodes": 3, "env": {"A": 2, "B": "x"}}


@pytest.mark.parametrize(
    ("item", "expected"),
    [
        ("nodes", "--set 'nodes' is not KEY=VALUE"),
        ("=2", "--set '=2' is not KEY=VALUE"),
        ("nodes.x=1", "--set 'nodes.x=1': nodes is not a mapping"),
        ("command=[a", "--set 'command=[a': the value is not valid YAML"),
    ],
)
def test_parse_override_errors(item: str, expected: str) -> None:
    with pytest.raises(ConfigError, match="hint: ") as info:
        parse_overrides([item])
    assert expected in str(info.value)


def test_override_errors_name_set_as_source(tmp_path: Path) -> None:
    spec = write(tmp_path / "s.yaml", {"name": "a", "command": "t.py"})
    assert load_error(spec, "nodes=0").startswith("--set: nodes=0: is less than 1")
    message = load_error(spec, "nodez=2")
    assert message.startswith("--set: unknown key 'nodez'") and "did you mean 'nodes'?" in message
    assert load_error(spec, "env.BAD-KEY=1").startswith("--set: env.BAD-KEY: is not a valid")
    assert load_error(spec, "name=yes").startswith("--set: name=True: is not a string")


# -- precedence: --set > spec > profile > defaults -----------------------------------------


@pytest.fixture
def layered(tmp_path: Path) -> Path:
    """A spec naming a profile in <spec dir>/profiles; returns the spec directory."""
    write(tmp_path / "profiles" / "site.yaml", {"name": "site"})
    return tmp_path


# field, profile value, spec value, --set text, expected (None in a column: not set there)
PRECEDENCE: list[tuple[str, Any, Any, str | None, Any]] = [
    ("partition", None, None, None, None),  # defaults only
    ("partition", "p", None, None, "p"),  # profile only
    ("partition", None, "s", None, "s"),  # spec only
    ("partition", "p", "s", None, "s"),  # both: spec wins
    ("partition", "p", "s", "x", "x"),  # --set beats both
    ("partition", "p", None, "x", "x"),
    ("time_min", 30, None, None, 30),
    ("time_min", None, None, None, 60),
    ("time_min", 30, 45, None, 45),
    ("time_min", 30, 45, "90", 90),
    ("cpus_per_task", 2, None, "4", 4),
    ("mem_gb", 64, 32.5, None, 32.5),
    ("python", "/site/py", None, None, "/site/py"),
    ("python", "/site/py", "/spec/py", "/set/py", "/set/py"),
    ("log_dir", "site-logs", None, None, "site-logs"),
    ("log_dir", "site-logs", "mine", None, "mine"),
    ("host_template", "{host}.ib", None, None, "{host}.ib"),
    ("host_template", "{host}.ib", "{host}-ib", None, "{host}-ib"),
    ("account", "a", None, "", None),  # --set key= resets to the default
]


@pytest.mark.parametrize("case", PRECEDENCE, ids=[repr(case) for case in PRECEDENCE])
def test_precedence(layered: Path, case: tuple[str, Any, Any, str | None, Any]) -> None:
    field, in_profile, in_spec, set_text, expected = case
    profile: dict[str, Any] = {"name": "site"}
    if in_profile is not None:
        profile[field] = in_profile
    write(layered / "profiles" / "site.yaml", profile)
    spec: dict[str, Any] = {"name": "a", "command": "t.py", "profile": "site"}
    if in_spec is not None:
        spec[field] = in_spec
    overrides = [] if set_text is None else [f"{field}={set_text}"]
    job = load(write(layered / "s.yaml", spec), *overrides)
    assert getattr(job, field) == expected


def test_spec_null_drops_the_profile_value(layered: Path) -> None:
    write(layered / "profiles" / "site.yaml", {"name": "site", "partition": "p", "mem_gb": 8})
    spec = {"name": "a", "command": "t.py", "profile": "site", "partition": None}
    job = load(write(layered / "s.yaml", spec))
    assert (job.partition, job.mem_gb) == (None, 8)


def test_mappings_merge_key_wise(layered: Path) -> None:
    profile = {"name": "site", "env": {"A": "p", "B": "p", "Z": "p"}, "sbatch": {"exclusive": True}}
    write(layered / "profiles" / "site.yaml", profile)
    spec = {
        "name": "a",
        "command": "t.py",
        "profile": "site",
        "env": {"B": "s", "C": "s"},
        "sbatch": {"mail-type": "END"},
    }
    overrides = ("env.C=x", "env.D=y", "env.Z=", "sbatch.exclusive=false")
    job = load(write(layered / "s.yaml", spec), *overrides)
    assert job.env == {"A": "p", "B": "s", "C": "x", "D": "y"}
    assert job.sbatch == {"exclusive": False, "mail-type": "END"}


def test_setup_lines_accumulate(layered: Path) -> None:
    write(layered / "profiles" / "site.yaml", {"name": "site", "setup": ["p1", "p2"]})
    spec = write(
        layered / "s.yaml", {"name": "a", "command": "t.py", "profile": "site", "setup": ["s1"]}
    )
    assert load(spec).setup == ["p1", "p2", "s1"]
    assert load(spec, "setup=echo 'x y'").setup == ["p1", "p2", "s1", "echo 'x y'"]
    assert load(spec, "setup=").setup == []


def test_merge_layers_records_where_each_value_came_from() -> None:
    merged, origins = merge_layers(
        [
            ("profile.yaml", {"partition": "p", "setup": ["a"], "env": {"A": "1"}}),
            ("spec.yaml", {"nodes": 2, "setup": "b", "env": {"B": "2"}}),
            ("--set", {"nodes": 3, "env": {"A": None}}),
        ]
    )
    assert merged == {"partition": "p", "setup": ["a", "b"], "env": {"B": "2"}, "nodes": 3}
    assert origins["partition"] == "profile.yaml"
    assert (origins["setup[0]"], origins["setup[1]"]) == ("profile.yaml", "spec.yaml")
    assert (origins["env.B"], origins["nodes"]) == ("spec.yaml", "--set")


# -- profile lookup -----------------------------------------------------------------------


def test_search_path_order_and_home(tmp_path: Path) -> None:
    spec_dir, cwd = tmp_path / "specs", tmp_path / "cwd"
    env = {"DDPKIT_HOME": str(tmp_path / "home"), "HOME": "/nonexistent"}
    assert profile_search_path(spec_dir, cwd, env) == [
        spec_dir / "profiles",
        cwd / "profiles",
        tmp_path / "home" / "profiles",
    ]
    xdg = profile_search_path(spec_dir, spec_dir, {"XDG_CONFIG_HOME": "/x", "HOME": "/h"})
    assert xdg == [spec_dir / "profiles", Path("/x/ddpkit/profiles")]
    assert profile_search_path(cwd, cwd, {"HOME": "/h"})[-1] == Path("/h/.config/ddpkit/profiles")


def test_profile_found_in_each_place(tmp_path: Path) -> None:
    spec_dir, cwd, home = tmp_path / "specs", tmp_path / "cwd", tmp_path / "home"
    spec = write(spec_dir / "s.yaml", {"name": "a", "command": "t.py", "profile": "site"})
    env = {"DDPKIT_HOME": str(home)}
    # one place at a time (two: tests/jobs/test_job_profiles.py)
    for place in (home, cwd, spec_dir):
        profile = write(place / "profiles" / "site.yaml", {"partition": place.name})
        assert load(spec, cwd=cwd, env=env).partition == place.name
        profile.unlink()


def test_a_site_profile_can_give_every_job_a_health_check(tmp_path: Path) -> None:
    site = {"health_check": "nvidia-smi -L", "health_check_timeout_s": 30, "max_excluded_nodes": 1}
    write(tmp_path / "profiles" / "site.yaml", site)
    spec = write(tmp_path / "s.yaml", {"name": "a", "command": "t.py", "profile": "site"})
    job = load(spec, cwd=tmp_path)
    assert (job.health_check, job.health_check_timeout_s, job.max_excluded_nodes) == (
        "nvidia-smi -L", 30, 1,
    )  # fmt: skip
    spec = write(
        tmp_path / "s.yaml",
        {"name": "a", "command": "t.py", "profile": "site", "health_check": None,
         "max_excluded_nodes": 3},
    )  # fmt: skip
    job = load(spec, cwd=tmp_path)  # the spec wins, null drops the profile's
    assert (job.health_check, job.max_excluded_nodes) == (None, 3)


def test_profile_by_path_relative_to_spec(tmp_path: Path) -> None:
    write(tmp_path / "conf" / "my-site.yml", {"partition": "from-path"})
    spec = write(
        tmp_path / "jobs" / "s.yaml",
        {"name": "a", "command": "t.py", "profile": "../conf/my-site.yml"},
    )
    job = load(spec, cwd=tmp_path / "elsewhere")
    assert (job.partition, job.profile) == ("from-path", "../conf/my-site.yml")


def test_profile_not_found_lists_places_and_suggests(tmp_path: Path) -> None:
    write(tmp_path / "profiles" / "gpu-site.yaml", {"partition": "x"})
    spec = write(tmp_path / "s.yaml", {"name": "a", "command": "t.py", "profile": "gpu-stie"})
    message = load_error(spec, env={"DDPKIT_HOME": str(tmp_path / "home")})
    assert message.startswith(f"{spec}: profile='gpu-stie': not found (looked for ")
    assert str(tmp_path / "profiles" / "gpu-stie.yaml") in message
    assert str(tmp_path / "home" / "profiles" / "gpu-stie.yaml") in message
    assert "did you mean 'gpu-site'?" in message and "profiles found: gpu-site" in message


def test_profile_path_missing(tmp_path: Path) -> None:
    spec = write(tmp_path / "s.yaml", {"name": "a", "command": "t.py", "profile": "nope/x.yaml"})
    assert "profile='nope/x.yaml': no such file" in load_error(spec)


def test_set_chooses_or_disables_the_profile(tmp_path: Path) -> None:
    write(tmp_path / "profiles" / "one.yaml", {"partition": "one"})
    write(tmp_path / "profiles" / "two.yaml", {"partition": "two"})
    spec = write(tmp_path / "s.yaml", {"name": "a", "command": "t.py", "profile": "one"})
    assert load(spec).partition == "one"
    assert load(spec, "profile=two").partition == "two"
    job = load(spec, "profile=")
    assert (job.partition, job.profile) == (None, None)


def test_load_profile_fixtures() -> None:
    search = [DATA / "profiles"]
    site = load_profile("site", search=search)
    assert (site.name, site.partition, site.cpus_per_node) == ("site", "batch", 128)
    assert site.env == {"NCCL_DEBUG": "WARN", "NCCL_SOCKET_IFNAME": "ib0"}
    assert load_profile("unnamed", search=search).name == "unnamed"  # from the file name
    assert load_profile(str(DATA / "profiles" / "site.yaml"), search=[]).name == "site"


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        (
            "job-setting",
            ["job-setting.yaml: unknown key 'nodes'", "a job setting: set it in the spec"],
        ),
        ("typo", ["typo.yaml: unknown key 'partiton'", "did you mean 'partition'?"]),
    ],
)
def test_profile_errors_name_the_profile_file(name: str, expected: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_profile(name, search=[DATA / "profiles"])
    for part in expected:
        assert part in str(info.value)


def test_errors_name_the_file_the_value_came_from(layered: Path) -> None:
    profile = write(layered / "profiles" / "site.yaml", {"name": "site", "cpus_per_node": 2})
    spec = write(layered / "s.yaml", {"name": "a", "command": "t.py", "profile": "site"})
    assert load_error(spec, "procs_per_node=4").startswith("--set: procs_per_node=4: 4 processes")
    write(profile, {"name": "site", "env": {"bad key": "x"}})
    assert load_error(spec).startswith(f"{profile}: env['bad key']: is not a valid")
    write(profile, {"name": "site", "cpus_per_task": 4, "cpus_per_node": 4})
    message = load_error(spec, "procs_per_node=2")
    assert "procs_per_node=2: 2 processes x cpus_per_task=4 need 8 CPUs" in message


# -- relative paths --------------------------------------------------------------------------


def test_relative_paths_resolve_against_the_file_that_wrote_them(tmp_path: Path) -> None:
    write(tmp_path / "jobs" / "t.sh.j2", "#!/bin/bash\n")
    spec = write(
        tmp_path / "jobs" / "s.yaml",
        {
            "name": "a",
            "command": "t.py",
            "workdir": "../run",
            "template": "t.sh.j2",
            "log_dir": "logs",
        },
    )
    job = load(spec, cwd=tmp_path / "elsewhere")
    assert job.workdir == str(tmp_path / "run")
    assert job.template == str(tmp_path / "jobs" / "t.sh.j2")
    assert job.log_dir == "logs"  # stays relative to workdir
    assert job.log_path == str(tmp_path / "run" / "logs")
    assert load(spec, "workdir=sub", cwd=tmp_path / "cwd").workdir == str(tmp_path / "cwd" / "sub")


def test_profile_template_is_relative_to_the_profile(tmp_path: Path) -> None:
    write(tmp_path / "profiles" / "site.sh.j2", "#!/bin/bash\n")
    write(tmp_path / "profiles" / "site.yaml", {"template": "site.sh.j2"})
    spec = write(tmp_path / "s.yaml", {"name": "a", "command": "t.py", "profile": "site"})
    assert load(spec).template == str(tmp_path / "profiles" / "site.sh.j2")


def test_missing_template_is_caught_at_load(tmp_path: Path) -> None:
    spec = write(tmp_path / "s.yaml", {"name": "a", "command": "t.py", "template": "none.j2"})
    message = load_error(spec)
    assert f"{spec}: template={str(tmp_path / 'none.j2')!r}: no such file" in message


def test_build_spec_from_a_mapping(tmp_path: Path) -> None:
    job = build_spec(
        {"name": "a", "command": ["t.py"], "workdir": "w"}, ["nodes=2"], cwd=tmp_path
    ).spec
    assert (job.workdir, job.nodes) == (str(tmp_path / "w"), 2)
    with pytest.raises(ConfigError, match=r"^<spec>: nodes=0: is less than 1"):
        build_spec({"name": "a", "command": "t.py", "nodes": 0}, cwd=tmp_path)


def test_plan_yaml_loads_back_to_the_same_spec(tmp_path: Path) -> None:
    job = load(SPECS / "hostile.yaml")
    resolved = format_plan(job).split("\n\n# rank layout")[0]
    again = load(write(tmp_path / "again.yaml", resolved), cwd=Path("/"))
    assert again == job


# -- the examples ---------------------------------------------------------------------------

EXAMPLES = sorted((ROOT / "examples" / "jobs").glob("*.yaml"))


def test_examples_cover_both_launch_modes() -> None:
    launches = {load(path, cwd=Path("/")).launch for path in EXAMPLES}
    assert launches == {"srun", "torchrun"}


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_specs_load(path: Path, tmp_path: Path) -> None:
    job = load(path, cwd=tmp_path)  # independent of where it is submitted from
    assert (job.nodes, job.procs, job.world_size, job.gpus_per_node) == (2, 2, 4, 0)
    assert job.workdir == str(ROOT)
    assert job.command[0] == "examples/train.py" and (ROOT / job.command[0]).is_file()
    assert job.profile is not None and job.partition is not None


@pytest.mark.parametrize("path", sorted((ROOT / "examples" / "jobs" / "profiles").glob("*.yaml")))
def test_example_profiles_load(path: Path) -> None:
    assert read_profile(path).name == path.stem


# -- bounded YAML and error quoting (the hostile cases: tests/jobs/test_jobs_bad_input.py) ------


def test_anchors_and_aliases_within_the_limits_still_work(tmp_path: Path) -> None:
    values = ", ".join(str(i) for i in range(5000))
    spec = write(
        tmp_path / "s.yaml",
        "name: a\ncommand: t.py --lr {lr}\nenv: {A: &v hello, B: *v}\n"
        f"setup: &s ['echo 1']\nsweep: {{params: {{lr: [{values}]}}}}\n",
    )
    job = load(spec)
    assert job.env == {"A": "hello", "B": "hello"}
    assert job.sweep is not None and job.sweep.count == 5000


@pytest.mark.parametrize(
    "value",
    ["a\n", 1.5, None, True, [1, "x", [2]], {"a": [1, 2], "b": {"c": "d"}}, (1,), [], {}],
)
def test_shown_is_repr_for_small_values(value: object) -> None:
    assert shown(value) == repr(value)


def test_shown_cuts_long_and_shared_values_cheaply() -> None:
    bomb: list[object] = ["x"] * 9
    for _ in range(12):  # 9 ** 13 strings behind 117 list objects: repr would never end
        bomb = [bomb] * 9
    assert len(shown(bomb)) < 1000
    assert shown("y" * 10_000) == repr("y" * 200) + "..."
    assert shown(10**5000) == "<a number of about 5000 digits>"
    loop: list[object] = []
    loop.append(loop)
    assert shown(loop) == "[[...]]"


def test_signal_null_means_no_stop_signal(layered: Path) -> None:
    """``signal``'s null is "none" (the field's doc), not its default USR2: in every layer."""
    base = "name: a\ncommand: t.py\n"
    assert load(write(layered / "a.yaml", base)).signal == "USR2"
    assert load(write(layered / "b.yaml", base + "signal: null\n")).signal is None
    assert load(write(layered / "c.yaml", base + "signal: USR1\n"), "signal=").signal is None
    assert load(write(layered / "d.yaml", base + "signal: null\n"), "signal=USR1").signal == "USR1"


@pytest.mark.parametrize(
    ("text", "overrides", "expected"),
    [
        (
            "sweep: {parms: {lr: [1, 2]}}\n", [],
            "s.yaml: unknown key 'sweep.parms' (hint: did you mean 'params'?)",
        ),
        (
            "sweep: {params: {lr: [1, 2]}, max_paralel: 1}\n", [],
            "s.yaml: unknown key 'sweep.max_paralel' (hint: did you mean 'max_parallel'?)",
        ),
        ("", ["sweep.mode=zip", "sweep.parms={lr: [1]}"], "--set: unknown key 'sweep.parms'"),
        ("", ["sweep.params.lr=[1, 2]"], "--set 'sweep.params.lr=[1, 2]': sweep.params is not"),
    ],
)  # fmt: skip
def test_an_unknown_key_inside_sweep_is_named_with_its_path(
    tmp_path: Path, text: str, overrides: list[str], expected: str
) -> None:
    """It was "unknown key 'sweep' (hint: did you mean 'sweep'?)", for any typo inside."""
    spec = write(tmp_path / "s.yaml", "name: a\ncommand: t.py --lr {lr}\n" + text)
    assert expected in load_error(spec, *overrides)
