"""The private GPT-2 step on a CPU: its cost over the non-private step, its memory, and Opacus.

    python benchmarks/bench_ghost.py                      # all four sections (20–30 min here)
    python benchmarks/bench_ghost.py --section opacus     # one section (overhead, memory, im,
                                                          #   opacus); repeatable
    python benchmarks/bench_ghost.py --section opacus --cores 1   # each step on one core
    python benchmarks/bench_ghost.py --quick              # every path, tiny (1–1.5 min here)

(Times on 2 cores shared with a training run.) The model is
:class:`~dpmuon_jax.text.gpt2.GPT2` on GPT-2's BPE cut to 4,096 tokens, 2
layers, width 128 (head size 64), T = 64 tokens per example, built with
:func:`dpmuon_jax.models.taps.tapped`; the private steps are
:func:`dpmuon_jax.make_private_step` with C = 1, σ = 1 and a padded batch of
B rows of which ~7/8 are real (the mask). Clipped sums:

* ``vmap``: per-example gradients (``vmap(grad)``), clipped and summed, in
  chunks of ``microbatch_size`` where the row says so (vmap above B = 256);
* ``ghost``: ghost norms and book-keeping (Li et al. 2021, "Large Language
  Models Can Be Strong Differentially Private Learners", §4; Bu et al. 2023,
  "Differentially Private Optimization on Large Model at Small Cost", §3):
  no per-example gradient of any tapped weight.

Sections:

1. ``overhead``: private / non-private step at B = 256 and 1024, DP-SGD
   (against ``optax.sgd``) and DP-Muon (against the same Muon, non-private);
2. ``memory``: memory against B (64, 256, 1024) and width (128, 256, 512 at
   B = 64) for non-private, vmap and ghost DP-SGD;
3. ``im``: DP-Muon-IM (K = 1, 2, 4 past states) over DP-Muon at B = 256,
   both clipped sums, and its memory growth from K = 1 to K = 4;
4. ``opacus``: the same model and batch in PyTorch (``_torch_gpt2``): a
   non-private step, Opacus's per-sample gradients (``grad_sample_mode=
   "hooks"``) and its ghost clipping (``"ghost"``, fast gradient clipping),
   each DP-SGD at the same C and σ, against our steps. Skipped, in one line,
   without torch and opacus (``pip install -e ".[bench]"``).

Every step runs in a fresh child process pinned to ``--cores`` cores (XLA
sizes its CPU thread pool by them; torch gets as many threads): built and
compiled, run once, then the fastest of ``--repeats`` steps. Memory: the
child's peak resident set size over the timed steps (Linux VmHWM, reset
after compilation and the first step), ΔRSS (that peak less the resident
size before the first step: the step's working memory, including what an
allocator keeps between steps) and XLA's temporary buffers. Ratios are taken
within the run; on shared cores compare ratios, not seconds. Each section
measures its steps back to back (only the memory section reuses earlier
ones), so its time ratios compare steps run minutes apart. The last lines
read the ratios against targets. ``--quick`` (one repeat, a 1-layer model
of width 32, vocabulary 256, T = 16, vmap only in sections 2 and 4, every
step in one child process) only checks that every path runs: its numbers
mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from _peak_memory import peak_rss_gib, reset_peak_rss
from flax import nnx

from dpmuon_jax.models.taps import tapped
from dpmuon_jax.optimizers import dp_muon, dp_muon_im, dp_sgd
from dpmuon_jax.optimizers.muon import muon
from dpmuon_jax.optimizers.options import Fallback
from dpmuon_jax.text.gpt2 import GPT2, GPT2Config, gpt2_model, lm_loss
from dpmuon_jax.training.step import make_private_step

SECTIONS = ("overhead", "memory", "im", "opacus")
JAX_METHODS = ("nonprivate", "vmap", "ghost")
TORCH_METHODS = ("torch", "hooks", "opacus-ghost")
LABELS = {"nonprivate": "non-private", "vmap": "vmap", "ghost": "ghost",
          "torch": "torch non-private", "hooks": "Opacus hooks", "opacus-ghost": "Opacus ghost"}
OPTIMIZERS = {"sgd": "DP-SGD", "muon": "DP-Muon", "im": "DP-Muon-IM"}
ROUTING = {"routing": "paper2", "fallback": Fallback(kind="adamw", learning_rate=3e-3)}
CLIP, SIGMA, REAL_FRACTION = 1.0, 1.0, 0.875
MEMORY = {"peak RSS": "peak_rss_gib", "ΔRSS": "delta_rss_gib", "XLA temp": "xla_temp_gib"}


class Scale(NamedTuple):
  """The sizes of one run."""

  layers: int
  vocab: int
  length: int
  dim: int  # the width of every section but the width sweep
  overhead_batches: tuple[int, ...]
  overhead_methods: tuple[str, ...]  # the clipped sums section 1 times
  memory_batches: tuple[int, ...]
  widths: tuple[int, ...]
  width_batch: int
  im_batch: int
  histories: tuple[int, ...]
  im_methods: tuple[str, ...]  # the clipped sums section 3 times
  torch_batch: int
  vmap_microbatch: int  # vmap rows above this many are summed in chunks of it
  repeats: int


FULL = Scale(layers=2, vocab=4096, length=64, dim=128, overhead_batches=(256, 1024),
             overhead_methods=("vmap", "ghost"), memory_batches=(64, 256, 1024),
             widths=(128, 256, 512), width_batch=64, im_batch=256, histories=(1, 2, 4),
             im_methods=("ghost", "vmap"), torch_batch=256, vmap_microbatch=256, repeats=3)
# --quick: sections 1 and 3 time ghost only (vmap runs, as DP-SGD, in sections 2 and 4).
QUICK = Scale(layers=1, vocab=256, length=16, dim=32, overhead_batches=(8,),
              overhead_methods=("ghost",), memory_batches=(8,), widths=(32,), width_batch=8,
              im_batch=8, histories=(1,), im_methods=("ghost",), torch_batch=8,
              vmap_microbatch=4, repeats=1)


class Spec(NamedTuple):
  """One step to measure. ``history`` is IM's K; ``microbatch`` 0 is none."""

  method: str
  optimizer: str = "sgd"
  batch: int = 0
  dim: int = 0
  history: int = 0
  microbatch: int = 0


