"""--what-if: only the named figures change, reports state the values, bad input is one line."""

from __future__ import annotations

import json

import pytest

from csbp.simulator.commands.cli import main
from csbp.simulator.errors import InputError
from csbp.simulator.system.hardware import list_profiles, load_profile
from csbp.simulator.grids.what_if import SHORT_NAMES, apply
from test_planner import fake_engine  # noqa: F401  (fixture)


def _leaves(data, prefix=""):
    """{dotted path: value} of every figure of a dumped profile (curves as one value)."""
    out = {}
    for key, value in data.items():
        if isinstance(value, dict) and key != "call_seconds":
            out |= _leaves(value, f"{prefix}{key}.")
        else:
            out[prefix + key] = value
    return out


def _changed(before, after) -> dict:
    a, b = _leaves(before.model_dump(exclude={"sources", "name"})), _leaves(after.model_dump(exclude={"sources", "name"}))
    assert a.keys() == b.keys()
    return {k: (a[k], b[k]) for k in a if a[k] != b[k]}


@pytest.fixture(scope="module")
def h200():
    return load_profile("h200")


def test_group_scales_only_its_figures(h200):
    w = apply(h200, "nvlink=2x")
    changed = _changed(h200, w.profile)
    assert set(changed) == {"links.nvlink.collective_gbs", "links.nvlink.p2p_gbs", "links.nvlink.alltoall_gbs"}
    assert all(new == 2 * old for old, new in changed.values())
    assert {c.field for c in w.changes} == set(changed)
    assert w.profile.links.infiniband == h200.links.infiniband and w.profile.gpu == h200.gpu


@pytest.mark.parametrize("spec, fields", [
    ("ib=0.5x", {"links.infiniband.collective_gbs", "links.infiniband.p2p_gbs",
                 "links.infiniband.alltoall_gbs"}),
    ("hbm=6000", {"gpu.hbm_gbs"}),
    ("flops=+20%", {"gpu.peak_tflops"}),
    ("reserve=-20%", {"gpu.reserved_gib"}),
    ("attention=0.9x", {"gpu.attention_forward_efficiency", "gpu.attention_backward_efficiency"}),
    ("links.nvlink.p2p_gbs=300,gpu.peak_tflops=1.5x", {"links.nvlink.p2p_gbs", "gpu.peak_tflops"}),
    ("domain=2x", {"node.gpus_per_node"}),
])
def test_only_named_fields_change(h200, spec, fields):
    w = apply(h200, spec)
    assert set(_changed(h200, w.profile)) == fields
    changed_sources = {k for k in h200.sources if h200.sources[k] != w.profile.sources[k]}
    assert changed_sources == fields  # each scaled figure says so in its source, no other does
    assert w.profile.name == f"h200 what-if({spec})"


def test_values_are_what_was_asked(h200):
    p = apply(h200, "hbm=6000,flops=+20%,attention=0.5x,domain=2x").profile
    assert p.gpu.hbm_gbs == 6000 and p.gpu.peak_tflops == pytest.approx(989.4 * 1.2)
    assert p.node.gpus_per_node == 16 and isinstance(p.node.gpus_per_node, int)
    fwd, old = p.gpu.attention_forward_efficiency, h200.gpu.attention_forward_efficiency
    assert [x for x, _ in fwd] == [x for x, _ in old]  # sizes kept, fractions scaled
    assert [y for _, y in fwd] == pytest.approx([0.5 * y for _, y in old])


def test_no_what_if_is_the_profile_itself(h200):
    assert apply(h200, None).profile is h200 and apply(h200, "").changes == ()


@pytest.mark.parametrize("name", sorted(SHORT_NAMES))
def test_every_short_name_applies_to_every_cluster_profile(name):
    for profile in ("h100", "h200", "b200", "gb200-nvl72"):
        assert apply(load_profile(profile), f"{name}=1x").changes


