import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]  # the checkout the tests run in


def import_script(path: Path) -> ModuleType:
    """A script of scripts/ imported as a module under test, registered in sys.modules under ``<stem>_under_test``
    (dataclasses resolve their annotations through it)."""
    spec = importlib.util.spec_from_file_location(f"{path.stem}_under_test", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
