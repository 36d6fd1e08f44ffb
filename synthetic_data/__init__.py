"""Seeded synthetic EHR cohorts in the visits format, with planted temporal structure (see README.md)."""

from synthetic_data.generator import SynthConfig, catalogue_codes, generate

__all__ = ["SynthConfig", "catalogue_codes", "generate"]
