"""The planner's search: enumeration, screening, ranking, baseline, infeasible groups, CLI."""

from __future__ import annotations

import json

import pytest

from csbp.simulator.planner import planner
from csbp.simulator.errors import InputError
from csbp.simulator.system.hardware import load_profile
from csbp.simulator.plan.plan import Plan
from csbp.simulator.workload.presets import load_model
from csbp.simulator.report.result import Result
from csbp.simulator.workload.workload import Workload

TINY = load_model("tiny")  # 4 heads, 2 KV heads, dense
WL = Workload(seq_len=4096, block_size=256)


def fake_result(model, workload, plan: Plan, profile, nodes, engine="des", overlap=True,
                with_trace=True) -> Result:
    """A stand-in engine whose answer is known: BP and CP help, TP hurts, dp >= 8 runs out of memory,
    and the event engine sees 10 % more throughput than the closed form."""
    common = dict(model=model.name, hardware=profile.name, nodes=nodes,
                  gpus=nodes * profile.node.gpus_per_node,
                  plan=plan.model_dump() | {"kind": plan.kind, "label": plan.label()},
                  workload=workload.model_dump(), engine=engine)
    if plan.dp >= 8:
        return Result(feasible=False, reason=f"out of memory: {40 + plan.dp} GiB > 40 GiB usable", **common)
    speed = 1000.0 * plan.bp ** 0.5 * plan.cp ** 0.3 / plan.tp * (1.1 if engine == "des" else 1.0)
    speed *= 1.05 if workload.checkpointing == "none" else 1.0
    speed *= 1.01 if plan.transport == "collective" and plan.schedule == "dual-end" else 1.0
    return Result(feasible=True, reason=None, step_time_s=workload.seq_len / speed, tokens_per_s=speed,
                  peak_memory_gib=10.0, attention_traffic_gib_per_gpu=1.0 / plan.bp,
                  exposed_comm_s=0.01, **common)


@pytest.fixture
def fake_engine(monkeypatch):
    monkeypatch.setattr(planner, "simulate", fake_result)


@pytest.fixture(scope="module")
def h200():
    return load_profile("h200")


def test_space_covers_every_factorisation_once():
    space = planner.enumerate_space(TINY, WL, 8)
    topologies = {(c.plan.dp, c.plan.tp, c.plan.ep, c.plan.cp, c.plan.bp) for c in space.candidates}
    for dp, tp, ep, cp, bp in topologies:
        assert dp * tp * ep * max(cp, bp) == 8
    assert (2, 1, 1, 2, 4) in topologies and (1, 1, 1, 8, 1) in topologies and (8, 1, 1, 1, 1) in topologies
    labels = [c.label for c in space.candidates]
    assert len(labels) == len(set(labels)), "two candidates describe the same computation"


def test_choices_only_vary_where_they_matter():
    space = planner.enumerate_space(TINY, WL, 4)
    per_topology: dict[tuple, int] = {}
    for c in space.candidates:
        key = (c.plan.dp, c.plan.tp, c.plan.cp, c.plan.bp)
        per_topology[key] = per_topology.get(key, 0) + 1
    assert per_topology[(4, 1, 1, 1)] == 2  # checkpointing only
    assert per_topology[(1, 1, 1, 4)] == 4  # + schedule
    assert per_topology[(1, 1, 4, 1)] == 4  # + transport
    assert per_topology[(1, 1, 2, 4)] == 8  # all three


def test_rule_violations_are_grouped_not_raised():
    space = planner.enumerate_space(TINY, WL, 8)
    reasons = set(space.rejected)
    assert "rule: ep needs a MoE model" in reasons  # tiny is dense
    assert "rule: tp does not divide N attention heads" in reasons  # tp=8 > 4 heads
    assert any("bp >= cp" in r for r in reasons)
    assert not any(c.plan.ep > 1 or c.plan.tp > 4 for c in space.candidates)


