"""llm-compressor backend: `llmcompressor.oneshot` → compressed-tensors checkpoint.

Schemes map to compressed-tensors `QuantizationArgs` the way llm-compressor's own presets do
(FP8, FP8_DYNAMIC, W4A16, W8A16, INT8_W8A8), with group size, symmetry and KV cache taken
from the spec. AWQ is a transform in llm-compressor 0.14 (it only rescales), so it is
followed by a QuantizationModifier; SmoothQuant is followed by GPTQ.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.quant.backends.base import SHARD_SIZE, QuantJob, register_backend
from kiln.quant.selection import ignore_regexes

if TYPE_CHECKING:
    from kiln.quant.spec import QuantSpec, Scheme


def _weights(scheme: Scheme) -> dict[str, Any]:
    if scheme.weight_type == "float":  # FP8: per tensor (static) or per channel (dynamic)
        strategy = "tensor" if scheme.name == "FP8" else "channel"
        return {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True}
    args: dict[str, Any] = {
        "num_bits": scheme.weight_bits,
        "type": "int",
        "symmetric": scheme.symmetric,
        "strategy": "channel" if scheme.group_size is None else "group",
    }
    if scheme.group_size is not None:
        args["group_size"] = scheme.group_size
    return args


def _eight_bit(
    kind: str, strategy: str, dynamic: bool, observer: str | None = None
) -> dict[str, Any]:
    """Symmetric 8-bit QuantizationArgs (as a dict) for activations or the KV cache."""
    args = {"num_bits": 8, "type": kind, "strategy": strategy, "dynamic": dynamic}
    return {**args, "symmetric": True, **({"observer": observer} if observer else {})}


# Static activation scales come from the min/max seen over all calibration batches.
ACTIVATIONS: dict[str, dict[str, Any] | None] = {
    "none": None,
    "fp8_static": _eight_bit("float", "tensor", False, "static_minmax"),
    "fp8_dynamic": _eight_bit("float", "token", True),
    "int8_dynamic": _eight_bit("int", "token", True),
    "int8_static": _eight_bit("int", "tensor", False, "static_minmax"),
}
KV_CACHE: dict[str, dict[str, Any] | None] = {
    "none": None,
    "fp8": _eight_bit("float", "tensor", False),
    "int8": _eight_bit("int", "tensor", False),
}


def build_recipe(scheme: Scheme, spec: QuantSpec) -> list[Any]:
    """The llm-compressor modifiers that produce `scheme`."""
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from llmcompressor.modifiers.transform import AWQModifier, SmoothQuantModifier

    group: dict[str, Any] = {"targets": ["Linear"], "weights": _weights(scheme)}
    if ACTIVATIONS[scheme.activations] is not None:
        group["input_activations"] = ACTIVATIONS[scheme.activations]
    quant_args: dict[str, Any] = {
        "config_groups": {"group_0": group},
        "ignore": [f"re:{r}" for r in ignore_regexes(spec.ignore)],
        "kv_cache_scheme": KV_CACHE[scheme.kv_cache],
    }
    if scheme.method == "awq":
        return [AWQModifier(), QuantizationModifier(**quant_args)]
    if scheme.method == "gptq":
        return [GPTQModifier(dampening_frac=spec.dampening_frac, **quant_args)]
    if scheme.method == "smoothquant":
        return [
            SmoothQuantModifier(smoothing_strength=spec.smoothing_strength),
            GPTQModifier(dampening_frac=spec.dampening_frac, **quant_args),
        ]
    return [QuantizationModifier(**quant_args)]  # fp8, fp8_dynamic: round to nearest


def propagates(recipe: list[Any]) -> bool:
    """Whether oneshot's sequential pipeline must run each layer a second time to hand the next
    layer its outputs: only where a modifier changes the layer's weights before the next one
    calibrates (GPTQ, AWQ, SmoothQuant). A recipe of QuantizationModifier alone (FP8, round to
    nearest) only observes: the pipeline calibrates with quantisation disabled and the weights
    float, so the second pass (`propagate_error`, on by default) computes the first's outputs
    again, bit for bit, and leaving it out halves the calibration's forwards with the same
    checkpoint (tests/quant/test_backends.py holds the bytes equal)."""
    from llmcompressor.modifiers.quantization import QuantizationModifier

    return not all(type(modifier) is QuantizationModifier for modifier in recipe)


def load_offloaded(model_dir: Path, dtype: Any, offload: Path, scheme: Scheme) -> Any:
    """The float model with every weight left on disk (compressed-tensors' offloading reads it
    from the checkpoint's own files; what calibration changes is written under `offload`)
    until oneshot's sequential pipeline onloads its layer, on the GPU where there is one."""
    from compressed_tensors.offload import load_offloaded_model
    from transformers import AutoModelForCausalLM

    with load_offloaded_model():
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=dtype, device_map="auto_offload", max_memory={"cpu": 0},
            offload_folder=str(offload),
        )  # fmt: skip
    return model.eval()


