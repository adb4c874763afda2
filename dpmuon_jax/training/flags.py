"""Command-line flags made from the fields of a settings dataclass.

Each field declared with :func:`~dpmuon_jax.training.settings.setting` becomes
one flag: its name (``--learning-rate`` for ``learning_rate``, or the field's
own), its old spellings as aliases, its help, choices and metavar, and a parser
for its type annotation: numbers, strings, comma-separated tuples, JSON
objects, ``none`` for an optional value, and ``--x`` / ``--no-x`` for a bool.
The shared fields (:class:`~dpmuon_jax.training.settings.PrivacySettings`,
:class:`~dpmuon_jax.training.settings.RunControl`) go in groups of their own.
Values are checked when the config is made, not here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from dpmuon_jax.training.settings import PrivacySettings, RunControl, choices_of, flag_of

_GROUPS = ((PrivacySettings, "privacy (every run)"), (RunControl, "run control (every run)"))


def _json_object(text: str) -> dict:
  value = json.loads(text)
  if not isinstance(value, dict):
    raise ValueError(f"expected a JSON object, got {text!r}")
  return value


def _optional(parse: Callable[[str], Any]) -> Callable[[str], Any]:
  """``parse``, with ``none`` for None (e.g. ``--denominator none``: qN)."""
  return lambda text: None if text.lower() == "none" else parse(text)


_PARSERS: Mapping[str, Callable[[str], Any]] = {
    "int": int, "float": float, "str": str, "dict": _json_object,
    "tuple[str, ...]": lambda text: tuple(t for t in text.split(",") if t),
    "tuple[int, ...]": lambda text: tuple(int(t) for t in text.split(",") if t),
}


def flag_type(hint: str) -> Callable[[str], Any]:
  """How a field of type annotation ``hint`` is parsed from its flag's text."""
  base = hint.replace(" | None", "")
  return _optional(_PARSERS[base]) if hint.endswith("| None") else _PARSERS[base]


def _default(field: dataclasses.Field) -> Any:
  if field.default_factory is not dataclasses.MISSING:
    return field.default_factory()
  return field.default


def add_flag(parser: Any, field: dataclasses.Field, default: Any = dataclasses.MISSING,
             help: str | None = None) -> None:
  """One field's flag on ``parser`` (a parser or an argument group); ``default`` and
  ``help`` replace the field's own. A field without a default is required, unless
  ``--resume`` takes the run's recorded one: its flag defaults to None."""
  meta, hint = field.metadata, str(field.type)
  default = _default(field) if default is dataclasses.MISSING else default
  names = (flag_of(field), *meta.get("aliases", ()))
  text = help or meta.get("help") or ""
  if default is dataclasses.MISSING:
    default, text = None, f"{text} (required; --resume: the run's)"
  if hint == "bool":
    parser.add_argument(*names, dest=field.name, action=argparse.BooleanOptionalAction,
                        default=default, help=text)
    return
  parser.add_argument(*names, dest=field.name, type=flag_type(hint), default=default, help=text,
                      choices=choices_of(field), metavar=meta.get("metavar"))


def add_flags(parser: argparse.ArgumentParser, cls: type, names: Iterable[str] | None = None,
              defaults: Mapping[str, Any] | None = None,
              helps: Mapping[str, str] | None = None) -> None:
  """The flags of ``cls``'s fields (``names`` only, in field order, if given); ``defaults``
  and ``helps`` replace some fields' own."""
  wanted = None if names is None else set(names)
  groups: dict[type, Any] = {}
  owners = {field.name: next((base for base, _ in _GROUPS
                              if field.name in base.__dataclass_fields__), None)
            for field in dataclasses.fields(cls)}
  fields = sorted(dataclasses.fields(cls), key=lambda f: owners[f.name] is not None)
  for field in fields:  # the class's own fields first, then the shared groups
    if wanted is not None and field.name not in wanted:
      continue
    owner = owners[field.name]
    if owner is not None and owner not in groups:
      groups[owner] = parser.add_argument_group(dict(_GROUPS)[owner])
    add_flag(groups.get(owner, parser) if owner else parser, field,
             (defaults or {}).get(field.name, dataclasses.MISSING), (helps or {}).get(field.name))
