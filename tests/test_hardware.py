"""Hardware profiles: shipped files load, every figure is sourced, curves behave, bad input is one line."""

from pathlib import Path

import pytest
import yaml

from csbp.simulator.errors import InputError
from csbp.simulator.system.hardware import PROFILE_DIR, HardwareProfile, interpolate, list_profiles, load_profile

SHIPPED = ["h100", "h200"]


def _leaves(data: dict, prefix: str = ""):
    """Dotted paths of every numeric value (number or curve) in a dumped profile."""
    for key, value in data.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")
        elif isinstance(value, (int, float, list, tuple)) and not isinstance(value, bool):
            yield prefix + key


def _raw(name: str) -> dict:
    return yaml.safe_load((PROFILE_DIR / f"{name}.yaml").read_text())


def _load_error(tmp_path: Path, text: str) -> str:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(InputError) as err:
        load_profile(str(path))
    message = str(err.value)
    assert "\n" not in message
    return message


def test_shipped_profiles_are_listed():
    assert set(SHIPPED) <= set(list_profiles())


@pytest.mark.parametrize("name", SHIPPED)
def test_profile_loads_with_plain_numbers(name):
    p = load_profile(name)
    assert p.name == name and p.kind == "datasheet"
    assert isinstance(p.gpu.peak_tflops, float) and p.gpu.peak_tflops == pytest.approx(989.4)
    assert p.node.gpus_per_node == 8
    assert 0 < p.gpu.usable_gib < p.gpu.memory_gib
    assert p.link("nvlink") is p.links.nvlink


@pytest.mark.parametrize("name", SHIPPED)
def test_every_figure_has_a_source(name):
    p = load_profile(name)
    figures = set(_leaves(p.model_dump(exclude={"sources"})))
    assert figures == set(p.sources)
    families = {f for f in figures if f.startswith("gpu.attention_kernels.")}
    head_dims = sum(k.head_dim_factors is not None for k in p.gpu.attention_kernels.values())
    assert len(families) == 2 * len(p.gpu.attention_kernels) + head_dims  # both factors of every family
    assert len(figures - families) >= 25  # 24 + node.storage_gbs (+ figures added since)
    assert all(s.strip() for s in p.sources.values())


def test_load_by_path_equals_load_by_name():
    assert load_profile(str(PROFILE_DIR / "h100.yaml")) == load_profile("h100")


def test_h200_differs_where_the_reference_says():
    h100, h200 = load_profile("h100"), load_profile("h200")
    assert h200.gpu.memory_gib > 140 and h200.gpu.hbm_gbs == 4800
    assert h200.gpu.peak_tflops == h100.gpu.peak_tflops
    assert h200.attention_efficiency(4096, backward=False) < h100.attention_efficiency(4096, backward=False)
    assert h200.attention_efficiency(4096, backward=True) > h100.attention_efficiency(4096, backward=True)
    assert h200.links == h100.links


@pytest.mark.floats
@pytest.mark.parametrize("name", SHIPPED)
def test_curves_are_monotone(name):
    p = load_profile(name)
    curves = [p.gpu.gemm_efficiency, p.gpu.attention_forward_efficiency,
              p.gpu.attention_backward_efficiency, p.links.nvlink.size_efficiency,
              p.links.infiniband.size_efficiency]
    for curve in curves:
        ys = [y for _, y in curve]
        assert ys == sorted(ys)
    sizes = [2.0 ** k for k in range(4, 16)]
    fwd = [p.attention_efficiency(s, backward=False) for s in sizes]
    bwd = [p.attention_efficiency(s, backward=True) for s in sizes]
    assert fwd == sorted(fwd) and bwd == sorted(bwd)
    assert all(b < f for f, b in zip(fwd, bwd))  # backward is the less efficient pass


@pytest.mark.floats
def test_reference_figures():
    p = load_profile("h100")
    assert p.gemm_efficiency(1e4) == pytest.approx(0.803)  # MAMF best shape
    # rel 0.01: the published TFLOP/s are read off a plot, to about 1 %
    assert p.attention_efficiency(1024, backward=False) * 989.4 == pytest.approx(541, rel=0.01)
    assert p.attention_efficiency(8192, backward=True) * 989.4 == pytest.approx(561, rel=0.01)
    masked = p.attention_efficiency(2048, backward=True, masked=True)
    assert masked == pytest.approx(p.attention_efficiency(2048, backward=True) * 0.8)
    assert p.links.nvlink.p2p_gbs < p.links.nvlink.collective_gbs
    assert p.links.infiniband.collective_gbs < p.links.nvlink.collective_gbs


@pytest.mark.floats
def test_interpolate_is_log_linear_and_clamps():
    curve = ((1.0, 0.2), (100.0, 0.6))
    assert interpolate(curve, 10.0) == pytest.approx(0.4)
    assert interpolate(curve, 50.5, log_x=False) == pytest.approx(0.4)
    assert interpolate(curve, 0.0) == 0.2 and interpolate(curve, 1e-9) == 0.2
    assert interpolate(curve, 1e12) == 0.6
    assert interpolate(((5.0, 0.7),), 1.0) == 0.7


def test_link_unknown_name():
    with pytest.raises(InputError, match="unknown link"):
        load_profile("h100").link("ethernet")