def test_reason_groups_strip_numbers():
    assert planner.reason_group("out of memory: 150.2 GiB > 131 GiB", rule=False) == "memory"
    assert planner.reason_group("fused CP/BP needs bp % cp == 0 (got cp=4, bp=6)", rule=True) == \
        "rule: fused CP/BP needs bp % cp == N"
    assert planner.reason_group("ep=2 needs a MoE model; qwen3-8b is dense", rule=True) == \
        "rule: ep needs a MoE model"


def test_search_ranks_baseline_and_groups(fake_engine, h200):
    found = planner.search(TINY, WL, h200, nodes=1)
    rec = found.recommended
    assert rec.engine == "des" and rec.plan["bp"] == 8 and rec.plan["tp"] == 1
    assert rec.workload["checkpointing"] == "none"
    speeds = [r.tokens_per_s for r in found.ranked if r.engine == "des"]
    assert speeds == sorted(speeds, reverse=True)
    base = found.baseline
    assert base.plan["bp"] == 1 and base.plan["cp"] == 8 and base.engine == "des"
    assert found.speedup == pytest.approx(rec.tokens_per_s / base.tokens_per_s)
    assert found.speedup > 1
    memory = next(g for g in found.infeasible if g.reason == "memory")
    assert memory.plans and all("dp=8" in p for p in memory.plans)
    families = found.best_per_family()
    assert set(families) == {"cp", "bp", "csbp", "dp"}


def test_closed_form_only_search(fake_engine, h200):
    found = planner.search(TINY, WL, h200, nodes=1, engine="closed-form")
    assert {r.engine for r in found.ranked} == {"closed-form"}
    assert found.evaluations == found.candidates


def test_nothing_feasible_is_input_error(monkeypatch, h200):
    monkeypatch.setattr(planner, "simulate", lambda model, wl, plan, *a, engine="des", **k: Result(
        False, "infeasible: needs 999 GiB per GPU", model.name, "h200", 1, 8, {}, {}, engine))
    with pytest.raises(InputError, match="nothing feasible.*memory"):
        planner.search(TINY, WL, h200, nodes=1)


def test_impossible_cluster(h200, fake_engine):
    with pytest.raises(InputError, match="impossible cluster"):
        planner.search(TINY, WL, h200, nodes=0)


# ---- the command ---------------------------------------------------------------------------

def csbp(*argv):
    from csbp.simulator.commands.cli import main

    return main(list(argv))


def test_plan_json_keys(fake_engine, capsys):
    assert csbp("plan", "--model", "tiny", "--seq-len", "4096", "--nodes", "1", "--top", "3", "--json") == 0
    out = json.loads(capsys.readouterr().out)
    assert {"recommended", "baseline", "candidates", "infeasible"} <= set(out)
    assert len(out["candidates"]) == 3
    keys = set(Result(True, None, "m", "h", 1, 1, {}, {}, "des").to_json())
    assert keys <= set(out["recommended"]) and keys <= set(out["candidates"][0])
    assert out["baseline"]["plan"]["bp"] == 1
    assert out["infeasible"][0]["count"] >= 1


def test_plan_default_job_says_so(fake_engine, capsys):
    assert csbp() == 0
    out = capsys.readouterr().out
    assert "built-in default job" in out and "Nemotron-Labs-Diffusion 8B at 256K on 2 x 8 H200" in out
    assert "Recommended" in out and "Baseline" in out


