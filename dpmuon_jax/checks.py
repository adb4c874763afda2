"""Refusing numeric options that would make a run meaningless, in one line.

Every ``check_*`` takes the option's name, as its caller's user spells it, and
its value. It returns the value as a Python number, or raises ::

    ValueError("<name> must be <what is allowed>, got <value>.")

A NaN, an infinity or a value of the wrong kind is refused like one out of
range. A value traced by ``jax.jit`` (a hyperparameter passed through
``optax.inject_hyperparams``) cannot be inspected and is returned unchecked.

This module imports nothing from the rest of the package, so any layer may
use it.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

SCHEDULE_PROBE_STEPS = (0, 1, 10, 1000)
"""The steps at which :func:`check_learning_rate` evaluates a schedule."""


def _shown(value: Any) -> str:
  """``nan``, ``-1.0``, ``3``: the value as its user typed it, where it is a number."""
  if isinstance(value, (numbers.Number, np.ndarray, jax.Array)) and np.size(
      value) == 1:  # pyright: ignore[reportArgumentType]  # a Number is array-like
    return repr(np.asarray(value).item())
  return repr(value)


def _refuse(name: str, allowed: str, value: Any) -> ValueError:
  return ValueError(f"{name} must be {allowed}, got {_shown(value)}.")


def _is_traced(value: Any) -> bool:
  return isinstance(value, jax.core.Tracer)  # pyright: ignore[reportAttributeAccessIssue]


def _as_float(value: Any) -> float:
  """The value as a float; NaN for anything that is not a single number (a bool neither)."""
  if isinstance(value, (bool, np.bool_)):
    return math.nan
  try:
    return float(value)
  except (TypeError, ValueError):
    return math.nan


def _bound(value: float) -> str:
  return f"{value:g}"


def check_in_range(
    name: str,
    value: Any,
    low: float = -math.inf,
    high: float = math.inf,
    low_inclusive: bool = True,
    high_inclusive: bool = True,
) -> float:
  """A finite number in the interval from ``low`` to ``high``, each end open or closed."""
  if math.isinf(low) and math.isinf(high):
    allowed = "a finite number"
  elif math.isinf(high):
    allowed = f"a finite number {'>=' if low_inclusive else '>'} {_bound(low)}"
  elif math.isinf(low):
    allowed = f"a finite number {'<=' if high_inclusive else '<'} {_bound(high)}"
  else:
    allowed = (f"in {'[' if low_inclusive else '('}{_bound(low)}, "
               f"{_bound(high)}{']' if high_inclusive else ')'}")
  if _is_traced(value):
    return value
  number = _as_float(value)
  above = number >= low if low_inclusive else number > low
  below = number <= high if high_inclusive else number < high
  if not (math.isfinite(number) and above and below):
    raise _refuse(name, allowed, value)
  return number


def check_finite(name: str, value: Any) -> float:
  """Any finite number."""
  return check_in_range(name, value)


def check_positive(name: str, value: Any) -> float:
  """A finite number > 0."""
  return check_in_range(name, value, 0.0, low_inclusive=False)


def check_nonnegative(name: str, value: Any) -> float:
  """A finite number >= 0."""
  return check_in_range(name, value, 0.0)


def check_int(name: str, value: Any, low: int | None = None) -> int:
  """An integer (an integral float is accepted), at least ``low`` if given."""
  allowed = "an int" if low is None else f"an int >= {low}"
  number = _as_float(value)
  if not (math.isfinite(number) and number.is_integer()) or (low is not None and number < low):
    raise _refuse(name, allowed, value)
  return int(number)


def check_positive_int(name: str, value: Any) -> int:
  """An integer >= 1."""
  return check_int(name, value, 1)


def check_nonnegative_int(name: str, value: Any) -> int:
  """An integer >= 0."""
  return check_int(name, value, 0)


def check_learning_rate(name: str, value: Any) -> Any:
  """A finite number >= 0, or an optax schedule finite and >= 0 at :data:`SCHEDULE_PROBE_STEPS`.

  A schedule is evaluated at those steps when the optimizer is built; one
  that gives NaN, an infinity or a negative value there is refused. The value
  is returned unchanged.
  """
  if not callable(value):
    check_in_range(name, value, 0.0)
    return value
  for step in SCHEDULE_PROBE_STEPS:
    rate = value(jnp.asarray(step, jnp.int32))
    if _is_traced(rate):
      continue
    number = _as_float(rate)
    if not (math.isfinite(number) and number >= 0):
      raise ValueError(
          f"{name} must be a schedule of finite values >= 0, got {_shown(rate)} at step {step}."
      )
  return value
