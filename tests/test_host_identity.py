"""Host identity: a profile from another host, torch or long ago is warned about, one line per
reason, each recommending `csbp calibrate`; a profile from this host is not."""

import datetime as dt

import yaml

from csbp.runtime.calibration.host_identity import HostIdentity, profile_warnings, this_host
from csbp.simulator.system.hardware import PROFILE_DIR, load_profile

HERE = HostIdentity(host="here", cpu_model="Test CPU 9000", cpus=2, torch="2.13.0", date="2026-11-30")


def _profile(**fields):
    base = load_profile("cpu-measured").model_copy(update=HERE.as_profile_fields())
    return base.model_copy(update=fields)


def test_same_host_recent_profile_has_no_warning():
    assert profile_warnings(_profile(), HERE) == []
    assert profile_warnings(_profile(date="2026-11-24"), HERE) == []  # six days: still fresh


def test_another_host_names_what_differs():
    (line,) = profile_warnings(_profile(host="vm", cpu_model="Intel(R) Xeon(R) Processor", cpus=4), HERE)
    assert "another host" in line and "csbp calibrate" in line
    assert "'vm' there, 'here' here" in line and "Intel(R) Xeon(R) Processor" in line and "4 there, 2 here" in line
    (line,) = profile_warnings(_profile(cpu_model="Other CPU"), HERE)  # same name, other CPU
    assert "CPU 'Other CPU' there, 'Test CPU 9000' here" in line


def test_profile_without_identity_has_unknown_origin():
    (line,) = profile_warnings(_profile(cpu_model=None, cpus=None, torch=None), HERE)
    assert "origin is unknown" in line and "CPU model or core count" in line and "csbp calibrate" in line


def test_old_profile_and_other_torch():
    lines = profile_warnings(_profile(date="2026-10-01", torch="2.6.0"), HERE)
    assert len(lines) == 2
    assert any("60 days ago (2026-10-01)" in line for line in lines)
    assert any("torch 2.6.0" in line and "2.13.0" in line for line in lines)
    assert all("csbp calibrate" in line for line in lines)


def test_datasheet_profile_is_not_a_measurement_of_this_host():
    (line,) = profile_warnings(load_profile("h100"), HERE)
    assert "datasheet" in line and "csbp calibrate" in line


def test_a_profile_file_from_another_host_loads_and_warns(tmp_path):
    raw = yaml.safe_load((PROFILE_DIR / "cpu-measured.yaml").read_text())
    raw |= {"host": "elsewhere", "cpu_model": "Other CPU", "cpus": 64, "torch": "2.13.0", "date": "2026-11-30"}
    path = tmp_path / "elsewhere.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    p = load_profile(str(path))
    assert (p.host, p.cpu_model, p.cpus) == ("elsewhere", "Other CPU", 64)
    (line,) = profile_warnings(p, HERE)
    assert "'elsewhere' there" in line and "64 there, 2 here" in line


def test_this_host():
    me = this_host(dt.date(2026, 1, 2))
    assert me.host and me.cpu_model and me.cpus >= 1 and me.date == "2026-01-02"
    assert profile_warnings(_profile(**me.as_profile_fields()), me) == []
