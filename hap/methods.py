"""The method registry: every pruning method's name, in the order the page, the CLI, the sweep and the benchmark list
them, and where its `Pruner` class comes from. A leaf: it imports nothing of `hap`, so the knobs, the planner and the
executor can all read it without a circle.

The built-in methods are one module each in `hap.pruners`, imported on first use (`pruner_class`). A pruner written
outside the package joins with `hap.pruners.register` (a class decorator), or by naming its module in the
environment variable `HAP_PRUNERS` (comma-separated importable modules, imported by `load_plugins` at the start of the
CLI, the app and the lmms-eval plugin). `METHODS` is a live view: a registered method appears in it at once.

A few names have a role beyond being one method among others; the rest of `hap` reads these constants instead of
naming a method: `DEFAULT` (the method the library runs and every other one is compared with), `NONE` (the stock
model, no pruning), `UNIFORM` (the plain head average: HAP's fusion without PAQ weighting, the comparison the page
and the head-utility measure draw), `RANDOM` (a seeded uniform choice: the floor every rule must beat, and the
carrier of a forced priority in `hap.utility`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from importlib import import_module

DEFAULT = "hap"
NONE = "none"
UNIFORM = "uniform"
RANDOM = "random"
BUILT_IN = (DEFAULT, UNIFORM, "fastv", "pdrop", "pdrop_ours", RANDOM, "visionzip", "sparsevlm", "autoprune",
            "divprune", "dart", "vispruner", "hawk", "cdpruner", "scope", "holov", "prunesid", "hiprune", "downsample",
            NONE)  # each a module of hap.pruners
PLUGINS_ENV = "HAP_PRUNERS"  # comma-separated importable modules that register pruners (`load_plugins`)

_registered: dict[str, type] = {}  # name -> a Pruner subclass registered from outside the package


class MethodList(Sequence):
    """The registered method names, built-in ones first, then those registered from outside in their order (the
    registry read live, so a method registered after import is listed). `none` stays last: the stock model."""

    def _names(self) -> tuple[str, ...]:
        return (*BUILT_IN[:-1], *_registered, NONE)

    def __getitem__(self, index):
        return self._names()[index]

    def __len__(self) -> int:
        return len(BUILT_IN) + len(_registered)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __contains__(self, name: object) -> bool:
        return name in BUILT_IN or name in _registered

    def __repr__(self) -> str:
        return repr(self._names())


METHODS = MethodList()


def pruner_class(method: str) -> type:
    """The `hap.pruners.base.Pruner` subclass of `method` (one of METHODS); ValueError names the known ones."""
    if method in _registered:
        return _registered[method]
    if method not in BUILT_IN:
        raise ValueError(f"method={method!r} is not allowed; choose one of {', '.join(METHODS)}")
    return import_module(f"hap.pruners.{method}").PRUNER


def register(cls: type) -> type:
    """Register a pruner written outside the package under its `name`; returns the class, so it serves as a class
    decorator. `cls` must be a subclass of `hap.pruners.base.Pruner` (checked by its `from_config` and `select`) with a
    new lower-case `name` (letters, digits and underscores). Registering the same class again, or a class of the same
    module and qualified name (its module re-run, a notebook cell run again), replaces it."""
    name = getattr(cls, "name", "")
    if not (isinstance(cls, type) and callable(getattr(cls, "from_config", None))
            and callable(getattr(cls, "select", None))):
        raise TypeError(f"register takes a subclass of hap.pruners.base.Pruner; got {cls!r}")
    if not (isinstance(name, str) and name.isidentifier() and name == name.lower()):
        raise ValueError(f"a registered pruner needs a lower-case identifier as its `name`; {cls.__name__} has "
                         f"name={name!r}")
    same = _registered.get(name)
    if same is not None and (same.__module__, same.__qualname__) == (cls.__module__, cls.__qualname__):
        _registered[name] = cls
        return cls
    if name in METHODS:
        raise ValueError(f"method={name!r} is already registered; choose another `name` for {cls.__name__}")
    _registered[name] = cls
    return cls


def unregister(name: str) -> None:
    """Remove the registered method `name`; ValueError for a built-in or an unknown one."""
    if name not in _registered:
        raise ValueError(f"method={name!r} was not registered from outside the package; registered: "
                         f"{', '.join(_registered) or 'none'}")
    del _registered[name]


def load_plugins(spec: str | None = None) -> list[str]:
    """Import the modules named in `spec` (default: the `HAP_PRUNERS` environment variable; comma-separated), each of
    which registers its pruners on import. Returns the modules imported; ImportError names the variable and the
    module that failed."""
    spec = os.environ.get(PLUGINS_ENV, "") if spec is None else spec
    names = [name.strip() for name in spec.split(",") if name.strip()]
    for name in names:
        try:
            import_module(name)
        except ImportError as err:
            raise ImportError(f"{PLUGINS_ENV}={spec!r}: cannot import {name!r} ({err}); give importable module names "
                              "on the Python path, separated by commas") from err
    return names
