"""kiln: compile, gate and serve quantised LLMs for NVIDIA GPUs.

The product's four packages sit at the top of the repository (compiler/, quant/, gates/,
runtime/); this package gathers them under one import name, so installed kiln owns only
`kiln` and never shadows another distribution's `runtime` or `compiler`. The entries here
are links to those folders, so an edit in the repository is what runs, with or without an
editable install. Layering (checked by import-linter, see pyproject.toml):
runtime imports nothing of ours; quant and gates import only the runtime; compiler imports all.
"""
