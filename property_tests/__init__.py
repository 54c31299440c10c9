"""Hypothesis strategies and properties that prove the reducer averages exactly."""
