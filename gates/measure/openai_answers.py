"""An OpenAI-compatible server's completion answers as the gate reads them, every number checked
where it enters: one choice per prompt, in order, from the model asked for; prompt
log-probabilities finite and at most 0, one per prompt token, keyed by token ids the model has,
ranks that agree with the values, and no position whose probabilities sum past 1; generated
text that is text. An answer that fails a check raises `NotMeasured` saying what and where, so
the check it served is reported as not measured on that engine (and fails the gate); it is
never scored, and never turned into "no difference".

Hand-written: the shapes are vLLM's (`prompt_logprobs`) and lm-eval's (`echo` + `logprobs`)
conventions, and no library checks an answer against the request it answers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# JSON written from float32 can put a log-probability of ~1 a hair above 0, and a bf16 model's
# top-k probabilities a hair above 1 in sum; anything further is not a distribution.
LOGPROB_SLACK = 1e-4
# Below this no float model's log-softmax goes (float32 logits spread that far are no model's),
# and sums of such values overflow a perplexity.
LOGPROB_FLOOR = -1e4
MASS_SLACK = 1e-3
UNRANKED = 10**9  # a token the server gave no rank: never counted as the top-1


class NotMeasured(Exception):
    """The server cannot answer what a check needs; `reason` says why, in its words."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Entry:
    """One token's log-probability and rank at a prompt position (rank 1: most likely;
    under the echo convention, 1 when it is the top-1 and 2 otherwise)."""

    logprob: float
    rank: int


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def logprob(value: Any, where: str) -> float:
    """`value` as a log-probability: a finite number at most 0 (rounding above it is 0) and
    above LOGPROB_FLOOR."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise NotMeasured(f"{where} is {str(value)[:40]!r}, not a number")
    try:
        number = float(value)  # a JSON integer of 400 digits is no float
    except OverflowError:
        number = math.inf
    if not math.isfinite(number) or number > LOGPROB_SLACK or number < LOGPROB_FLOOR:
        shown = str(value)[:40]
        raise NotMeasured(
            f"{where} is {shown}, not a log-probability (finite, at most 0, above "
            f"{LOGPROB_FLOOR:g})"
        )
    return min(number, 0.0)


def completion_choices(data: Any, count: int, model: str) -> list[dict[str, Any]]:
    """An answer's `choices`, one per prompt in index order, from `model`."""
    if not isinstance(data, dict) or not isinstance(data.get("choices"), list):
        raise NotMeasured(f"the answer is not an OpenAI completion (no `choices` list): "
                          f"{str(data)[:160]!r}")  # fmt: skip
    served = data.get("model")
    if served is not None and served != model:
        raise NotMeasured(f"the answer names model {served!r}, not {model!r}, the one asked for")
    rows = data["choices"]
    if not all(isinstance(c, dict) for c in rows):
        raise NotMeasured("the answer's `choices` hold something other than objects")
    indices = [c.get("index") for c in rows]
    if not all(_is_int(i) for i in indices) or sorted(indices) != list(range(count)):
        raise NotMeasured(
            f"the answer's choices have indices {indices[:12]} for {count} prompt(s); one "
            f"choice per prompt, indices 0..{count - 1}, were expected"
        )
    return sorted(rows, key=lambda c: int(c["index"]))


def generated_text(choice: dict[str, Any]) -> str:
    """A choice's generated text."""
    text = choice.get("text")
    if not isinstance(text, str):
        raise NotMeasured(f"the answer's `text` is {str(text)[:80]!r}, not a string")
    return text


def _token_id(key: Any, vocab_size: int, where: str) -> int:
    # JSON object keys are strings: vLLM writes a token id in decimal.
    token = int(key) if isinstance(key, str) and key.isdecimal() and str(int(key)) == key else None
    if token is None or not 0 <= token < vocab_size:
        raise NotMeasured(
            f"{where} is keyed {str(key)[:40]!r}, not a token id of this model "
            f"(0..{vocab_size - 1})"
        )
    return token


def _rank(value: Any, where: str) -> int:
    if value is None:
        return UNRANKED
    if not _is_int(value) or value < 1:
        raise NotMeasured(f"{where} is {value!r}, not a rank (an integer from 1)")
    return int(value)