def spec(scale: Scale, method: str, batch: int, optimizer: str = "sgd", dim: int = 0,
         history: int = 0) -> Spec:
  """A :class:`Spec` with ``dim`` defaulting to the scale's and vmap chunked above its limit."""
  chunk = scale.vmap_microbatch if method == "vmap" and batch > scale.vmap_microbatch else 0
  return Spec(method, optimizer, batch, dim or scale.dim, history, chunk)


def gpt2_config(scale: Scale, dim: int) -> GPT2Config:
  return GPT2Config(vocab_size=scale.vocab, max_positions=scale.length, dim=dim,
                    num_layers=scale.layers, num_heads=max(1, dim // 64))


def token_batch(scale: Scale, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
  """Tokens (B, T) and the mask of real rows (B,), the same in both frameworks."""
  rng = np.random.default_rng(1)
  tokens = rng.integers(0, scale.vocab, (batch_size, scale.length), dtype=np.int32)
  return tokens, rng.random(batch_size) < REAL_FRACTION


# ---------------------------------------------------------------- JAX steps (child side)


class Unavailable(ValueError):
  """``make_private_step`` refuses this optimizer with this clipped sum."""


def _nonprivate_step(optimizer: str, loss_fn: Callable, params: Any, batch: Any):
  """The compiled ``grad`` of the mean loss and the update (SGD, or Muon routed as DP-Muon)."""
  opt = optax.sgd(0.1) if optimizer == "sgd" else muon(0.02, **ROUTING)

  def step(params, state, batch):
    updates, state = opt.update(jax.grad(loss_fn)(params, batch), state, params)
    return optax.apply_updates(params, updates), state

  args = (params, opt.init(params), batch)
  return jax.jit(step).lower(*args).compile(), args


def _private_optimizer(s: Spec):
  denominator = REAL_FRACTION * s.batch
  if s.optimizer == "sgd":
    return dp_sgd(0.1, CLIP, SIGMA, denominator, key=0)
  if s.optimizer == "muon":
    return dp_muon(0.02, CLIP, SIGMA, denominator, key=0, **ROUTING)
  return dp_muon_im(0.02, CLIP, SIGMA, denominator, key=0, history=s.history, **ROUTING)


def _private_step(s: Spec, loss_fn: Callable, params: Any, batch: Any, mask: Any):
  """The compiled :func:`make_private_step` step and its arguments."""
  opt = _private_optimizer(s)
  try:
    private = make_private_step(opt, loss_fn, clipped_sum_method=s.method,
                                microbatch_size=s.microbatch or None)
  except ValueError as e:
    raise Unavailable(str(e).split(";")[0]) from e
  args = (params, opt.init(params), batch, mask, private.empty_overflow(params))
  return private.sealed_step.lower(*args).compile(), args  # -> (StepOutput, the sum's seal)


def jax_step(s: Spec, scale: Scale) -> tuple[Callable[[], Any], dict]:
  """``run()``: one step of the compiled step, fed its own previous output (IM's history
  fills as in training); and facts about it."""
  apply, params = gpt2_model(tapped(GPT2(gpt2_config(scale, s.dim), rngs=nnx.Rngs(0))))
  tokens, real = token_batch(scale, s.batch)
  batch = {"tokens": jax.numpy.asarray(tokens), "loss_mask": jax.numpy.ones_like(tokens)}
  if s.method == "nonprivate":
    compiled, args = _nonprivate_step(s.optimizer, lm_loss(apply), params, batch)
  else:
    compiled, args = _private_step(s, lm_loss(apply), params, batch, jax.numpy.asarray(real))
  carry = list(args)

  def run():
    out = jax.block_until_ready(compiled(*carry))
    carry[:2] = (out if s.method == "nonprivate" else out[0])[:2]  # private: (StepOutput, seal)

  analysis = compiled.memory_analysis()
  facts = {"params": sum(x.size for x in jax.tree.leaves(params)),
           "state_mib": sum(x.nbytes for x in jax.tree.leaves(args[1])) / 2**20,
           "xla_temp_gib": analysis.temp_size_in_bytes / 2**30 if analysis else None}
  return run, facts


# -------------------------------------------------------------- torch steps (child side)


def torch_step(s: Spec, scale: Scale) -> tuple[Callable[[], Any], dict]:
  """The same model and batch in PyTorch: non-private, or Opacus DP-SGD (hooks or ghost)."""
  import torch
  from _torch_gpt2 import SequenceLoss, TorchGPT2, parameter_count

  torch.set_num_threads(len(os.sched_getaffinity(0)))
  torch.manual_seed(0)
  model = TorchGPT2(gpt2_config(scale, s.dim), tied_head=s.method != "opacus-ghost")
  tokens, _ = token_batch(scale, s.batch)
  tokens = torch.from_numpy(tokens).long()
  mask = torch.ones_like(tokens)
  optimizer, loss = torch.optim.SGD(model.parameters(), lr=0.1), SequenceLoss()
  if s.method != "torch":
    model, optimizer, loss = _opacus(model, optimizer, loss, tokens, s.method)

  def run():
    optimizer.zero_grad()
    loss(model(tokens), tokens, mask).backward()
    optimizer.step()

  return run, {"params": parameter_count(model), "state_mib": 0.0, "xla_temp_gib": None}


def _opacus(model, optimizer, loss, tokens, method: str):
  """Opacus's ``make_private`` at C and σ; the batch is fixed (no Poisson sampling)."""
  import torch
  from opacus import PrivacyEngine

  loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens),
                                       batch_size=len(tokens))
  made = PrivacyEngine().make_private(
      module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=SIGMA,
      max_grad_norm=CLIP, poisson_sampling=False, criterion=loss,
      grad_sample_mode="ghost" if method == "opacus-ghost" else "hooks")
  return made[0], made[1], made[2] if method == "opacus-ghost" else loss


# -------------------------------------------------------------------- one child process


def child(s: Spec, scale: Scale, repeats: int) -> dict:
  """Builds (compiles) one step, runs it once, then times it: one JSON-able dict.

  ΔRSS is the peak over the timed steps less the resident size before the first
  step, so it counts what an allocator keeps from one step to the next.
  """
  build = torch_step if s.method in TORCH_METHODS else jax_step
  try:
    run, facts = build(s, scale)
  except Unavailable as e:
    return {"unavailable": str(e)}
  reset_peak_rss()
  before = peak_rss_gib()  # = the resident size now
  run()  # warm-up
  reset = reset_peak_rss()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    run()
    times.append(time.perf_counter() - start)
  peak = peak_rss_gib() if reset else None
  return {"seconds": min(times), "peak_rss_gib": peak,
          "delta_rss_gib": peak - before if peak is not None else None, **facts}


def measure(specs: list[Spec], scale: Scale, quick: bool, repeats: int, cores: int
            ) -> dict[Spec, dict]:
  """Each step in a fresh child process (``--quick``: all in one, to save the start-ups)."""
  groups = ([specs] if specs else []) if quick else [[s] for s in specs]
  results: dict[Spec, dict] = {}
  for i, group in enumerate(groups):
    names = ", ".join(f"{label(s)} B={s.batch} width {s.dim}" for s in group)
    print(f"  [{i + 1}/{len(groups)}] {names}", file=sys.stderr, flush=True)
    out = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(group), "--repeats", str(repeats),
         "--cores", str(cores), *(["--quick"] if quick else [])], capture_output=True, text=True)
    if out.returncode:
      failed = {"failed": (out.stderr.strip().splitlines() or ["no output"])[-1][:160]}
      results.update(dict.fromkeys(group, failed))
    else:
      results.update(zip(group, json.loads(out.stdout.strip().splitlines()[-1])))
  return results


