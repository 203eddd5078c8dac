"""Conformance harness: Spindle's answers checked against the Matrix spec's own
OpenAPI definitions (see docs/conformance.md for how it works and how to extend it)."""
