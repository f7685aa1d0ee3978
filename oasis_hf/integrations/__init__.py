"""Integrations with transformers (attention registry)."""
