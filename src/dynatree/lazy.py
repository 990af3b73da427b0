"""Package attributes imported on first use (PEP 562), so that importing a package, for
example for `dynatree --help`, does not pay for torch and transformers before they are needed."""

from __future__ import annotations

from importlib import import_module


def lazy_exports(package: str, exports: dict[str, str]):
    """`__getattr__` and `__dir__` for `package` that import `name` from `package.<exports[name]>`
    on first access and keep it in the package's namespace."""
    module = import_module(package)

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(f".{exports[name]}", package), name)
        setattr(module, name, value)
        return value

    def __dir__():
        return sorted(set(vars(module)) | set(exports))

    return __getattr__, __dir__
