"""The `trtllm-serve --config options.yaml` file (a.k.a. `--extra_llm_api_options`) for
TensorRT-LLM's PyTorch backend, which serves the quantised Hugging Face checkpoint directly.

Keys are LLM API argument names, checked against tensorrt_llm/llmapi/llm_args.py (1.1/1.2
and main, 2026): `BaseLlmArgs` (tensor_parallel_size, pipeline_parallel_size,
max_batch_size, max_input_len, max_seq_len, max_num_tokens, enable_chunked_prefill,
kv_cache_config, speculative_config), `KvCacheConfig` (free_gpu_memory_fraction,
enable_block_reuse, tokens_per_block, dtype — "fp8" for an FP8 KV cache, PyTorch backend
only), `DecodingBaseConfig.from_dict` ("DraftTarget" → DraftTargetDecodingConfig, spelled
"Draft_Target" after 1.2: written for the installed TensorRT-LLM, 1.2 where none is,
runtime/formats/trtllm_serve.py; its `speculative_model_dir` is an accepted alias of
`speculative_model` on main) and
`TorchLlmArgs.disable_overlap_scheduler`, which docs/source/features/speculative-decoding.md
sets for draft/target and NGram ("NGram" → NGramDecodingConfig: max_draft_len,
max_matching_ngram_size). The LLM API rejects unknown keys (extra="forbid"), so nothing else
goes in.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from kiln.compiler.trtllm.capacity import DeploySpec, Plan
from kiln.compiler.trtllm.rules.support import check_algos
from kiln.compiler.trtllm.targets import get_profile
from kiln.quant.spec import Scheme
from kiln.runtime.base.errors import PreflightError
from kiln.runtime.base.versions import version
from kiln.runtime.formats.trtllm_serve import draft_target


def serve_options(
    scheme: Scheme,
    deploy: DeploySpec,
    plan: Plan,
    *,
    draft_dir: Path | str | None = None,
    max_draft_len: int | None = None,
    ngram_size: int | None = None,
) -> dict[str, Any]:
    """LLM API options serving `plan` on the PyTorch backend; PreflightError if it cannot.

    With `draft_dir` and `max_draft_len`, draft-target speculative decoding from the draft
    model's Hugging Face checkpoint in `draft_dir`; with `ngram_size` and `max_draft_len`
    instead, prompt-lookup (n-gram) speculation matching up to `ngram_size` tokens.
    """
    problems = [str(p) for p in check_algos(plan.quant_algo, plan.kv_cache_quant_algo,
                                            get_profile(plan.target), "pytorch")]  # fmt: skip
    if not plan.fits:
        problems.append(f"deploy: the model does not fit {plan.target} at tp={plan.tp_size} "
                        f"({'; '.join(plan.suggestions) or 'use a larger GPU'})")  # fmt: skip
    drafter = draft_dir is not None or ngram_size is not None
    if draft_dir is not None and ngram_size is not None:
        problems.append("speculative decoding takes a draft_dir or an ngram_size, not both")
    elif drafter != (max_draft_len is not None):
        problems.append("speculative decoding needs max_draft_len and a draft_dir "
                        "(or an ngram_size)")  # fmt: skip
    elif max_draft_len is not None and max_draft_len < 1:
        problems.append(f"max_draft_len {max_draft_len}: draft at least 1 token (4 to 10 usual)")
    if problems:
        raise PreflightError("trtllm-serve options for " + plan.target + ":\n"
                             + "\n".join(f"  {p}" for p in problems))  # fmt: skip
    input_len = deploy.max_input_len or deploy.max_seq_len - 1
    kv_cache: dict[str, Any] = {
        "free_gpu_memory_fraction": deploy.kv_free_fraction,
        "enable_block_reuse": True,
        "tokens_per_block": deploy.tokens_per_block,
    }
    if scheme.kv_cache == "fp8":
        kv_cache["dtype"] = "fp8"
    options: dict[str, Any] = {
        "tensor_parallel_size": plan.tp_size,
        "pipeline_parallel_size": plan.pp_size,
        "max_batch_size": plan.recommended_max_batch_size,
        "max_input_len": input_len,
        "max_seq_len": deploy.max_seq_len,
        "max_num_tokens": plan.recommended_max_num_tokens,
        "kv_cache_config": kv_cache,
    }
    if input_len > plan.recommended_max_num_tokens:  # a long prompt is prefilled in chunks
        options["enable_chunked_prefill"] = True
    if draft_dir is not None:
        options["speculative_config"] = {
            "decoding_type": draft_target(version("tensorrt_llm", "tensorrt-llm")),
            "max_draft_len": max_draft_len,
            "speculative_model_dir": str(draft_dir),
        }
        options["disable_overlap_scheduler"] = True
    elif ngram_size is not None:
        options["speculative_config"] = {
            "decoding_type": "NGram",
            "max_draft_len": max_draft_len,
            "max_matching_ngram_size": ngram_size,
        }
        options["disable_overlap_scheduler"] = True
    return options


def write_serve_config(path: Path | str, options: dict[str, Any], header: str = "") -> Path:
    """Write `options` as the YAML file `trtllm-serve <model> --config <path>` reads.

    `header`: the command line to put on top instead of the generic one (when the options
    name paths relative to a directory to run from).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    command = header or f"trtllm-serve <model_dir> --backend pytorch --config {path.name}"
    text = f"# {command}\n"
    path.write_text(text + yaml.safe_dump(options, sort_keys=False))
    return path