# ------------------------------------------------------------------ the report (parent)


class Bench(NamedTuple):
  """The sizes and the measured steps. A section runs twice: first to list the steps
  it reads (``plan`` a list; every result empty, the printout discarded), then
  to print them once they are measured (``plan`` None)."""

  scale: Scale
  results: dict[Spec, dict]
  plan: list[Spec] | None = None

  def get(self, method: str, batch: int, optimizer: str = "sgd", dim: int = 0,
          history: int = 0) -> tuple[Spec, dict]:
    s = spec(self.scale, method, batch, optimizer, dim, history)
    if self.plan is not None:
      self.plan.append(s)
    return s, self.results.get(s, {})


Ratios = dict[str, "float | None"]


def ratio(a: dict, b: dict, key: str) -> float | None:
  """a[key] / b[key], or None when either is missing."""
  x, y = a.get(key), b.get(key)
  return x / y if x is not None and y else None


def _cell(x: float | None, width: int) -> str:
  return f"{'n/a':>{width}s}" if x is None else f"{x:{width}.3f}"


def _times(x: float | None) -> str:
  return "   n/a" if x is None else f"{x:5.2f}×"


def label(s: Spec) -> str:
  if s.method in TORCH_METHODS:
    name = LABELS[s.method] + ("" if s.method == "torch" else " DP-SGD")
  elif s.method == "nonprivate":
    name = "non-private " + ("SGD" if s.optimizer == "sgd" else "Muon")
  else:
    name = f"{OPTIMIZERS[s.optimizer]} {LABELS[s.method]}"
  name += f" K={s.history}" if s.optimizer == "im" else ""
  return name + (f" (microbatch {s.microbatch})" if s.microbatch else "")


