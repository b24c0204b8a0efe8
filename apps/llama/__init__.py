"""Colossal-LLaMA-style domain adaptation recipe."""
