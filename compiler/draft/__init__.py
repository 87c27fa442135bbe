"""Speculative decoding at compile time: making a draft (`kiln draft`), checking and compiling
a recipe's draft, and measuring its acceptance.
"""
