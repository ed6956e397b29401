"""The scripts of bench/ as modules, for the tests that check them without a GPU."""

import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def load(name):
    """bench/<name>.py imported as the module `name` (registered in sys.modules, which the
    dataclasses of a script need)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
