"""Clients of OpenAI-compatible servers: a small streaming HTTP client and `kiln bench`'s load
generator.
"""
