"""Evaluation: WikiText-2 data and calibration windows, perplexity, zero-shot tasks, the inference profile."""
