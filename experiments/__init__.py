"""Configs and the sweep runner that reproduce the papers' experiments."""
