"""Speculative decoding: proposers (a draft model or n-grams) and the verification of their
tokens.
"""