def header(ratio_to: str) -> None:
  print(f"    {'':40s} {'step s':>7s} {ratio_to:>7s}  {'peak RSS':>8s} {'ΔRSS':>7s} "
        f"{'XLA temp':>8s}  (GiB)")


def row(s: Spec, r: dict, base: dict) -> None:
  """One measured step, its time over ``base``'s, and its memory."""
  if "seconds" not in r:
    print(f"    {label(s):40s} {'unavailable' if 'unavailable' in r else 'FAILED'}: "
          f"{r.get('unavailable') or r.get('failed')}")
    return
  print(f"    {label(s):40s} {r['seconds']:7.3f} {_times(ratio(r, base, 'seconds')):>7s}  "
        f"{_cell(r['peak_rss_gib'], 8)} {_cell(r['delta_rss_gib'], 7)} "
        f"{_cell(r['xla_temp_gib'], 8)}")


def overhead(bench: Bench) -> Ratios:
  """Section 1: private / non-private step time, per optimizer and batch size."""
  print("\n1. Private step / non-private step of the same tapped GPT-2")
  header("×non-pr")
  out: Ratios = {}
  for b in bench.scale.overhead_batches:
    print(f"  B = {b}")
    for opt in ("sgd", "muon"):
      s0, base = bench.get("nonprivate", b, opt)
      row(s0, base, base)
      for method in bench.scale.overhead_methods:
        s, r = bench.get(method, b, opt)
        row(s, r, base)
        if method == "ghost" and b == bench.scale.overhead_batches[0]:
          out[f"ghost/non-private {opt}"] = ratio(r, base, "seconds")
  return out


