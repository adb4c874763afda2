"""Data-parallel private training over a device mesh."""