@pytest.mark.parametrize("argv, message", [
    (["--model", "nope"], "unknown model"),
    (["--hardware", "nope"], "unknown hardware profile"),
    (["--seq-len", "1000"], "not a multiple of block-size"),
    (["--nodes", "0"], "impossible cluster"),
])
def test_plan_bad_input_is_one_line_exit_2(fake_engine, capsys, argv, message):
    assert csbp("plan", *argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and "Traceback" not in err


def test_torchrun_command():
    from csbp.simulator.commands.plan import torchrun_command

    assert torchrun_command(2, 8, "plan.json") == (
        "torchrun --nnodes 2 --rdzv-backend c10d --rdzv-endpoint $MASTER_ADDR:29500 "
        "--nproc-per-node 8 -m csbp.runtime.training.torchrun --plan plan.json")
    assert torchrun_command(1, 8, "p.json").startswith("torchrun --standalone --nproc-per-node 8")


def test_axes_restrict_the_space():
    space = planner.enumerate_space(TINY, WL, 8, axes=("dp", "cp", "bp"))
    assert space.candidates and all(c.plan.tp == c.plan.ep == 1 for c in space.candidates)
    only_ctx = planner.enumerate_space(TINY, WL, 8, axes=("cp", "bp"))
    assert all(c.plan.dp == 1 and c.plan.ctx == 8 for c in only_ctx.candidates)


def test_out_writes_a_runtime_plan_file(fake_engine, tmp_path, capsys):
    from csbp.simulator.planner import planfile

    path = tmp_path / "plan.json"
    argv = ["plan", "--model", "tiny", "--seq-len", "4096", "--nodes", "1", "--axes", "dp,cp,bp",
            "--out", str(path), "--json"]
    assert csbp(*argv) == 0
    out = json.loads(capsys.readouterr().out)
    pf = planfile.load(path)
    rec = out["recommended"]
    assert pf.model == "tiny" and pf.nodes == 1 and pf.hardware == "h200"
    assert pf.plan.bp == rec["plan"]["bp"] and pf.plan.tp == 1
    assert pf.workload.checkpointing == rec["workload"]["checkpointing"]
    assert out["torchrun"].endswith(f"-m csbp.runtime.training.torchrun --plan {path}")


def test_bad_axes(capsys):
    assert csbp("plan", "--axes", "dp,xp") == 2
    assert "--axes" in capsys.readouterr().err


def test_memory_goes_first(h200):
    big, wl = load_model("nemotron-diffusion-8b"), Workload(seq_len=256 * 1024)
    dp = planner.Candidate(Plan(dp=16), wl)
    csbp_ = planner.Candidate(Plan(dp=2, cp=8, bp=8), wl)
    assert planner.reason_group(planner.memory_misfit(big, dp, h200), rule=False) == "memory"
    assert planner.memory_misfit(big, csbp_, h200) is None


def test_search_without_misfits_ranks_the_same(h200):
    """`misfits=False` (a map's cells) checks memory only where the screen looks: the ranking,
    baseline and family bests are the full search's (the same simulations in one process, so
    equal to the bit), and the candidates it never checked are not reported as misfits."""
    model, wl = load_model("nemotron-diffusion-8b"), Workload(seq_len=64 * 1024)
    full = planner.search(model, wl, h200, 1, workers=1, keep=1)
    lazy = planner.search(model, wl, h200, 1, workers=1, keep=1, misfits=False)
    assert [r.to_json() for r in lazy.ranked] == [r.to_json() for r in full.ranked]
    assert lazy.baseline.to_json() == full.baseline.to_json()
    assert {f: r.to_json() for f, r in lazy.best_per_family().items()} == \
        {f: r.to_json() for f, r in full.best_per_family().items()}
    missing = lambda found: sum(len(g.plans) for g in found.infeasible)  # noqa: E731
    assert missing(lazy) < missing(full)


def test_search_without_misfits_says_why_nothing_fits_as_the_full_one(h200):
    """Where nothing fits, the cell's line (the map's 'why nothing') is the full search's: every
    candidate checked, in order, before the error is raised."""
    model, wl = load_model("nemotron-diffusion-8b"), Workload(seq_len=1024 * 1024)
    messages = []
    for misfits in (True, False):
        with pytest.raises(InputError, match="nothing feasible") as err:
            planner.search(model, wl, h200, 1, workers=1, keep=1, misfits=misfits)
        messages.append(str(err.value))
    assert messages[0] == messages[1]
