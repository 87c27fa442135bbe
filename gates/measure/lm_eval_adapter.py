"""lm-eval model `kiln`: evaluate an artifact through kiln's runtime engine.

    python -m kiln.gates.measure.lm_eval_adapter run --model kiln --model_args artifact=PATH \
        --include_path recipes/tasks --tasks kiln_mc,kiln_qa

(lm-eval has no plugin discovery, so its own `lm_eval` command only knows `kiln` once this
module is imported; running the module starts lm-eval's CLI with `kiln` registered beside
lm-eval's own models and `${KILN_TASKS_DIR}` placeholders of a user's task files resolved.)

`KilnLM` builds on lm-eval's `TemplateLM`, so contexts and continuations are tokenised
exactly as lm-eval's `hf` model does (trailing spaces moved into the continuation, the
BOS/EOS prefix for empty contexts, the same rolling windows): scores of the runtime side
and of a transformers side are comparable item by item.

- loglikelihood: prompt log-probabilities of the continuation tokens (`prompt_logprobs`
  from the continuation's first token on), greedy when every continuation token ranks
  first; the choices of one item share their context through the prefix cache;
- loglikelihood_rolling: the same over lm-eval's disjoint rolling windows;
- generate_until: greedy (or sampled) generation with the request's stop strings.

`ScoringLM` holds all of that on top of two primitives, a batch of prompts' per-position
log-probabilities and a batch of generations; `KilnLM` answers them with the engine in this
process, `HttpLM` (gates/measure/http_lm.py) with an OpenAI-compatible server, so a model
scored over HTTP is scored item for item as it is in process.

Runtime-free fallback: `hf_source_lm` loads a float *model source* (a Hugging Face
checkpoint directory) with lm-eval's own `hf` model. It exists only for the float baseline
side of a gate; a candidate artifact is always evaluated through the runtime, because the
gate evaluates what ships.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# lm-eval's own models, registered before `kiln` joins them (its registry loads them only
# while it is empty, so `--model hf` would otherwise be unknown beside `kiln`).
import lm_eval.models  # noqa: F401
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from kiln.gates.measure.openai_answers import NotMeasured
from kiln.runtime.base.errors import UsageError

DEFAULT_MAX_LENGTH = 2048


@dataclass(frozen=True, slots=True)
class Generation:
    """One generation request of `generate_until`: prompt ids and how to decode them."""

    prompt: list[int]
    max_tokens: int
    temperature: float
    stop: list[str]


class ScoringLM(TemplateLM):
    """lm-eval's request types on a tokenizer plus two primitives a subclass answers:
    `_prompt_logprobs` (per-position {token: entry with .logprob and .rank}) and `_generate`."""

    def __init__(self, tokenizer: Any, max_length: int, batch_size: int) -> None:
        super().__init__()
        self.tokenizer = tokenizer
        self._max_length = max_length
        self.batch_size = batch_size

    # -- tokenisation, as lm-eval's hf model does it ----------------------------------

    @property
    def eot_token_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return int(bos if bos is not None else self.tokenizer.eos_token_id)

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "kiln")).replace("/", "__")

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **kwargs: Any
    ) -> list[int]:
        """Token ids of a string; a string already starting with BOS gets no second one."""
        bos = self.tokenizer.decode(self.prefix_token_id)
        extra = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        if add_special_tokens is None and bos and string.startswith(bos):
            extra = {"add_special_tokens": False}
        return list(self.tokenizer.encode(string, **extra))

    # -- the two primitives -----------------------------------------------------------

    def _prompt_logprobs(
        self, prompts: Sequence[list[int]], top_k: int = 0, starts: Sequence[int] | None = None
    ) -> list[Any]:
        """Each prompt's per-position {token: entry} (None before its start, `starts[i]`
        defaulting to 1), holding the top `top_k` and the prompt's own token."""
        raise NotImplementedError

    def _generate(self, requests: Sequence[Generation]) -> list[str]:
        """Each request's generated text (stop strings not yet cut)."""
        raise NotImplementedError

    # -- scoring ----------------------------------------------------------------------

    def _loglikelihood_tokens(
        self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False, **_: Any
    ) -> list[tuple[float, bool]]:
        prompts, lengths = [], []
        for _key, context, continuation in requests:
            prompts.append((context + continuation)[-(self.max_length + 1) :])
            lengths.append(len(continuation))
        if max(lengths, default=0) > self.max_length:
            raise NotMeasured(
                f"an item's continuation is {max(lengths)} tokens, more than the "
                f"{self.max_length} the model's context leaves to score it"
            )
        starts = [len(p) - n for p, n in zip(prompts, lengths, strict=True)]
        results = []
        for prompt, n, logprobs in zip(
            prompts, lengths, self._prompt_logprobs(prompts, starts=starts), strict=True
        ):
            total, greedy = 0.0, True
            for token, entry in zip(prompt[-n:], logprobs[-n:], strict=True):
                total += entry[token].logprob
                greedy = greedy and entry[token].rank == 1
            results.append((total, greedy))
        return results

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Whole-document log-likelihood over lm-eval's disjoint rolling windows."""
        windows: list[tuple[Any, list[int], list[int]]] = []
        owners: list[int] = []
        for i, (text,) in enumerate(req.args for req in requests):
            for context, continuation in map(
                make_disjoint_window,
                get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            ):
                windows.append((None, context, continuation))
                owners.append(i)
        totals = [0.0] * len(requests)
        for owner, (score, _) in zip(owners, self._loglikelihood_tokens(windows), strict=True):
            totals[owner] += score
        return totals

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Generate for each (context, gen_kwargs); cut at the first stop string."""
        wanted = []
        for context, gen_kwargs in (req.args for req in requests):
            kwargs = dict(gen_kwargs)
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else [u for u in until if u]
            max_gen = int(kwargs.get("max_gen_toks", 256))
            sampled = bool(kwargs.get("do_sample", False)) and kwargs.get("temperature", 0) > 0
            ids = self.tok_encode(context)[-max(1, self.max_length - max_gen) :]
            temperature = float(kwargs["temperature"]) if sampled else 0.0
            wanted.append(Generation(ids, max_gen, temperature, until))
        out = []
        for text, request in zip(self._generate(wanted), wanted, strict=True):
            for stop in request.stop:
                text = text.split(stop)[0]
            out.append(text)
        return out

    def topk_logprobs(self, token_ids: Sequence[list[int]], k: int) -> list[list[dict[int, float]]]:
        """Per prompt, for positions 1.., the top-k next-token {id: logprob} of position-1."""
        out = []
        for logprobs in self._prompt_logprobs(token_ids, top_k=k):
            out.append(
                [
                    {t: lp.logprob for t, lp in entry.items() if lp.rank <= k}
                    for entry in logprobs[1:]
                ]
            )
        return out


@register_model("kiln")
class KilnLM(ScoringLM):
    """An lm-eval model backed by `runtime.Engine` on an artifact (or a float HF directory)."""

    def __init__(
        self,
        artifact: str | None = None,
        pretrained: str | None = None,
        engine: Any = None,
        max_length: int | None = None,
        batch_size: int | str = 64,
        device: str | None = None,
        **engine_config: Any,
    ) -> None:
        if engine is None:
            import torch

            from kiln.runtime import Engine

            # lm-eval's CLI passes device="cuda" by default; without a GPU run on the CPU.
            if not device or (device.startswith("cuda") and not torch.cuda.is_available()):
                device = "cpu"
            engine_config.pop("max_batch_size", None)  # lm-eval's, not an engine setting
            path = artifact or pretrained
            if not path:
                raise UsageError(
                    "model `kiln` needs model_args artifact=PATH (a kiln artifact) or "
                    "pretrained=DIR (a Hugging Face checkpoint directory)"
                )
            engine = Engine.load(path, device=device, **engine_config)
        self.engine = engine
        # The engine needs room for the scored window plus one generated token.
        limit = engine.max_model_len - 2
        # Requests handed to the engine at once; it batches them continuously itself, so
        # lm-eval's CLI default of 1 (or "auto") would only slow it down.
        chunk = int(batch_size) if str(batch_size).isdigit() else 0
        super().__init__(
            engine.tokenizer, min(int(max_length or DEFAULT_MAX_LENGTH), limit),
            chunk if chunk > 1 else 64,
        )  # fmt: skip

    def _prompt_logprobs(
        self, prompts: Sequence[list[int]], top_k: int = 0, starts: Sequence[int] | None = None
    ) -> list[Any]:
        """In batches; the positions before `starts[i]` are the context, which the engine's
        prefix cache computes once for every prompt sharing it. So that the cache holds a
        context before its other continuations arrive, each batch runs the first prompt of
        every context first and the rest after it."""
        from kiln.runtime import SamplingParams

        starts = list(starts) if starts is not None else [1] * len(prompts)
        first: dict[tuple[int, ...], int] = {}
        for i, (prompt, start) in enumerate(zip(prompts, starts, strict=True)):
            first.setdefault(tuple(prompt[:start]), i)
        leaders = sorted(first.values())
        followers: dict[int, list[int]] = {i: [] for i in leaders}
        for i, (prompt, start) in enumerate(zip(prompts, starts, strict=True)):
            leader = first[tuple(prompt[:start])]
            if leader != i:
                followers[leader].append(i)
        out: list[Any] = [None] * len(prompts)
        for begin in range(0, len(leaders), self.batch_size):
            group = leaders[begin : begin + self.batch_size]
            rest = [i for leader in group for i in followers[leader]]
            for wave in (group, rest):
                params = [
                    SamplingParams(
                        max_tokens=1,
                        temperature=0.0,
                        prompt_logprobs=top_k,
                        prompt_logprobs_start=max(1, starts[i]),
                    )
                    for i in wave
                ]
                batch = [list(prompts[i]) for i in wave]
                for i, output in zip(wave, self.engine.generate(batch, params), strict=True):
                    out[i] = output.prompt_logprobs
        return out

    def _generate(self, requests: Sequence[Generation]) -> list[str]:
        from kiln.runtime import SamplingParams

        texts: list[str] = []
        for start in range(0, len(requests), self.batch_size):
            chunk = requests[start : start + self.batch_size]
            params = [
                SamplingParams(max_tokens=r.max_tokens, temperature=r.temperature, stop=r.stop)
                for r in chunk
            ]
            texts += [o.text for o in self.engine.generate([r.prompt for r in chunk], params)]
        return texts


# --- the float baseline: lm-eval's own transformers model ---------------------------


def hf_source_lm(
    model_dir: str | Path, max_length: int = DEFAULT_MAX_LENGTH, batch_size: int = 8
) -> Any:
    """lm-eval's `hf` model on a float checkpoint directory (CPU, float32)."""
    from lm_eval.models.huggingface import HFLM

    return HFLM(
        pretrained=str(model_dir),
        device="cpu",
        dtype="float32",
        batch_size=batch_size,
        max_length=max_length,
    )


