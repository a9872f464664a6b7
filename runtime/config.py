"""One way to resolve any component's pydantic config: defaults < TOML file < GASLOC_* env < flags.

Env vars name a field by its path, sections joined by a double underscore: `GASLOC_TRAIN__INNER_STEPS=20`.
Values are parsed as JSON when they parse (numbers, booleans, lists), else taken as strings; a comma-separated
string is accepted for list fields. Every mistake - unknown key, unknown GASLOC_* variable, bad value - becomes one
`ConfigError` line that names it; the CLI prints that line and exits with code 2.
"""
from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

ENV_PREFIX = "GASLOC_"
# Variables that are not config fields but are read elsewhere (so they are not "unknown").
ENV_NOT_CONFIG = frozenset({"GASLOC_CONFIG", "GASLOC_LOG_LEVEL"})

M = TypeVar("M", bound=BaseModel)


class ConfigError(ValueError):
    """A user mistake in a config file, env var or flag. Its message is one line meant for the user."""


def _set_path(tree: dict, path: list[str], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
        if not isinstance(tree, dict):
            raise ConfigError(f"'{'.'.join(path)}': '{key}' is a value, not a section")
    tree[path[-1]] = value


def _merge(base: dict, over: Mapping) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) else v
    return out


def _field_paths(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> dict[str, tuple[str, ...]]:
    """ENV_NAME -> field path for every leaf (and section) of a config model."""
    out: dict[str, tuple[str, ...]] = {}
    for name, field in model.model_fields.items():
        path = prefix + (name,)
        out[ENV_PREFIX + "__".join(path).upper()] = path
        ann = field.annotation
        for cand in getattr(ann, "__args__", ()) or (ann,):
            if isinstance(cand, type) and issubclass(cand, BaseModel):
                out.update(_field_paths(cand, path))
    return out


def _parse_env_value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def env_overrides(model: type[BaseModel], environ: Mapping[str, str] | None = None) -> dict:
    environ = os.environ if environ is None else environ
    known = _field_paths(model)
    tree: dict = {}
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX) or name in ENV_NOT_CONFIG:
            continue
        if name not in known:
            raise ConfigError(f"unknown environment variable {name}: it names no field of this command's config "
                              f"(see --print-config for the fields; sections are joined by '__')")
        _set_path(tree, list(known[name]), _parse_env_value(raw))
    return tree


def load_toml(path: str | Path) -> dict:
    p = Path(path)
    try:
        with p.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {p} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {p} is not valid TOML: {e}") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {p}: {e.strerror}") from None


def flags_tree(flags: Mapping[str, Any]) -> dict:
    """{"train.inner_steps": 5, "run_dir": None} -> nested dict, skipping flags the user did not give (None)."""
    tree: dict = {}
    for dotted, value in flags.items():
        if value is not None and value != ():
            _set_path(tree, dotted.split("."), list(value) if isinstance(value, tuple) else value)
    return tree


def _split_commas(data: Any, model: type[BaseModel]) -> Any:
    """Let env vars and flags give list fields as 'a,b,c'."""
    if not isinstance(data, dict):
        return data
    out = dict(data)
    for name, field in model.model_fields.items():
        if name not in out:
            continue
        ann, val = field.annotation, out[name]
        origin = getattr(ann, "__origin__", None)
        if origin in (list, tuple) and isinstance(val, str):
            out[name] = [s.strip() for s in val.split(",") if s.strip()]
        for cand in getattr(ann, "__args__", ()) or (ann,):
            if isinstance(cand, type) and issubclass(cand, BaseModel) and isinstance(val, dict):
                out[name] = _split_commas(val, cand)
    return out


def format_validation_error(err: ValidationError) -> str:
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "config"
    if first["type"] == "extra_forbidden":
        msg = f"unknown key '{where}' (check its spelling and section; --print-config lists the valid keys)"
    else:
        got = first.get("input")
        shown = "" if isinstance(got, dict) else f" (got {got!r})"
        msg = f"bad value for '{where}': {first['msg']}{shown}"
    more = len(err.errors()) - 1
    return msg + (f"; and {more} more problem(s)" if more else "")


def resolve(model: type[M], config_file: str | Path | None = None, flags: Mapping[str, Any] | None = None,
            environ: Mapping[str, str] | None = None) -> M:
    """Build `model` from defaults < TOML file < GASLOC_* env < flags. Raises ConfigError with one line."""
    tree: dict = {}
    if config_file is not None:
        tree = _merge(tree, load_toml(config_file))
    tree = _merge(tree, env_overrides(model, environ))
    tree = _merge(tree, flags_tree(flags or {}))
    try:
        return model.model_validate(_split_commas(tree, model))
    except ValidationError as e:
        raise ConfigError(format_validation_error(e)) from None


def dump_toml(cfg: BaseModel) -> str:
    """The resolved config as TOML (what --print-config shows): top-level values first, then sections."""
    def fmt(v: Any) -> str:
        return json.dumps(v)  # JSON scalars and lists of scalars are valid TOML

    def emit(d: dict, model: Any, path: str) -> list[str]:
        scalars = [f"{k} = {fmt(v)}" for k, v in d.items() if not isinstance(v, dict) and v is not None]
        unset = [f"# {k} = (unset)" for k, v in d.items() if v is None]
        # a value a validator picked for the user (e.g. outer settings from H) says so, and why
        why = getattr(model, "_picked", None)
        notes = [f"# {why}"] if isinstance(why, str) else []
        lines = ([f"[{path}]"] if path and (scalars or unset) else []) + notes + scalars + unset
        for k, v in d.items():
            if isinstance(v, dict):
                lines += [""] + emit(v, getattr(model, k, None), f"{path}.{k}" if path else k)
        return lines

    return "\n".join(emit(cfg.model_dump(mode="json"), cfg, "")).strip() + "\n"


def resolve_for_cli(model: type[M], config_file: str | Path | None, flags: Mapping[str, Any], print_config: bool,
                    environ: Mapping[str, str] | None = None) -> M:
    """What every subcommand does first: resolve its config; on a mistake print `Error: <one line>` and exit 2;
    with --print-config print the resolved config as TOML and exit 0."""
    import click

    try:
        cfg = resolve(model, config_file, flags, environ)
    except ConfigError as e:
        click.echo(f"Error: {e}", err=True)
        raise SystemExit(2) from None
    if print_config:
        click.echo(dump_toml(cfg), nl=False)
        raise SystemExit(0)
    return cfg
