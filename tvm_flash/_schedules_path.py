"""Make ``tvm_flash.schedules`` importable from a source checkout as well as when installed.

An installed wheel maps the top-level ``schedules/`` directory to ``tvm_flash.schedules``
(``package-dir`` in pyproject.toml). Running from a checkout without installing (for example
with ``PYTHONPATH=.`` on a machine without a package index), the same directory is found next
to this package and registered under that name.
"""

from __future__ import annotations

import importlib
import importlib.util
import pathlib
import sys


def load():
    try:
        return importlib.import_module("tvm_flash.schedules")
    except ModuleNotFoundError as err:
        if err.name != "tvm_flash.schedules":
            raise
    init = pathlib.Path(__file__).resolve().parent.parent / "schedules" / "__init__.py"
    if not init.exists():
        raise ModuleNotFoundError("tvm_flash.schedules is not installed and no schedules/ "
                                  "directory is next to the tvm_flash package")
    spec = importlib.util.spec_from_file_location(
        "tvm_flash.schedules", init, submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["tvm_flash.schedules"] = module
    spec.loader.exec_module(module)
    return module