def _memory_ratios(top: dict, bottom: dict) -> dict[str, float | None]:
  return {name: ratio(top, bottom, key) for name, key in MEMORY.items()}


def _fmt_memory(ratios: dict[str, float | None]) -> str:
  return ", ".join(f"{_times(x)} {name}" for name, x in ratios.items())


def _memory_rows(bench: Bench, points: list[tuple[str, int, int]]) -> list[tuple[dict, dict]]:
  """Non-private, vmap and ghost DP-SGD at each (name, B, dim); per point, the memory
  ratios ghost / non-private and vmap / ghost."""
  out = []
  for name, b, dim in points:
    print(f"  {name}")
    results = {m: bench.get(m, b, dim=dim) for m in JAX_METHODS}
    base = results["nonprivate"][1]
    for s, r in results.values():
      row(s, r, base)
    g, v = results["ghost"][1], results["vmap"][1]
    out.append((_memory_ratios(g, base), _memory_ratios(v, g)))
    print(f"    ghost/non-private: {_fmt_memory(out[-1][0])}")
    print(f"    vmap/ghost:        {_fmt_memory(out[-1][1])}")
  return out


def memory(bench: Bench) -> Ratios:
  """Section 2: peak memory against the batch size and the width."""
  sc = bench.scale
  print(f"\n2. Memory of DP-SGD steps against B (width {sc.dim}) and width (B = "
        f"{sc.width_batch})")
  header("×non-pr")
  rows = _memory_rows(bench, [(f"B = {b}, width {sc.dim}", b, sc.dim)
                              for b in sc.memory_batches])
  rows += _memory_rows(bench, [(f"width {d}, B = {sc.width_batch}", sc.width_batch, d)
                               for d in sc.widths])
  out: Ratios = {}
  for m in MEMORY:
    ghost = [g[m] for g, _ in rows if g[m] is not None]
    out[f"ghost/non-private {m}"] = max(ghost) if ghost else None
    out[f"vmap/ghost {m} at the largest width"] = rows[-1][1][m]
  return out