def test_unknown_name():
    with pytest.raises(InputError, match="unknown hardware profile 'mi300x'") as err:
        load_profile("mi300x")
    assert "\n" not in str(err.value)


def test_missing_file():
    with pytest.raises(InputError, match="no such hardware profile file"):
        load_profile("/nonexistent/mine.yaml")


def _mutated(mutate) -> str:
    raw = _raw("h100")
    mutate(raw)
    return yaml.safe_dump(raw)


@pytest.mark.parametrize("mutate, expected", [
    (lambda r: r["gpu"]["peak_tflops"].pop("source"), "gpu.peak_tflops: write as"),
    (lambda r: r["gpu"]["peak_tflops"].update(source="  "), "gpu.peak_tflops: source must be"),
    (lambda r: r["gpu"].update(peak_tflops=989.4), "gpu.peak_tflops: write as"),
    (lambda r: r["links"]["nvlink"].update(hops={"value": 1, "source": "x"}), "links.nvlink.hops"),
    (lambda r: r.update(colour="green"), "colour"),
    (lambda r: r["gpu"].pop("hbm_gbs"), "gpu.hbm_gbs: Field required"),
    (lambda r: r["gpu"]["hbm_gbs"].update(value=-1), "gpu.hbm_gbs: Input should be greater than 0"),
    (lambda r: r["gpu"]["hbm_gbs"].update(value="fast"), "gpu.hbm_gbs"),
    (lambda r: r["gpu"]["hbm_efficiency"].update(value=1.5), "gpu.hbm_efficiency"),
    (lambda r: r["gpu"]["gemm_efficiency"].update(value=[[16, 0.7], [1, 0.5]]), "strictly increasing"),
    (lambda r: r["gpu"]["gemm_efficiency"].update(value=[]), "gpu.gemm_efficiency"),
    (lambda r: r["gpu"]["reserved_gib"].update(value=100.0), "leaves no memory"),
    (lambda r: r.update(kind="guessed"), "kind"),
    (lambda r: r.update(sources={"gpu.name": "me"}), "do not write it"),
])
def test_bad_profile_is_one_line_input_error(tmp_path, mutate, expected):
    assert expected in _load_error(tmp_path, _mutated(mutate))


@pytest.mark.parametrize("text, expected", [
    ("gpu: [unclosed\n", "malformed YAML"),
    ("- just\n- a list\n", "must be a YAML mapping"),
    ("", "must be a YAML mapping"),
])
def test_malformed_file(tmp_path, text, expected):
    assert expected in _load_error(tmp_path, text)


def test_profile_is_frozen():
    p = load_profile("h100")
    with pytest.raises(ValueError):
        p.gpu.peak_tflops = 1.0  # type: ignore[misc]
    assert isinstance(p, HardwareProfile)


def _with_dense(**gpu_overrides):
    import yaml as _yaml

    raw = _yaml.safe_load((PROFILE_DIR / "h100.yaml").read_text())
    curve = {"value": [[0.1, 0.5], [10.0, 0.25]], "source": "test"}
    for f in ("dense_visible_forward_efficiency", "dense_visible_backward_efficiency"):
        raw["gpu"][f] = curve
    for f in ("dense_masked_forward_efficiency", "dense_masked_backward_efficiency"):
        raw["gpu"][f] = {"value": [[0.1, 0.1], [10.0, 0.05]], "source": "test"}
    raw["gpu"]["dense_attention"] = {"value": True, "source": "test"}
    raw["gpu"].update(gpu_overrides)
    return raw


@pytest.mark.floats
def test_dense_attention_prices_visible_and_masked_scores():
    from csbp.simulator.system.hardware import HardwareProfile

    p = HardwareProfile.model_validate(_with_dense())
    peak = p.gpu.peak_tflops * 1e12
    x = 1e9  # one GFLOP call: on the curves' log-linear middle
    vis = 0.5 + (0.25 - 0.5) * 0.5
    mask = 0.1 + (0.05 - 0.1) * 0.5
    assert p.dense_attention_seconds(0.25 * x, x, 1, False) == pytest.approx(
        0.25 * x / (peak * vis) + 0.75 * x / (peak * mask))
    assert p.dense_attention_seconds(x, x, 1, True) == pytest.approx(x / (peak * vis))
    assert load_profile("h100").dense_attention_seconds(x, x, 1, False) is None


def test_dense_curves_come_all_or_none():
    from csbp.simulator.system.hardware import HardwareProfile

    raw = _with_dense()
    del raw["gpu"]["dense_masked_backward_efficiency"]
    with pytest.raises(Exception, match="give all of"):
        HardwareProfile.model_validate(raw)


@pytest.mark.floats
def test_host_overhead_shares_cores_like_arithmetic():
    from csbp.simulator.cost.cost import compute_seconds
    from csbp.simulator.cost.graph import Compute
    from csbp.simulator.system.hardware import HardwareProfile

    raw = _with_dense()
    raw["gpu"]["op_overhead_us"] = {"value": 100.0, "source": "test"}
    raw["node"]["cores"] = {"value": 2.0, "source": "test"}
    p = HardwareProfile.model_validate(raw)
    work = Compute("elementwise", (0.0,), (1e3,), kernels=10)
    alone, shared = (float(compute_seconds(work, p.on_one_host(n))[0]) for n in (2, 4))
    assert shared == pytest.approx(2 * alone) and alone > 10 * 100e-6
