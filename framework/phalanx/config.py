"""Typed configs: dataclasses filled from a YAML file plus `key=value` overrides.

Every recipe owns a dataclass. `load_config(MyConfig, "cfg.yaml", ["train.lr=3e-4"])` reads the
file, applies the overrides (dotted keys reach nested dataclasses), converts each value to the
field's declared type, and stops with one clear message on an unknown key (listing the valid
ones) or a value of the wrong type.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any, Callable, Literal, Union, get_args, get_origin

import yaml


class ConfigError(ValueError):
    """A config file or override is wrong; the message names the key and the fix."""


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if origin is not None:
        return f"{getattr(origin, '__name__', origin)}[{', '.join(_type_name(a) for a in get_args(tp))}]"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Convert `value` (from YAML or a command-line string) to the declared type `tp`."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None or (isinstance(value, str) and value.lower() in {"none", "null"}):
            if type(None) in args:
                return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(f"config key '{key}': {value!r} is not a {_type_name(tp)}")
    if origin is Literal:
        choices = get_args(tp)
        for choice in choices:
            if value == choice or (isinstance(value, str) and str(choice) == value):
                return choice
        raise ConfigError(f"config key '{key}': {value!r} is not one of {', '.join(repr(c) for c in choices)}")
    if origin in (list, tuple):
        (item_tp, *_) = get_args(tp) or (Any,)
        if isinstance(value, str):
            value = yaml.safe_load(value) if value.strip().startswith("[") else [v for v in value.split(",") if v]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config key '{key}': expected a list, got {value!r}")
        items = [_coerce(v, item_tp, key) for v in value]
        return items if origin is list else tuple(items)
    if origin is dict:
        if isinstance(value, str):
            value = yaml.safe_load(value)
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}': expected a mapping, got {value!r}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}': expected a section (mapping), got {value!r}")
        return _build(tp, value, prefix=f"{key}.")
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in {"true", "yes", "1", "on"}:
            return True
        if isinstance(value, str) and value.lower() in {"false", "no", "0", "off"}:
            return False
        raise ConfigError(f"config key '{key}': {value!r} is not a bool (use true/false)")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"config key '{key}': {value!r} is not an int")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                try:
                    as_float = float(value)  # accepts 1e3
                except ValueError:
                    as_float = None
                if as_float is not None and as_float.is_integer():
                    return int(as_float)
        raise ConfigError(f"config key '{key}': {value!r} is not an int")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"config key '{key}': {value!r} is not a float")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"config key '{key}': {value!r} is not a float")
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"config key '{key}': expected a string, got {value!r}")
        return str(value)
    if tp is Path:
        return Path(str(value))
    return value


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def _unknown_key_error(key: str, valid: list[str]) -> ConfigError:
    leaf = key.rsplit(".", 1)[-1]
    close = difflib.get_close_matches(leaf, valid, n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return ConfigError(f"unknown config key '{key}'.{hint} Valid keys here: {', '.join(sorted(valid))}")


def _build(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    types_ = _field_types(cls)
    kwargs = {}
    for name, value in data.items():
        if name not in types_:
            raise _unknown_key_error(prefix + name, list(types_))
        kwargs[name] = _coerce(value, types_[name], prefix + name)
    try:
        obj = cls(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"config section '{prefix.rstrip('.') or cls.__name__}': {exc}") from exc
    validate = getattr(obj, "validate", None)
    if callable(validate):
        validate()
    return obj


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override '{key}': '{part}' is not a section")
    node[parts[-1]] = value


def parse_overrides(overrides: list[str] | None) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value (for example train.lr=3e-4)")
        key, raw = item.split("=", 1)
        key = key.strip().lstrip("-")
        # YAML parsing gives numbers/bools/lists; the dataclass type decides in the end.
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        if isinstance(value, (int, float, bool)) or value is None:
            value = raw  # keep the text; _coerce converts it to the declared type
        _set_dotted(tree, key, value)
    return tree


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def resolve_path(path: str | Path, root: str | Path) -> Path:
    """`path` with `~` expanded; a relative one taken from `root` (a recipe's repository root), so
    config paths mean the same from any working directory."""
    p = Path(path).expanduser()
    return p if p.is_absolute() else Path(root) / p


def config_from_dict(cls: type, data: dict[str, Any]) -> Any:
    return _build(cls, data)


def load_config(cls: type, path: str | Path | None = None, overrides: list[str] | None = None) -> Any:
    """Build `cls` from an optional YAML file and `key=value` overrides (overrides win)."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist; pass the path of a YAML file")
        with path.open() as f:
            loaded = yaml.safe_load(f) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(path)!r} must hold a mapping of keys to values")
        data = loaded
    data = _merge(data, parse_overrides(overrides))
    return _build(cls, data)


def config_to_dict(obj: Any) -> dict[str, Any]:
    """Plain dict (for logging and saving next to checkpoints)."""
    def convert(v: Any) -> Any:
        if isinstance(v, Path):
            return str(v)
        if isinstance(v, (list, tuple)):
            return [convert(x) for x in v]
        if isinstance(v, dict):
            return {k: convert(x) for k, x in v.items()}
        return v
    return {k: convert(v) for k, v in dataclasses.asdict(obj).items()}


def parse_config_args(description: str, load: Callable[[str, list[str]], Any], argv: list[str] | None = None, *,
                      example: str = "", extra: Callable[[argparse.ArgumentParser], None] | None = None
                      ) -> tuple[Any, argparse.Namespace]:
    """The command line every recipe step shares: `--config FILE [step options] key=value ...`.
    Returns (`load(config_path, overrides)`, the parsed namespace); `extra(parser)` adds the
    step's own options."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", "-c", required=True, help=f"recipe YAML{', e.g. ' + example if example else ''}")
    if extra is not None:
        extra(parser)
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.lr=1e-4 train.plugin=zero2")
    args = parser.parse_args(argv)
    return load(args.config, args.overrides), args
