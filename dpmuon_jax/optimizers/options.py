"""Option groups shared by the Muon-family optimizers, and the names of their modes.

Each group is a small frozen dataclass that checks its values when it is
built (a one-line ``ValueError`` from :mod:`dpmuon_jax.checks`), so a
meaningless option is refused before any optimizer exists:

* :class:`NewtonSchulz`: the orthogonalisation NS_K of paper 1 ("Spectral
  Gradient Orthogonalization Improves Differentially Private Training at
  Scale", §Method), K quintic steps X ← aX + b(XXᵀ)X + c(XXᵀ)²X from
  X₀ = M / (s‖M‖_F + ε);
* :class:`Fallback`: the post-processing of the leaves the routing keeps off
  Muon, θ ← θ − η′(u_t + λ′θ) with u_t DP-SGD's heavy-ball momentum (paper 1)
  or AdamW (paper 2, the inner-momentum DP-Muon paper, appendix C).

Mode names are ``Literal`` types, each defined once: those of the transforms
and of the release where they are used (re-exported here), those of the
optimizers below.

A factory that passes ``**options`` on declares where with
:func:`forwards_options`, so :func:`keyword_options` knows every option it
takes (the registry names them when it refuses one).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any, Literal, TypeVar, get_args

import optax

from dpmuon_jax import checks
from dpmuon_jax.linalg.newton_schulz import NewtonSchulz
from dpmuon_jax.privacy.release import ADD_REMOVE, REPLACE_ONE, Neighbouring
from dpmuon_jax.transforms.momentum import EMA, HEAVY_BALL, Buffer
from dpmuon_jax.transforms.muon import ATTENTION_BLOCKS, AttentionBlocks
from dpmuon_jax.transforms.routing import PRESETS, Routing, RoutingPreset

__all__ = [
    "ADAMW", "ADD_REMOVE", "ATTENTION_BLOCKS", "EMA", "FEED", "HEAVY_BALL", "PRESETS",
    "QUERY_KINDS", "REPLACE", "REPLACE_ONE", "SGD", "AttentionBlocks", "Buffer", "Composition",
    "Fallback", "FallbackKind", "Neighbouring", "NewtonSchulz", "QueryKind", "Routing",
    "RoutingPreset", "forwards_options", "keyword_options",
]

FallbackKind = Literal["sgd", "adamw"]
"""The fallback group's optimizer: DP-SGD's heavy-ball momentum step or AdamW."""
SGD, ADAMW = get_args(FallbackKind)

Composition = Literal["replace", "feed"]
"""How a temporal filter composes with Muon (:mod:`dpmuon_jax.optimizers.filters`)."""
REPLACE, FEED = get_args(Composition)

QueryKind = Literal["gradient", "disk", "inner_momentum", "disk_inner_momentum"]
"""The per-example query a private optimizer's release privatises: the gradient,
DiSK's two-point query, inner momentum's average over past states, or both
(DiSK's query as inner momentum's current term)."""
QUERY_KINDS: tuple[str, ...] = get_args(QueryKind)


@dataclasses.dataclass(frozen=True)
class Fallback:
  """The group routing keeps off Muon: θ ← θ − η′_t (u_t + λ′θ).

  ``"sgd"``: u = β′u + G̃ (heavy-ball ``optax.trace``, as paper 1's DP-SGD),
  Nesterov optional. ``"adamw"``: AdamW with b1 = β′ (paper 2's fallback).

  Attributes:
    kind: ``"sgd"``, ``"adamw"`` or ``None``: AdamW under the ``"paper2"``
      routing, SGD otherwise.
    learning_rate: η′, float or optax schedule; ``None``: the Muon group's η
      (SGD only: an AdamW group needs its own, paper 2: 0.0035).
    momentum: β′ in [0, 1); ``None``: the optimizer's default, 0.9, or 0 where
      a filter's output replaces all momentum
      (:mod:`dpmuon_jax.optimizers.filters`, ``composition="replace"``).
    nesterov: Nesterov's look-ahead for ``"sgd"``.
    weight_decay: λ′ >= 0, decoupled and multiplied by η′.
    b2, eps: AdamW's second-moment decay in [0, 1) and its ε >= 0.
  """

  kind: FallbackKind | None = None
  learning_rate: optax.ScalarOrSchedule | None = None
  momentum: float | None = None
  nesterov: bool = False
  weight_decay: float = 0.0
  b2: float = 0.999
  eps: float = 1e-8

  def __post_init__(self):
    if self.kind is not None and self.kind not in get_args(FallbackKind):
      raise ValueError(f"fallback must be {SGD!r} or {ADAMW!r}, got {self.kind!r}.")
    if self.learning_rate is not None:
      checks.check_learning_rate("fallback_learning_rate", self.learning_rate)
    if self.momentum is not None:
      checks.check_in_range("fallback_momentum", self.momentum, 0.0, 1.0, high_inclusive=False)
    checks.check_nonnegative("fallback_weight_decay", self.weight_decay)
    checks.check_in_range("fallback_b2", self.b2, 0.0, 1.0, high_inclusive=False)
    checks.check_nonnegative("fallback_eps", self.eps)

  def resolve(
      self, routing: Routing, learning_rate: optax.ScalarOrSchedule, momentum: float = 0.9
  ) -> Fallback:
    """Kind, learning rate and momentum filled in for the Muon group's ``routing`` and η."""
    kind = self.kind or (ADAMW if routing == "paper2" else SGD)
    if self.learning_rate is None and kind == ADAMW:
      raise ValueError(
          "An AdamW fallback group needs its own fallback_learning_rate: "
          "fallback=Fallback(kind='adamw', learning_rate=...)."
      )
    return dataclasses.replace(
        self,
        kind=kind,
        learning_rate=learning_rate if self.learning_rate is None else self.learning_rate,
        momentum=momentum if self.momentum is None else self.momentum,
    )


_Factory = TypeVar("_Factory", bound=Callable[..., Any])
_FORWARDS = "_forwards_options"


def forwards_options(*targets: Callable[..., Any]) -> Callable[[_Factory], _Factory]:
  """Declares that a factory passes its ``**options`` on to ``targets``.

  The factory is returned unchanged; :func:`keyword_options` follows the
  declaration. ``forwards_options()`` (no target) declares options that go to
  a function the factory's caller chooses, which that caller declares.
  """

  def declare(factory: _Factory) -> _Factory:
    setattr(factory, _FORWARDS, targets)
    return factory

  return declare


def keyword_options(factory: Callable[..., Any]) -> frozenset[str] | None:
  """The options ``factory`` takes by keyword, with those of every function its
  ``**options`` reach (:func:`forwards_options`); ``None`` where some
  ``**options`` go to an undeclared place.

  An option is a keyword-only argument with a default; the positional
  arguments and the keyword-only ones without a default are the caller's.
  """
  parameters = inspect.signature(factory).parameters.values()
  names = {p.name for p in parameters
           if p.kind == p.KEYWORD_ONLY and p.default is not p.empty}
  if not any(p.kind == p.VAR_KEYWORD for p in parameters):
    return frozenset(names)
  targets = getattr(factory, _FORWARDS, None)
  if targets is None:
    return None
  for target in targets:
    reached = keyword_options(target)
    if reached is None:
      return None
    names |= reached
  return frozenset(names)
