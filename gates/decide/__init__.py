"""What the gate decides from its measurements: McNemar bounds, the rules of each check, and
the verdict.
"""