def _check_row(row: dict[int, Entry], token: int, where: str) -> None:
    """One position: the prompt's token present, mass at most 1, ranks the values allow."""
    if token not in row:
        raise NotMeasured(f"{where} lacks the prompt's own token {token}")
    mass = math.fsum(math.exp(e.logprob) for e in row.values())
    if mass > 1.0 + MASS_SLACK:
        raise NotMeasured(f"{where}'s probabilities sum to {mass:.6g}, more than 1")
    values = sorted((e.logprob for e in row.values()), reverse=True)
    for tid, entry in row.items():
        above = sum(1 for v in values if v > entry.logprob + LOGPROB_SLACK)
        if entry.rank != UNRANKED and above >= entry.rank:
            raise NotMeasured(
                f"{where}: token {tid} is ranked {entry.rank} but {above} token(s) of the same "
                "answer are more likely"
            )


def prompt_logprobs(
    entries: Any, prompt: list[int], vocab_size: int, where: str
) -> list[dict[int, Entry] | None]:
    """vLLM's `prompt_logprobs` (ids as strings) → per position {id: Entry}; position 0 may be
    null (it has no context)."""
    if not isinstance(entries, list) or len(entries) != len(prompt):
        got = len(entries) if isinstance(entries, list) else type(entries).__name__
        raise NotMeasured(f"{where}: prompt_logprobs has {got} position(s) for a "
                          f"{len(prompt)}-token prompt")  # fmt: skip
    out: list[dict[int, Entry] | None] = []
    for pos, (entry, token) in enumerate(zip(entries, prompt, strict=True)):
        at = f"{where}: prompt_logprobs[{pos}]"
        if entry is None and pos == 0:
            out.append(None)
            continue
        if not isinstance(entry, dict) or not entry:
            raise NotMeasured(f"{at} is {str(entry)[:60]!r}, not a {{token id: logprob}} object")
        row = {}
        for key, value in entry.items():
            tid = _token_id(key, vocab_size, at)
            if not isinstance(value, dict):
                raise NotMeasured(f"{at}[{key!r}] is {str(value)[:60]!r}, not an object")
            lp = logprob(value.get("logprob"), f"{at}[{key!r}].logprob")
            row[tid] = Entry(lp, _rank(value.get("rank"), f"{at}[{key!r}].rank"))
        _check_row(row, token, at)
        out.append(row)
    return out


def echo_logprobs(logprobs: Any, prompt: list[int], where: str) -> list[dict[int, Entry] | None]:
    """lm-eval's echo convention → per position {the prompt's token: Entry}: rank 1 when its
    logprob is the top-1's (the greedy test lm-eval's local-completions makes)."""
    values = logprobs.get("token_logprobs") if isinstance(logprobs, dict) else None
    tops = logprobs.get("top_logprobs") if isinstance(logprobs, dict) else None
    if not isinstance(values, list) or len(values) < len(prompt):
        got = len(values) if isinstance(values, list) else "no"
        raise NotMeasured(f"{where}: the echo has {got} token log-probabilities for a "
                          f"{len(prompt)}-token prompt")  # fmt: skip
    if tops is not None and not isinstance(tops, list):
        raise NotMeasured(f"{where}: `top_logprobs` is not a list")
    out: list[dict[int, Entry] | None] = []
    for pos, token in enumerate(prompt):
        at = f"{where}: token_logprobs[{pos}]"
        if values[pos] is None and pos == 0:
            out.append(None)
            continue
        value = logprob(values[pos], at)
        top = tops[pos] if tops is not None and pos < len(tops) else None
        if top is not None and not isinstance(top, dict):
            raise NotMeasured(f"{where}: top_logprobs[{pos}] is not an object")
        best = max(
            (logprob(v, f"{where}: top_logprobs[{pos}]") for v in (top or {}).values()),
            default=value,
        )
        if value > best + LOGPROB_SLACK:
            raise NotMeasured(
                f"{at} is {value:.6g}, more likely than the top-1 the same answer gives "
                f"({best:.6g})"
            )
        out.append({token: Entry(value, 1 if value >= best else 2)})
    return out