def test_new_profiles_ship():
    assert {"b200", "gb200-nvl72"} <= set(list_profiles())
    b200, nvl72 = load_profile("b200"), load_profile("gb200-nvl72")
    assert b200.node.gpus_per_node == 8 and nvl72.node.gpus_per_node == 72
    assert b200.gpu.peak_tflops > load_profile("h200").gpu.peak_tflops
    for p in (b200, nvl72):  # every figure sourced; the carried-over ones say they are assumed
        kernels = {k for k in p.sources if k.startswith("gpu.attention_kernels.")}
        assert kernels and all("[U]" in p.sources[k] for k in kernels)  # carried over from H100
        assert all(s.strip() for s in p.sources.values()) and len(set(p.sources) - kernels) >= 25
        assert "[U]" in p.sources["gpu.attention_forward_efficiency"]


@pytest.mark.parametrize("spec, message", [
    ("nvlnk=2x", "unknown name"),
    ("nvlink", "write name=value"),
    ("nvlink=fast", "neither a factor"),
    ("nvlink=-2x", "neither a factor"),
    ("nvlink=0x", "positive"),
    ("nvlink=370", "scale them with a factor"),
    ("attention=2x", "would exceed a fraction of 1"),
    ("attention=0.5", "scale them with a factor"),
    ("gemm=0.5", "scale it with a factor"),
    ("reserve=500", "leaves no memory"),
    ("domain=1.3x", "whole number"),
    ("gpu.name=2x", "not a number or a curve"),
    ("gpu.nope=2x", "no such field"),
    ("gpu.op_overhead_us=2x", "not set in this profile"),
    ("nvlink=2x,links.nvlink.p2p_gbs=300", "changed twice"),
    (",", "give name=value items"),
])
def test_bad_what_if_is_one_line_exit_2(capsys, spec, message):
    with pytest.raises(InputError, match=message):
        apply(load_profile("h200"), spec)
    for command in (["simulate"], ["plan"], ["sweep", "--out-dir", "/nonexistent/x"],
                    ["map", "--out-dir", "/nonexistent/x"]):
        assert main([*command, "--what-if", spec]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err


def test_ib_on_a_single_host_profile_is_refused(capsys):
    assert main(["simulate", "--hardware", "cpu-measured", "--what-if", "ib=2x"]) == 2
    assert "no infiniband link" in capsys.readouterr().err


def test_simulate_reports_the_scaled_values(capsys):
    argv = ["simulate", "--model", "tiny", "--seq-len", "4096", "--nodes", "1", "--plan", "dp=2,cp=2,bp=4",
            "--engine", "closed-form", "--what-if", "nvlink=2x,hbm=6000"]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["hardware"] == "h200 what-if(nvlink=2x,hbm=6000)"
    assert "what-if: links.nvlink.p2p_gbs: 180 -> 360 (x2)" in out["notes"]
    assert "what-if: gpu.hbm_gbs: 4800 -> 6000 (set)" in out["notes"]
    assert main(argv) == 0
    assert "gpu.hbm_gbs: 4800 -> 6000" in capsys.readouterr().out


def test_plan_reports_the_scaled_values(fake_engine, capsys):
    argv = ["plan", "--model", "tiny", "--seq-len", "4096", "--nodes", "1", "--engine", "closed-form",
            "--jobs", "1", "--what-if", "ib=0.5x,flops=2x"]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    fields = {c["field"]: c for c in out["what_if"]}
    assert fields["gpu.peak_tflops"] == {"field": "gpu.peak_tflops", "was": 989.4, "now": 1978.8, "how": "x2"}
    assert fields["links.infiniband.p2p_gbs"]["now"] == 20
    assert out["recommended"]["hardware"].startswith("h200 what-if(")
    assert main(argv) == 0
    assert "what-if: gpu.peak_tflops: 989.4 -> 1978.8 (x2)" in capsys.readouterr().out
