"""What the gate measures, through an engine: lm-eval tasks, next-token divergence, recorded
traffic replayed through both sides, their cached answers and the noise floor's control.
"""
