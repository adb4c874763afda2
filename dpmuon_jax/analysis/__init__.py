"""Non-private analysis: spectral diagnostics and polar metrics for studying training.

* :mod:`~dpmuon_jax.analysis.diagnostics`: the noise edge, clean gap, SNR and
  recovery threshold of "Spectral Gradient Orthogonalization Improves
  Differentially Private Training at Scale" (Loss & Training).
* :mod:`~dpmuon_jax.analysis.polar_metrics`: polar/cosine errors, the clipping
  residual and the inner-momentum protocol of the DP-Muon-IM analysis.

Functions prefixed ``nonprivate_`` read a probe batch: their results are not
covered by the privacy guarantee and must never feed back into training.
Nothing in the training path imports this package.
"""
