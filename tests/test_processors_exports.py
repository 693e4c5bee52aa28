"""Every public name of ``processors`` can be imported from the package, in a fresh interpreter, both ways."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import processors

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# For each name of __all__: the module that defines it and its qualified name, read two ways.
PROBE = """
import importlib, json, sys
mode = sys.argv[1]
names = {}
if mode == "from":
    import processors
    for name in processors.__all__:
        exec(f"from processors import {name} as value", {}, scope := {})
        names[name] = scope["value"]
else:
    import processors
    names = {name: getattr(processors, name) for name in processors.__all__}
star = {}
exec("from processors import *", star)
print(json.dumps({
    "all": list(processors.__all__),
    "found": {n: [getattr(v, "__module__", None), getattr(v, "__qualname__", None)] for n, v in names.items()},
    "star": sorted(n for n in star if not n.startswith("__")),
    "dir": sorted(set(dir(processors)) & set(processors.__all__)),
}))
"""


def _probe(mode: str) -> dict:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300
    )
    assert done.returncode == 0, f"importing processors' names failed:\n{done.stderr[-3000:]}"
    return json.loads(done.stdout)


@pytest.mark.parametrize("mode", ["from", "attribute"])
def test_every_public_name_imports_from_the_package(mode):
    seen = _probe(mode)
    names = seen["all"]
    assert len(names) == len(set(names)), f"__all__ repeats a name: {names}"
    assert sorted(seen["found"]) == sorted(names)
    for name, (module, qualname) in seen["found"].items():
        assert module is not None and module.startswith("processors."), f"{name} comes from {module}"
        assert qualname == name, f"processors.{name} is {module}.{qualname}"
    assert seen["star"] == sorted(names), "from processors import * must give exactly __all__"
    assert seen["dir"] == sorted(names), "dir(processors) must list every name of __all__"


def test_each_name_is_the_object_its_module_defines():
    import importlib

    for name in processors.__all__:
        value = getattr(processors, name)
        home = importlib.import_module(value.__module__)
        assert getattr(home, name) is value, f"processors.{name} is not {value.__module__}.{name}"


def test_an_unknown_name_is_an_attribute_error_naming_it():
    with pytest.raises(AttributeError, match="no attribute 'NoSuchProcessor'"):
        processors.NoSuchProcessor  # noqa: B018
    with pytest.raises(ImportError, match="NoSuchProcessor"):
        exec("from processors import NoSuchProcessor", {})
