"""kiln's promotion gate: lm-eval tasks and shadow traffic, verdicts, reports, the registry.

Modules: `rules` (decision rules, sampling error, flips), `mcnemar` (the pass/fail/
inconclusive task rule and its power), `divergence` (KL, top-1), `noise_floor` (the
control that measures "lossless"), `eval_cache` (cached baseline evaluations),
`replay` and `sides` (recorded traffic through both sides), `shadow` (the comparison of
their answers, replayed or from a mirror log), `verdict` (gate.json), `report` (Markdown, HTML),
`tasks` and `lm_eval_adapter` (offline lm-eval through the runtime), `registry`
(channels, promotion, rollback), `config` (the recipe's `gates:` section), `gate` (the
run), `cli` (the commands). Imports nothing heavy at package import.
"""