def inner_momentum(bench: Bench) -> Ratios:
  """Section 3: DP-Muon-IM over DP-Muon per K, and its memory growth over K."""
  sc = bench.scale
  print(f"\n3. DP-Muon-IM / DP-Muon at B = {sc.im_batch} (IM: K past states, K + 1 gradients)")
  header("×Muon")
  out: Ratios = {}
  for method in sc.im_methods:
    s0, base = bench.get(method, sc.im_batch, "muon")
    row(s0, base, base)
    rows = {k: bench.get(method, sc.im_batch, "im", history=k) for k in sc.histories}
    for s, r in rows.values():
      row(s, r, base)
      if "state_mib" in r:
        print(f"{'':44s}optimizer state {r['state_mib']:.2f} MiB")
    first, last = rows[sc.histories[0]][1], rows[sc.histories[-1]][1]
    growth = _memory_ratios(last, first)
    print(f"    {method}: memory K = {sc.histories[0]} → {sc.histories[-1]}: "
          f"{_fmt_memory(growth)}")
    out[f"IM/DP-Muon {method}"] = ratio(first, base, "seconds")
    out.update({f"IM memory growth {method} {m}": x for m, x in growth.items()})
  return out


def opacus(bench: Bench) -> Ratios:
  """Section 4: the same model and batch in PyTorch, non-private and under Opacus."""
  b = bench.scale.torch_batch
  try:
    import opacus  # noqa: F401  (and torch)
  except ImportError as e:
    print(f"\n4. Opacus: skipped ({e}; pip install -e \".[bench]\")")
    return {}
  print(f"\n4. PyTorch and Opacus at B = {b}, DP-SGD at C = {CLIP}, σ = {SIGMA}; "
        f"torch.set_num_threads(cores), and XLA's CPU pool sized by the same cores")
  header("×torch")
  torch_rows = {m: bench.get(m, b) for m in TORCH_METHODS}
  jax_rows = {m: bench.get(m, b) for m in JAX_METHODS}
  tbase, jbase = torch_rows["torch"][1], jax_rows["nonprivate"][1]
  for s, r in torch_rows.values():
    row(s, r, tbase)
  header("×non-pr")
  for s, r in jax_rows.values():
    row(s, r, jbase)
  counts = (tbase.get("params"), jbase.get("params"), torch_rows["opacus-ghost"][1].get("params"))
  print(f"    parameters: torch {counts[0]}, JAX {counts[1]} "
        f"({'match' if counts[0] == counts[1] else 'DIFFER'}); Opacus ghost refuses tied "
        f"parameters, so its model has its own head: {counts[2]}")
  ours = jax_rows["ghost"][1]
  out: Ratios = {}
  for m in ("opacus-ghost", "hooks"):
    r = torch_rows[m][1]
    out[f"ghost/{m}"] = ratio(ours, r, "seconds")
    print(f"    our ghost / {LABELS[m]}: {_times(ratio(ours, r, 'seconds'))} time, "
          f"{_times(ratio(ours, r, 'delta_rss_gib'))} ΔRSS, "
          f"{_times(ratio(ours, r, 'peak_rss_gib'))} peak RSS")
  return out


TARGETS = (
    ("ghost/non-private sgd", "ghost DP-SGD / non-private SGD step time, B = {b}", 1.5, "≤"),
    ("ghost/non-private muon", "ghost DP-Muon / non-private Muon step time, B = {b}", 1.5, "≤"),
    ("ghost/non-private {m}", "ghost / non-private memory, worst of section 2", 1.3, "≤"),
    ("vmap/ghost {m} at the largest width", "vmap / ghost memory, width {w}", 2.0, "≥"),
    ("ghost/opacus-ghost", "our ghost / Opacus ghost step time", 0.8, "≤"),
    ("IM/DP-Muon ghost", "DP-Muon-IM (K = {k0}) / DP-Muon step time, ghost", 1.9, "≤"),
    ("IM memory growth ghost {m}", "DP-Muon-IM memory, K = {k0} → {k1}, ghost", 1.5, "≤"),
)
"""(ratio, what it is, bound, sense): what the section's numbers are read against; a
memory ratio (``{m}``) is judged on peak RSS, with ΔRSS and XLA temp beside it."""


