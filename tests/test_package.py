"""The installed library: one `csbp` namespace, and `csbp.plan` / `csbp.simulate` equal to the
commands' JSON (the functions are the commands, not a second implementation)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import csbp
from csbp.simulator.commands.cli import main

TINY = {"model": "tiny", "seq_len": "1024", "block_size": 64, "nodes": 1}
TINY_FLAGS = ["--model", "tiny", "--seq-len", "1024", "--block-size", "64", "--nodes", "1"]


def _cli_json(argv: list[str], capsys) -> dict:
    capsys.readouterr()
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_function_is_the_plan_command(capsys):
    planned = csbp.plan(**TINY, engine="closed-form", axes="dp,cp,bp", top=5)
    cli = _cli_json(["plan", *TINY_FLAGS, "--engine", "closed-form", "--axes", "dp,cp,bp",
                     "--top", "5", "--json"], capsys)
    assert planned.to_json() == cli
    assert planned.recommended.plan["label"] == cli["recommended"]["plan"]["label"]
    assert str(planned.recommended).startswith(cli["recommended"]["plan"]["label"])


def test_simulate_function_is_the_simulate_command(capsys):
    r = csbp.simulate(**TINY, plan="dp=2,cp=2,bp=4", engine="closed-form")
    assert r.to_json() == _cli_json(["simulate", *TINY_FLAGS, "--plan", "dp=2,cp=2,bp=4", "--engine",
                                     "closed-form", "--json"], capsys)


@pytest.mark.parametrize("flags, message", [
    ({"model": "no-such-model"}, "unknown model"),
    ({**TINY, "plan": "cp=3"}, "cp"),
    ({**TINY, "bogus_flag": 1}, "unrecognized arguments"),
])
def test_bad_arguments_raise_input_error(flags, message):
    with pytest.raises(csbp.InputError, match=message):
        csbp.simulate(**flags)


@pytest.mark.timeout(60)
def test_only_the_csbp_namespace_is_installed(tmp_path):
    """Outside the repository (whose folders a cwd import would find), no generic top-level
    `simulator`, `runtime` or `experiments` module exists; `csbp.*` does."""
    code = ("import importlib.util as u, json; print(json.dumps([u.find_spec(m) is not None for m in "
            "('simulator', 'runtime', 'experiments', 'csbp.simulator', 'csbp.runtime', "
            "'csbp.experiments')]))")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          timeout=50)
    assert json.loads(done.stdout) == [False, False, False, True, True, True], done.stderr


def test_every_module_sits_in_one_stage_folder():
    """The tree shows the architecture (docs/architecture.md): simulator/ and runtime/ hold stage
    folders only, each named in the architecture table, and pyproject installs every one of them."""
    from pathlib import Path

    import tomllib

    root = Path(__file__).resolve().parents[1]
    table = (root / "docs" / "architecture.md").read_text()
    installed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    for top, loose in (("simulator", {"__init__.py", "errors.py"}), ("runtime", {"__init__.py"})):
        here = root / top
        assert {p.name for p in here.glob("*.py")} == loose, f"modules loose in {top}/"
        for folder in (p for p in here.iterdir() if p.is_dir() and p.name != "__pycache__"):
            assert (folder / "__init__.py").exists(), folder
            assert f"`{top}/{folder.name}/" in table, f"{top}/{folder.name}/ is not in the architecture table"
            for package in (folder, *(p for p in folder.iterdir() if (p / "__init__.py").exists())):
                name = ".".join(("csbp", *package.relative_to(root).parts))
                assert name in installed, f"{name} is not in pyproject's packages"


def test_every_module_is_named_in_the_architecture_table():
    """A newcomer finds a module's room from the table: each stage folder's modules are listed
    in its row (as `name`)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    table = (root / "docs" / "architecture.md").read_text()
    rows = {line.split("|")[2]: line for line in table.splitlines() if line.startswith("| **")}
    for top in ("simulator", "runtime"):
        for folder in (p for p in (root / top).iterdir() if (p / "__init__.py").exists()):
            row = next((r for cell, r in rows.items() if f"`{top}/{folder.name}/" in cell), None)
            assert row, f"{top}/{folder.name}/ has no row"
            if folder.name == "interop":  # one row names the folder: readers of other frameworks
                continue
            for module in folder.glob("*.py"):
                if module.stem != "__init__":
                    assert f"`{module.stem}`" in row, f"{top}/{folder.name}/{module.name} is not in its row"
