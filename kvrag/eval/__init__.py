"""Evaluation: datasets, metrics, the method x ratio runner and its report."""
