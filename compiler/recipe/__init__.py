"""The recipe: one YAML file describing a deployment, read with the line of every key and
validated once at the edge.
"""
