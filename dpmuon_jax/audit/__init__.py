"""Empirical privacy audits: lower bounds ε̂ to check against the accountant's ε."""