@register_backend(
    "llmcompressor",
    format="compressed-tensors",
    schemes={"NO_QUANT", "FP8", "FP8_DYNAMIC", "W4A16_AWQ", "W4A16_GPTQ", "W8A16", "W8A8_SQ"},
    activations=set(ACTIVATIONS),
    kv_cache=set(KV_CACHE),
    asymmetric={"W4A16_AWQ", "W4A16_GPTQ", "W8A16"},
    per_channel={"W4A16_AWQ", "W4A16_GPTQ", "W8A16"},
    packages=("llmcompressor", "compressed-tensors"),
    load=load_offloaded,
)
def run(job: QuantJob) -> None:
    """Quantise the model in place with oneshot and save it compressed into job.out_dir.

    The model comes offloaded (quant/quantize.py): oneshot's sequential pipeline onloads one
    decoder layer at a time, compression writes each compressed weight back to the offload,
    and the save writes shard by shard, so no step holds the whole model."""
    from datasets import Dataset
    from llmcompressor import oneshot

    from kiln.quant.backends import fp8_cpu
    from kiln.quant.backends.cpu_workarounds import llmcompressor_on_cpu

    fp8_cpu.register()  # the save rounds FP8 weights on a CPU an order of magnitude sooner
    samples = job.samples
    dataset = None
    if samples:
        dataset = Dataset.from_dict(
            {"input_ids": samples, "attention_mask": [[1] * len(s) for s in samples]}
        )
    recipe = build_recipe(job.scheme, job.spec)
    with llmcompressor_on_cpu(), counted_subgraphs(job.progress):
        oneshot(
            model=job.model,
            tokenizer=job.tokenizer,
            recipe=recipe,
            propagate_error=propagates(recipe),
            dataset=dataset,
            num_calibration_samples=max(len(samples), 1),
            max_seq_length=max((len(s) for s in samples), default=None),
            shuffle_calibration_samples=False,
            moe_calibrate_all_experts=job.calibrate_all_experts,
        )
    job.progress(f"saving compressed-tensors checkpoint to {job.out_dir}")
    job.model.save_pretrained(job.out_dir, save_compressed=True, max_shard_size=SHARD_SIZE)
    restore_expert_names(Path(job.out_dir))


# The bars llm-compressor's sequential pipeline (pipelines/sequential/pipeline.py) shows for
# each subgraph (a decoder layer, then what follows the last): "(3/33): Calibrating".
SUBGRAPH_BAR = re.compile(r"^\((?P<index>\d+)/(?P<total>\d+)\): Calibrating$")


@contextmanager
def counted_subgraphs(progress: Callable[[str], None]) -> Iterator[None]:
    """Within the block, report each subgraph the sequential pipeline starts to calibrate as
    "subgraphs calibrated (done/total)" (then the last as done), in place of its tqdm bars.

    The pipeline names its bars by subgraph and has no callback of its own (its lifecycle
    events do not say how many subgraphs there are), so the module's `tqdm` is wrapped for
    the block, never the library's files."""
    from llmcompressor.pipelines.sequential import pipeline as sequential

    library_bar = sequential.tqdm
    seen = [0]

    def counted(*args: Any, desc: str = "", **kwargs: Any) -> Any:
        if (found := SUBGRAPH_BAR.match(desc)) is not None:
            seen[0] = int(found["total"])
            progress(f"subgraphs calibrated ({int(found['index']) - 1}/{seen[0]})")
        return library_bar(*args, desc=desc, **{**kwargs, "disable": True})

    sequential.tqdm = counted
    try:
        yield
    finally:
        sequential.tqdm = library_bar
    if seen[0]:
        progress(f"subgraphs calibrated ({seen[0]}/{seen[0]})")


# The names llm-compressor gives each expert's projections when it splits transformers 5's
# fused expert tensors into linears to quantise them (modeling/moe/linear_experts.py).
LINEARISED = ("gate_proj", "up_proj", "down_proj")


def restore_expert_names(out_dir: Path) -> None:
    """Rename a saved MoE checkpoint's experts back to the family's own names.

    llm-compressor 0.14 saves the experts of a family it has no save mapping for under its
    linearised names (Mixtral's `experts.N.w1` as `experts.N.gate_proj`, w3 as up_proj, w2 as
    down_proj); kiln's runtime, vLLM and TensorRT-LLM read the family's names. Hand-written:
    no library renames them back. A family whose names are the linearised ones (Qwen3-MoE)
    is left as saved."""
    import json
    import os
    import re
    import shutil

    from kiln.runtime.formats.checkpoint.files import open_tensors
    from kiln.runtime.formats.model_info import ModelInfo
    from kiln.runtime.formats.safetensors_writer import write_files

    info = ModelInfo.from_hf_config(json.loads((out_dir / "config.json").read_text()))
    moe = info.moe
    if moe is None or (moe.gate, moe.up, moe.down) == LINEARISED:
        return
    names = dict(zip(LINEARISED, (moe.gate, moe.up, moe.down), strict=True))
    pattern = re.compile(r"(\.experts\.\d+\.)(gate_proj|up_proj|down_proj)\.")

    def rename(key: str) -> str:
        return pattern.sub(lambda m: f"{m.group(1)}{names[m.group(2)]}.", key)

    for path in sorted(out_dir.glob("*.safetensors")):
        handle = open_tensors(path)
        stored = list(handle.keys())
        if not any(pattern.search(k) for k in stored):
            continue
        renamed = path.parent / f".{path.name}.renamed"  # one tensor in memory at a time
        renamed.mkdir()

        def produce(handle: Any = handle, stored: list[str] = stored, file: str = path.name) -> Any:
            for key in stored:
                yield file, rename(key), handle.get_tensor(key)

        write_files(renamed, produce, {"format": "pt"})
        os.replace(renamed / path.name, path)
        shutil.rmtree(renamed)
    index = out_dir / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"] = {rename(k): v for k, v in data["weight_map"].items()}
        index.write_text(json.dumps(data, indent=2) + "\n")
