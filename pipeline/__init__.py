"""Strata: hidden-state capture with provenance, EAGLE-3 draft training, and a promotion gate."""

__version__ = "0.1.0"