def targets(ratios: Ratios, scale: Scale) -> None:
  """Each target met or missed, for the ratios this run measured."""
  print("\nTargets" + (" (meaningless at --quick sizes):" if scale is QUICK else ":"))
  names = {"b": scale.overhead_batches[0], "w": scale.widths[-1], "k0": scale.histories[0],
           "k1": scale.histories[-1]}
  for key, text, bound, sense in TARGETS:
    value = ratios.get(key.format(m="peak RSS"))
    if value is None:
      continue
    met = value <= bound if sense == "≤" else value >= bound
    others = {m: ratios.get(key.format(m=m)) for m in MEMORY if m != "peak RSS"}
    beside = f" peak RSS ({_fmt_memory(others).strip()})" if "{m}" in key else ""
    print(f"  {text.format(**names):50s} {value:5.2f}×{beside}  target {sense} {bound}×: "
          f"{'met' if met else 'MISSED'}")


SECTION_FNS: dict[str, Callable[[Bench], Ratios]] = {
    "overhead": overhead, "memory": memory, "im": inner_momentum, "opacus": opacus}


def _plan(name: str, scale: Scale) -> list[Spec]:
  """The steps a section reads, in its order (a dry run, printout discarded)."""
  plan: list[Spec] = []
  with contextlib.redirect_stdout(io.StringIO()):
    SECTION_FNS[name](Bench(scale, {}, plan))
  return list(dict.fromkeys(plan))


def run_sections(sections: list[str], scale: Scale, quick: bool, repeats: int, cores: int
                 ) -> None:
  """Per section: measures its steps one after another, then prints it; then the targets.

  So a section's time ratios compare steps measured back to back on cores that
  may be shared; only the memory section, whose numbers do not move with the
  load, reuses steps measured before it. ``--quick`` measures all at once.
  """
  plans = {name: _plan(name, scale) for name in sections}
  run = lambda specs: measure(specs, scale, quick, repeats, cores)
  everything = run(list(dict.fromkeys(sum(plans.values(), [])))) if quick else {}
  earlier: dict[Spec, dict] = {}
  ratios: Ratios = {}
  failed: set[str] = set()
  for name in sections:
    reuse = everything if quick else earlier if name == "memory" else {}
    results = {**reuse, **run([s for s in plans[name] if s not in reuse])}
    earlier.update(results)
    failed.update(label(s) for s, r in results.items() if "failed" in r)
    ratios.update(SECTION_FNS[name](Bench(scale, results)))
  targets(ratios, scale)
  if failed:
    sys.exit(f"{len(failed)} step(s) failed: {', '.join(sorted(failed))}")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true",
                      help="tiny GPT-2, one repeat: a smoke run (numbers mean nothing)")
  parser.add_argument("--section", choices=SECTIONS, action="append",
                      help="run only this section (repeatable; default: all)")
  parser.add_argument("--repeats", type=int, default=None)
  parser.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)),
                      help="pin each step's process to this many cores (default: all usable)")
  parser.add_argument("--child", help=argparse.SUPPRESS)
  args = parser.parse_args()
  scale = QUICK if args.quick else FULL
  repeats = args.repeats or scale.repeats
  if args.child:  # before JAX's CPU client and torch size their thread pools by the cores
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:args.cores])
    print(json.dumps([child(Spec(*s), scale, repeats) for s in json.loads(args.child)]))
    return
  print(f"jax {jax.__version__}, {jax.devices()[0].platform}, {args.cores} cores per step "
        f"(sched_setaffinity; torch.set_num_threads({args.cores})); GPT-2 "
        f"{scale.layers} layers, vocab {scale.vocab}, T = {scale.length}, width/64 heads; "
        f"fastest of {repeats} steps after a warm-up, "
        + ("all in one process (--quick)" if args.quick else "each in a fresh process"))
  run_sections(args.section or list(SECTIONS), scale, args.quick, repeats, args.cores)


if __name__ == "__main__":
  main()
