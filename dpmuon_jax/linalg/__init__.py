"""Linear algebra with no privacy content: Newton–Schulz, power iteration, matrix views.

* :mod:`~dpmuon_jax.linalg.newton_schulz`: the quintic Newton–Schulz iteration
  approximating the polar factor (Keller Jordan's Muon; "Spectral Gradient
  Orthogonalization Improves Differentially Private Training at Scale",
  Method, design 2), with schedules such as Polar Express.
* :mod:`~dpmuon_jax.linalg.power_iteration`: the top singular value σ₁.
* :mod:`~dpmuon_jax.linalg.scaling`: how a parameter leaf is viewed as a matrix
  (dimension numbers, path names) and Muon's aspect-ratio scaling.

This layer imports nothing else from the package, so privacy code and the
Optax post-processing above can both use it.
"""
