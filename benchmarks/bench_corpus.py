"""The do-no-harm corpus in wall time: each idiom under `torchrun` and under `ddpkit run`.

    python benchmarks/bench_corpus.py [--runs 3] [--quick] [--json FILE] [IDIOM ...]

Issue 44's goal: a correct program under `ddpkit run` with `ddpkit.init()`'s defaults finishes
within 2 s of the same program under plain `torchrun` with `init_process_group`. The test of
the corpus (tests/test_corpus.py) checks that the output is the same and that ddpkit costs no
more than a bounded amount of CPU; wall time is measured here, on a machine left alone, since
in CI the launches share 2 cores with the SLURM tests. Every idiom of tests/corpus/idioms/
(with the library on PYTHONPATH) runs as the test runs it, the two launchers
alternating, the first one rotating from run to run; per idiom the medians, ddpkit's excess
and the worst run's excess are printed, then the largest median excess against the 2-s goal.
Run from the repository root.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import benchjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests import test_corpus as corpus  # noqa: E402  (the test's own launches)

GOAL_S = 2.0


def idioms(chosen: list[str]) -> list[tuple[str, corpus.Layout]]:
    on_path = corpus.Layout("PYTHONPATH", sys.executable, (str(corpus.LIBRARY),))
    every = [(name, on_path) for name in (*corpus.LIBRARY_IDIOMS, corpus.ALL_IDIOMS)]
    unknown = set(chosen) - {name for name, _ in every}
    if unknown:
        raise SystemExit(f"bench_corpus.py: no idiom {', '.join(sorted(unknown))}")
    return [(name, layout) for name, layout in every if not chosen or name in chosen]


def launch(which: str, name: str, layout: corpus.Layout, scratch: Path) -> float:
    """One launch, as the test makes it; its wall time (its output is the test's business, but a
    failure that the test would report stops the bench)."""
    script = corpus.IDIOMS / f"{name}.py"
    scratch.mkdir()
    run = corpus.run_torchrun if which == "torchrun" else corpus.run_ddpkit
    done = run(script, layout, scratch)
    if done.root_cause not in (None, corpus.ROOT_CAUSES.get(name)):
        raise SystemExit(f"{name} under {which}: {done.root_cause}\n{done.raw[-4000:]}")
    return done.wall_s


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("idiom", nargs="*", help="idioms to run (default: all)")
    benchjson.add_arguments(parser)
    args = parser.parse_args()
    if args.quick:
        args.runs = 1
    os.chdir(ROOT)
    names = ("torchrun", "ddpkit run")
    rows, excess = [], {}
    with tempfile.TemporaryDirectory(prefix="ddpkit-bench-corpus-") as tmp:
        for number, (name, layout) in enumerate(idioms(args.idiom)):
            times: dict[str, list[float]] = {which: [] for which in names}
            for i in range(args.runs):
                order = names if i % 2 == 0 else names[::-1]
                for which in order:
                    scratch = Path(tmp) / f"{number}-{i}-{which.split()[0]}"
                    times[which].append(launch(which, name, layout, scratch))
            median = {which: statistics.median(times[which]) for which in names}
            worst = max(d - t for t, d in zip(times["torchrun"], times["ddpkit run"], strict=True))
            excess[name] = median["ddpkit run"] - median["torchrun"]
            print(
                f"{name:24s} torchrun {median['torchrun']:5.2f} s   ddpkit run "
                f"{median['ddpkit run']:5.2f} s   excess {excess[name]:+5.2f} s (worst run "
                f"{worst:+5.2f} s)",
                flush=True,
            )
            figure = f"corpus idiom {name} ({layout.name}), median of {args.runs}"
            rows += [
                benchjson.row(figure, which, median[which], "s", False, trials=times[which])
                for which in names
            ]
    largest = max(excess, key=lambda name: excess[name])
    verdict = "within" if excess[largest] <= GOAL_S else "OVER"
    print(
        f"largest median excess: {excess[largest]:+.2f} s ({largest}): {verdict} the goal of "
        f"{GOAL_S:g} s"
    )
    title = "Do-no-harm corpus: each idiom under torchrun and ddpkit run (wall time)"
    benchjson.write(args.json, "corpus", title, "python", rows)


if __name__ == "__main__":
    main()
