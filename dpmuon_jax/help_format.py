"""Command-line help that shows each option's default once.

Shared by the ``dpmuon`` command and the audit's own entry point; it imports
nothing from the rest of the package, so any layer may use it.
"""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
  """Appends an option's default to its help, unless the help already names its default
  or there is none to show (None, or a flag that takes no value)."""

  def _get_help_string(self, action: argparse.Action) -> str:
    text = action.help or ""
    if (action.default in (None, argparse.SUPPRESS) or action.nargs == 0
        or "default" in text.lower()):
      return text
    return f"{text} (default: %(default)s)" if text else "default: %(default)s"
