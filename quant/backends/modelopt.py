"""NVIDIA ModelOpt backend: `mtq.quantize(model, cfg, forward_loop)` → `export_hf_checkpoint`.

Starts from ModelOpt's own presets (FP8_DEFAULT_CFG, INT4_AWQ_CFG, INT8_SMOOTHQUANT_CFG,
W4A8_AWQ_BETA_CFG, NVFP4_DEFAULT_CFG), sets the AWQ block size to the group size, adds
FP8_KV_CFG for an FP8 KV cache, and appends a disabling entry for every linear the spec
ignores. The export writes `hf_quant_config.json` and a config.json whose
quantization_config has quant_method "modelopt"; unquantised tensors are exported in the
dtype the model was loaded in.

What ships differs from the calibrated in-memory model in one ModelOpt-made way (see
modelopt/torch/export): AWQ's per-linear pre_quant_scales of q/k/v (and gate/up) are
unified, folded into the preceding norm and those weights re-quantised; o_proj and
down_proj keep their own scale and are tested to match the calibrated values exactly.
Reading back, fp8 rounding ties go to even as in torch's cast and the GPU's conversion;
ModelOpt's CPU emulation may round a tie the other way, a one-ulp difference on that value.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.quant.backends.base import SHARD_SIZE, QuantJob, load_whole, register_backend
from kiln.quant.selection import is_ignored

if TYPE_CHECKING:
    from kiln.quant.spec import QuantSpec, Scheme

PRESETS = {
    "FP8": "FP8_DEFAULT_CFG",
    "W4A16_AWQ": "INT4_AWQ_CFG",
    "W8A8_SQ": "INT8_SMOOTHQUANT_CFG",
    "W4A8_AWQ": "W4A8_AWQ_BETA_CFG",
    # Calibrates on a CPU (max amax collection) and exports there, but ModelOpt's NVFP4 fake
    # quantiser asserts a CUDA tensor, so the calibrated model cannot run on a CPU: the
    # export is read back and run with kiln's own NVFP4 emulation (runtime/formats/nvfp4.py).
    "NVFP4": "NVFP4_DEFAULT_CFG",
}

# The presets whose calibration reads weights outside the forward (AWQ's search, SmoothQuant's
# smoothing): `load_offloaded` gives them the whole model. The others calibrate by max alone.
WHOLE = frozenset({"W4A16_AWQ", "W8A8_SQ", "W4A8_AWQ"})


def build_config(model: Any, scheme: Scheme, spec: QuantSpec) -> dict[str, Any]:
    """The mtq.quantize config for `scheme`, from ModelOpt's preset."""
    import modelopt.torch.quantization as mtq
    import torch

    cfg = copy.deepcopy(getattr(mtq, PRESETS[scheme.name]))
    if scheme.group_size is not None:
        for entry in cfg["quant_cfg"]:
            if entry.get("quantizer_name") != "*weight_quantizer":
                continue
            for args in entry["cfg"] if isinstance(entry["cfg"], list) else [entry["cfg"]]:
                if args.get("block_sizes"):
                    args["block_sizes"][-1] = scheme.group_size
    if scheme.kv_cache == "fp8":
        cfg["quant_cfg"] += copy.deepcopy(mtq.FP8_KV_CFG["quant_cfg"])
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and is_ignored(name, spec.ignore):
            cfg["quant_cfg"].append({"quantizer_name": f"{name}.*", "enable": False})
    return cfg


def calibrate(model: Any, scheme: Scheme, spec: QuantSpec, samples: list[list[int]]) -> None:
    """Insert ModelOpt quantisers into `model` and calibrate them on `samples` (in place)."""
    import modelopt.torch.quantization as mtq
    import torch

    device = model.get_input_embeddings().weight.device  # where an offloaded model runs

    def forward_loop(m: torch.nn.Module) -> None:
        for ids in samples:
            m(torch.tensor([ids], device=device))

    mtq.quantize(model, build_config(model, scheme, spec), forward_loop)


