"""Command-line help that shows each option's default once, as its user would type it.

Shared by the ``dpmuon`` command and the audit's own entry point; it imports
nothing from the rest of the package, so any layer may use it.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

_MAX_FLOAT_DIGITS = 8


def shown_default(value: Any) -> str:
  """``0.02439`` for 1/41, ``valid,test`` for a tuple, ``{}`` for a dict, ``none`` for None:
  a default as it would be typed on the command line."""
  if value is None:
    return "none"
  if isinstance(value, float):
    text = repr(value)
    return text if len(text) <= _MAX_FLOAT_DIGITS else f"{value:.4g}"
  if isinstance(value, (tuple, list)):
    return ",".join(shown_default(v) for v in value) or "''"
  if isinstance(value, dict):
    return json.dumps(value)
  return str(value)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
  """Appends an option's default to its help, unless the help already names its default
  or there is none to show (None, or a flag that takes no value)."""

  def _get_help_string(self, action: argparse.Action) -> str:
    text = action.help or ""
    if (action.default in (None, argparse.SUPPRESS) or action.nargs == 0
        or "default" in text.lower()):
      return text
    shown = shown_default(action.default).replace("%", "%%")
    return f"{text} (default: {shown})" if text else f"default: {shown}"
