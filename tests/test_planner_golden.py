"""The planner's answers must not move when the search gets faster: `csbp plan --json` against
output recorded before the search was pruned and vectorised.

`tests/golden/planner.json` holds, for varied jobs (dense, MoE with sliding-window layers, hybrid
linear attention, a drafter; 1-4 nodes; H100 and H200; the event engine and the closed form only;
restricted axes), the whole `--json` object and the labels of the complete ranking an exhaustive
search gives. The pruned search must print the same object (floats to 1e-9 relative) except the
search counts that describe its own work (`evaluations` and the keys added with pruning), and an
exhaustive `search()` must still rank every feasible candidate in the recorded order. After a
deliberate change of a result, re-record with

    python tests/test_planner_golden.py --record
"""

from __future__ import annotations

import json
import sys
from functools import cache
from pathlib import Path
from unittest import mock

import pytest

from csbp.simulator.commands.cli import build_parser
from csbp.simulator.commands import plan as plan_command
from csbp.simulator.commands.plan import answer
from csbp.simulator.planner.planner import label_of, search

GOLDEN = Path(__file__).parent / "golden" / "planner.json"
# recorded floats and rankings: tests/README.md
pytestmark = pytest.mark.floats

# (name, csbp plan flags)
CASES = [
    ("default", []),
    ("gemma-64k-2n", ["--model", "diffusiongemma-26b-a4b", "--seq-len", "64k", "--nodes", "2"]),
    ("gemma-256k-4n-cf", ["--model", "diffusiongemma-26b-a4b", "--seq-len", "256k", "--nodes", "4",
                          "--engine", "closed-form", "--top", "20"]),
    ("qwen35-128k-1n-cf", ["--model", "qwen3.5-27b", "--seq-len", "128k", "--nodes", "1",
                           "--engine", "closed-form", "--top", "20"]),
    ("qwen35-256k-2n", ["--model", "qwen3.5-27b", "--seq-len", "256k", "--nodes", "2"]),
    ("m8-h100-128k-4n", ["--model", "nemotron-diffusion-8b", "--hardware", "h100", "--seq-len", "128k",
                         "--nodes", "4", "--top", "25"]),
    ("m3-64k-1n-axes", ["--model", "nemotron-diffusion-3b", "--seq-len", "64k", "--nodes", "1",
                        "--axes", "dp,cp,bp", "--top", "15"]),
    ("dflash2-64k-1n", ["--model", "dflash2-qwen3.8-27b", "--seq-len", "64k", "--nodes", "1"]),
]

# what the search reports about its own work: it changes when the search gets smarter
OWN_WORK = ("evaluations", "pruned", "screened", "rescored")
# the planner's answer in the JSON (what-if and sensitivity re-rank it; they have their own tests)
ANSWER = ("default_job", "recommended", "baseline", "speedup", "candidates", "infeasible", "search",
          "plan_file", "torchrun")


@cache
def planned(flags: tuple[str, ...], exhaustive: bool = False):
    """`csbp plan FLAGS --json` answered; `exhaustive`: every candidate screened (no pruning).
    Cached: both tests read the pruned answer of a case (read only), computed once."""
    argv = ["plan", *flags, "--json", "--jobs", "1"]
    args = build_parser(argv).parse_args(argv)
    if not exhaustive:
        return answer(args)
    with mock.patch.object(plan_command, "search", lambda *a, keep=None, **k: search(*a, **k)):
        return answer(args)


def record(flags: list[str]) -> dict:
    p = planned(tuple(flags), exhaustive=True)
    return {"json": {k: v for k, v in json.loads(json.dumps(p.to_json())).items() if k in ANSWER},
            "ranking": [label_of(r) for r in p.found.ranked]}


def recorded_part(out: dict, recorded: dict) -> dict:
    """`out` with the keys that were recorded, less the search keys describing the search's own
    work (keys added since are new information, not a change)."""
    return {k: out[k] for k in recorded} | {
        "search": {k: out["search"][k] for k in recorded["search"] if k not in OWN_WORK}}


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("name, flags", CASES, ids=[c[0] for c in CASES])
def test_plan_json_unchanged(name, flags, golden):
    from test_speed_golden import assert_close

    got = json.loads(json.dumps(planned(tuple(flags)).to_json()))
    want = golden[name]["json"]
    assert_close(recorded_part(got, want), recorded_part(want, want), name)


@pytest.mark.parametrize("name", ["default", "qwen35-128k-1n-cf", "m3-64k-1n-axes", "dflash2-64k-1n"])
def test_exhaustive_ranking_unchanged_and_pruned_ranking_follows_it(name, golden):
    """Every feasible candidate screened ranks as recorded; a pruned search ranks what it
    screened in the same order (its first entries are the recorded ones)."""
    flags = tuple(dict(CASES)[name])
    full = [label_of(r) for r in planned(flags, exhaustive=True).found.ranked]
    assert full == golden[name]["ranking"]
    pruned = planned(flags).found
    labels = [label_of(r) for r in pruned.ranked]
    top = int(flags[flags.index("--top") + 1]) if "--top" in flags else 10
    # placement variants are tried on the re-scored plans only: the screened space is the rest
    screened_space = [label for label in full if not label.endswith("ctx-striped")]
    assert pruned.pruned + pruned.screened == pruned.feasible == len(screened_space)
    assert pruned.pruned > 0 or pruned.feasible <= top  # nothing to prune when all are reported
    assert labels[:top] == full[:top]
    assert labels == [label for label in full if label in set(labels)]  # the recorded order


if __name__ == "__main__" and "--record" in sys.argv:
    GOLDEN.write_text(json.dumps({name: record(flags) for name, flags in CASES}, indent=1,
                                 sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}")
