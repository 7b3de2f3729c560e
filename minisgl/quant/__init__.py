"""Quantised weights: FP8 projections with their scales, loaded, converted and multiplied."""
