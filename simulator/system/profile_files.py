"""Reading a profile file (hardware or implementation): by name from its folder, or by path.

Both kinds are YAML mappings a user may write by hand, so every way a file can be wrong (missing,
malformed, not text, not a mapping) is one line naming the file, never a traceback.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from csbp.simulator.errors import InputError

# libyaml's safe loader where PyYAML was built with it (the same documents, parsed in C: the
# pure-Python one takes ~0.1 s per implementation profile, paid by every fresh `csbp plan`)
SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def names_in(folder: Path) -> list[str]:
    return sorted(p.stem for p in folder.glob("*.yaml"))


def read_mapping(name_or_path: str, folder: Path, what: str) -> tuple[Path, dict]:
    """(path, YAML mapping) of the `what` (e.g. "hardware profile") named or pointed to."""
    path = Path(name_or_path)
    if not path.is_file():
        if path.suffix in (".yaml", ".yml") or len(path.parts) > 1:
            raise InputError(f"{path}: no such {what} file")
        if name_or_path not in names_in(folder):
            raise InputError(f"unknown {what} {name_or_path!r}: use one of "
                             f"{', '.join(names_in(folder))} or a path to a YAML file")
        path = folder / f"{name_or_path}.yaml"
    try:
        raw = yaml.load(path.read_text(), Loader=SAFE_LOADER)
    except yaml.YAMLError as err:
        raise InputError(f"{path}: malformed YAML: {' '.join(str(err).split())}") from None
    except OSError as err:
        raise InputError(f"{path}: cannot read: {err.strerror}") from None
    except UnicodeDecodeError:
        raise InputError(f"{path}: not a text file") from None
    except RecursionError:
        raise InputError(f"{path}: nested too deeply to be a {what}") from None
    if not isinstance(raw, dict):
        raise InputError(f"{path}: a {what} must be a YAML mapping")
    return path, raw