def hf_topk_logprobs(
    lm: Any, token_ids: Sequence[list[int]], k: int
) -> list[list[dict[int, float]]]:
    """The transformers side of `KilnLM.topk_logprobs`, aligned position for position."""
    import torch

    out = []
    with torch.inference_mode():
        for ids in token_ids:
            logits = lm.model(torch.tensor([ids])).logits[0, :-1].float()
            values, indices = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)
            out.append(
                [
                    dict(zip(row_ids, row_values, strict=True))
                    for row_ids, row_values in zip(indices.tolist(), values.tolist(), strict=True)
                ]
            )
    return out


def main(argv: Sequence[str] | None = None) -> None:
    """lm-eval's CLI with model `kiln` registered; `--include_path DIR` placeholders resolved."""
    import sys
    import tempfile

    from lm_eval.__main__ import cli_evaluate

    from kiln.gates.measure.tasks import prepare_task_dir

    args = list(sys.argv[1:] if argv is None else argv)
    with tempfile.TemporaryDirectory(prefix="kiln-tasks-") as tmp:
        for i, arg in enumerate(args):
            if arg.startswith("--include_path="):
                source = arg.split("=", 1)[1]
                args[i] = f"--include_path={prepare_task_dir([Path(source)], Path(tmp) / str(i))}"
            elif arg == "--include_path" and i + 1 < len(args):
                args[i + 1] = str(prepare_task_dir([Path(args[i + 1])], Path(tmp) / str(i)))
        sys.argv = [sys.argv[0], *args]
        cli_evaluate()


if __name__ == "__main__":
    main()