def load_offloaded(model_dir: Path, dtype: Any, offload: Path, scheme: Scheme) -> Any:
    """For a scheme ModelOpt calibrates by max alone (FP8, NVFP4), the float model with its
    decoder layers left on disk (accelerate's offloading, which ModelOpt's calibration hooks
    run through and its export streams a layer at a time from; `_WrittenBack` keeps them there
    through the calibration), the embeddings, final norm and head in memory where the layers
    run: on the GPU where there is one. (ModelOpt's export makes its dummy inputs on the
    model's device, which must hold data: the embeddings', never "disk".) AWQ and SmoothQuant
    read the weights outside the forward: the whole model."""
    import json

    import modelopt.torch.quantization as mtq
    import torch
    from transformers import AutoModelForCausalLM

    if getattr(mtq, PRESETS[scheme.name]).get("algorithm") != "max":
        return load_whole(model_dir, dtype, offload, scheme)

    config = json.loads((Path(model_dir) / "config.json").read_text())
    config = config.get("text_config") or config
    main = "cuda:0" if torch.cuda.is_available() else "cpu"
    layers = {f"model.layers.{i}": "disk" for i in range(int(config["num_hidden_layers"]))}
    kept = {"model.embed_tokens": main, "model.rotary_emb": main, "model.norm": main,
            "lm_head": main}  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, device_map={**kept, **layers}, offload_folder=str(offload)
    )
    _keep_on_disk(model)
    return model.eval()


class _WrittenBack(dict[str, Any]):
    """What accelerate's offloaded-weights loader reads before its disk index: the weights
    written back into it, less those written back unchanged.

    ModelOpt's max calibration first reads every weight in a window that writes it back on
    exit (max_calibrate → weight_only_quantize → _writeback_params_to_weights_map in
    modelopt/torch/quantization/plugins/accelerate.py), and a weight accelerate keeps on disk
    is written back here, in memory, for the rest of the run: the whole model a second time
    (on a CPU, views of the mapped source checkpoint that RSS counts; with a GPU, host copies),
    2.0× the bf16 bytes at the peak for a 1B Llama, 1.0× without. Calibrating by max reads the
    weights and never changes them, so one equal to its disk copy is left there (each weight
    read once more to compare); one a calibration did change is kept, as ModelOpt means it."""

    def __init__(self, loader: Any) -> None:
        super().__init__(loader.state_dict)
        self.loader = loader

    def __setitem__(self, key: str, value: Any) -> None:
        import torch

        if key not in self and key in self.loader.index:
            on_disk = self.loader[key]
            if on_disk.dtype == value.dtype and torch.equal(on_disk, value.to(on_disk.device)):
                return
        super().__setitem__(key, value)


def _keep_on_disk(model: Any) -> None:
    """Give the loaders of `model`'s disk-offloaded weights a `_WrittenBack` state dict."""
    from accelerate.utils.offload import OffloadedWeightsLoader, PrefixedDataset

    for module in model.modules():
        weights = getattr(getattr(module, "_hf_hook", None), "weights_map", None)
        if not isinstance(weights, PrefixedDataset):
            continue
        loader = weights.dataset
        if isinstance(loader, OffloadedWeightsLoader) and not isinstance(
            loader.state_dict, _WrittenBack
        ):
            loader.state_dict = _WrittenBack(loader)


@register_backend(
    "modelopt",
    format="modelopt",
    schemes={"NO_QUANT", *PRESETS},
    activations={"none", "fp8_static", "int8_static", "nvfp4"},
    kv_cache={"none", "fp8"},
    packages=("nvidia-modelopt",),
    load=load_offloaded,
    loads_whole=WHOLE,
)
def run(job: QuantJob) -> None:
    """Calibrate the model with ModelOpt and export the HF checkpoint into job.out_dir.

    The export rewrites the model's weights into their packed form: the model cannot run after.
    """
    from modelopt.torch.export import export_hf_checkpoint

    calibrate(job.model, job.scheme, job.spec, job.samples)
    job.progress(f"exporting ModelOpt HF checkpoint to {job.out_dir}")
    export_hf_checkpoint(job.model, dtype=job.model.dtype, export_dir=job.out_dir,
                         max_shard_size=SHARD_SIZE)  # fmt: skip


# Reading the export back: transformers has no "modelopt" quantizer, so a ModelOpt HF
# checkpoint cannot be loaded by from_pretrained; quant/streamed_model.py runs it from the codes
# and scales kiln's checkpoint reader decodes, with the exported activation, pre-quant and KV
# cache scales applied by hooks.


def load_checkpoint(path: Path) -> tuple[Any, Mapping[str, Any]]:
    """(model, effective weights) of a ModelOpt HF export, in float32 on CPU: the model computes
    with the dequantised weights as the deployed kernel holds them (`served_linear`: W4A8 AWQ's
    FP8-rounded weights) and the exported activation scales (pre_quant_scale, then fake
    quantisation of the input: int8 for SmoothQuant, fp8 otherwise) and KV cache scales (keys
    and values rounded after RoPE, as the cache holds them). Effective weights are dequantised
    weight × pre_quant_scale per input column, comparable with the float model's."""
    from kiln.quant.streamed_model import quantised_model

    return quantised_model(Path(path))
