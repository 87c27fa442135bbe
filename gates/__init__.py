"""kiln's promotion gate: lm-eval tasks and shadow traffic, verdicts, reports, the registry.

`measure/` (tasks, the lm-eval adapter, KL and top-1, replayed traffic through both sides,
the shadow comparison, cached baseline answers, the noise floor's control), `decide/`
(McNemar bounds, the task rules, the checks, the verdict), `report/` (Markdown, HTML),
`evaluate.py` (both model sides through the tasks and texts), `run.py` (the gate's order of
steps), `settings.py` (the recipe's `gates:` section), `releases.py` and `channel_rules.py`
(the release registry: channels, promotion, rollback). Imports nothing heavy at package import.
"""
