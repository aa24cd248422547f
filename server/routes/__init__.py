"""Thin HTTP handlers; the flow they share lives in `completion_flow`."""
