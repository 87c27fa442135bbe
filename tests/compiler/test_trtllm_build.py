"""TensorRT-LLM engine build plans, their pre-checks, running them, and trtllm-serve options.

The `built` path runs a stand-in `trtllm-build` (a Python script written here, first on
PATH) that checks the arguments it receives and writes what trtllm-build writes; the GPU and
version detection is injected. Everything else uses this machine as it is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from kiln.compiler.trtllm.build.builder import run_build
from kiln.compiler.trtllm.build.host import BuildEnvironment, GpuInfo, detect_environment
from kiln.compiler.trtllm.build.plan import BuildPlanError, DraftBuild, build_plan
from kiln.compiler.trtllm.build.stamp import ENGINE_STAMP, check_engine_compatible
from kiln.compiler.trtllm.capacity import DeploySpec, plan
from kiln.compiler.trtllm.serve_config import serve_options, write_serve_config
from kiln.compiler.trtllm.targets import get_profile
from kiln.quant.schemes import resolve
from kiln.quant.spec import QuantSpec
from kiln.runtime.base.errors import PreflightError
from kiln.runtime.formats.model_info import ModelInfo

# config.json of meta-llama/Llama-3.2-1B and of a 2-layer draft cut from it.
LLAMA_32_1B = ModelInfo.from_hf_config({
    "architectures": ["LlamaForCausalLM"], "hidden_size": 2048, "intermediate_size": 8192,
    "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
    "vocab_size": 128256, "max_position_embeddings": 131072, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
})  # fmt: skip
DRAFT = replace(LLAMA_32_1B, num_layers=2)

FP8_KV = QuantSpec(method="fp8", weight_bits=8, activations="fp8_static", kv_cache="fp8")
AWQ = QuantSpec(method="awq", weight_bits=4, group_size=128, symmetric=False)
AWQ_FP8_KV = replace(AWQ, kv_cache="fp8")
H100 = get_profile("h100-sxm")
L40S = get_profile("l40s")
H100_HERE = GpuInfo("NVIDIA H100 80GB HBM3", (9, 0), "570.124.06")
TRTLLM_12 = BuildEnvironment("1.2.1", "10.13.3.9", "12.9", (H100_HERE,))


def _plan(spec, target, deploy, tmp_path, info=LLAMA_32_1B, **kw):
    p = plan(info, resolve(spec), target, deploy)
    return build_plan(
        info, resolve(spec), target, deploy, p, tmp_path / "ckpt", tmp_path / "engine", **kw
    )


def _problems(excinfo) -> str:
    return "\n".join(str(p) for p in excinfo.value.problems)


def test_fp8_h100_plan_is_the_exact_trtllm_build_command(tmp_path):
    deploy = DeploySpec(max_seq_len=8192, max_batch_size=64, max_num_tokens=8192)
    bp = _plan(FP8_KV, H100, deploy, tmp_path)
    assert bp.argv == [
        "trtllm-build", "--checkpoint_dir", str(tmp_path / "ckpt"),
        "--output_dir", str(tmp_path / "engine"), "--max_batch_size", "64",
        "--max_input_len", "8191", "--max_seq_len", "8192", "--max_num_tokens", "8192",
        "--kv_cache_type", "paged", "--tokens_per_block", "32",
        "--use_paged_context_fmha", "enable", "--use_fp8_context_fmha", "enable",
        "--gemm_plugin", "disable", "--multiple_profiles", "enable", "--workers", "1",
    ]  # fmt: skip
    assert bp.command.startswith("trtllm-build --checkpoint_dir ")
    assert bp.to_dict()["sm"] == "sm90" and bp.draft is None


def test_fp8_at_batch_4_on_hopper_uses_the_fp8_gemm_plugin(tmp_path):
    bp = _plan(FP8_KV, H100, DeploySpec(max_seq_len=4096, max_batch_size=4), tmp_path)
    assert bp.argv[bp.argv.index("--gemm_plugin") + 1] == "fp8"


def test_awq_l40s_tp2_plan_is_the_exact_trtllm_build_command(tmp_path):
    deploy = DeploySpec(max_seq_len=4096, max_batch_size=32, max_num_tokens=4096, tp_size=2)
    bp = _plan(AWQ, L40S, deploy, tmp_path)
    assert bp.argv == [
        "trtllm-build", "--checkpoint_dir", str(tmp_path / "ckpt"),
        "--output_dir", str(tmp_path / "engine"), "--max_batch_size", "32",
        "--max_input_len", "4095", "--max_seq_len", "4096", "--max_num_tokens", "4096",
        "--kv_cache_type", "paged", "--tokens_per_block", "32",
        "--use_paged_context_fmha", "enable", "--use_fp8_context_fmha", "disable",
        "--gemm_plugin", "auto", "--multiple_profiles", "enable", "--workers", "2",
    ]  # fmt: skip
    assert bp.world_size == 2


def test_draft_target_plan_builds_target_for_external_drafts_and_a_plain_draft(tmp_path):
    draft = DraftBuild(4, tmp_path / "draft-ckpt", tmp_path / "draft-engine", info=DRAFT)
    deploy = DeploySpec(max_seq_len=4096, max_batch_size=8, max_num_tokens=4096)
    bp = _plan(FP8_KV, H100, deploy, tmp_path, draft=draft)
    assert bp.argv[-4:] == ["--speculative_decoding_mode", "draft_tokens_external",
                            "--max_draft_len", "4"]  # fmt: skip
    assert bp.draft is not None and bp.draft.role == "draft"
    d = bp.draft.argv
    assert d[d.index("--checkpoint_dir") + 1] == str(tmp_path / "draft-ckpt")
    assert d[d.index("--use_paged_context_fmha") + 1] == "enable"
    assert d[d.index("--gemm_plugin") + 1] == "auto"  # a bf16 draft
    assert "--speculative_decoding_mode" not in d and "--max_draft_len" not in d
    assert [p.role for p in bp.plans()] == ["target", "draft"]


def test_a_speculative_engine_says_the_llm_api_cannot_drive_its_drafts(tmp_path):
    from kiln.compiler.trtllm.build.plan import ENGINE_SPECULATION

    draft = DraftBuild(4, tmp_path / "draft-ckpt", tmp_path / "draft-engine", info=DRAFT)
    bp = _plan(FP8_KV, H100, DeploySpec(max_seq_len=4096, max_batch_size=8), tmp_path, draft=draft)
    assert ENGINE_SPECULATION in bp.notes
    assert "PyTorch backend only" in ENGINE_SPECULATION
    script = bp.write_script(tmp_path / "build.sh").read_text()
    assert f"# note: {ENGINE_SPECULATION}" in script
    plain = _plan(FP8_KV, H100, DeploySpec(max_seq_len=4096, max_batch_size=8), tmp_path)
    assert ENGINE_SPECULATION not in plain.notes


def test_gather_context_logits_with_draft_tokens_is_refused(tmp_path):
    draft = DraftBuild(4, tmp_path / "d-ckpt", tmp_path / "d-engine")
    with pytest.raises(BuildPlanError) as e:
        _plan(FP8_KV, H100, DeploySpec(max_seq_len=4096), tmp_path, draft=draft,
              extra_args={"--gather_context_logits": None})  # fmt: skip
    assert (
        "--gather_context_logits: trtllm-build refuses to gather context logits with "
        "max_draft_len 4 > 0 — fix: drop --gather_context_logits" in _problems(e)
    )


def test_opt_num_tokens_with_multiple_profiles_is_refused(tmp_path):
    with pytest.raises(BuildPlanError) as e:
        _plan(AWQ, L40S, DeploySpec(max_seq_len=4096), tmp_path,
              extra_args={"opt_num_tokens": "256"})  # fmt: skip
    assert "--opt_num_tokens: cannot be set with --multiple_profiles enable" in _problems(e)
    assert "fix: drop --opt_num_tokens, or --multiple_profiles disable" in _problems(e)


def test_sm100_refuses_the_swiglu_rowwise_and_low_latency_plugins(tmp_path):
    extra = {"--gemm_swiglu_plugin": "fp8", "--low_latency_gemm_plugin": "fp8"}
    with pytest.raises(BuildPlanError) as e:
        _plan(FP8_KV, get_profile("b200"), DeploySpec(max_seq_len=4096), tmp_path,
              extra_args=extra)  # fmt: skip
    assert [p.key for p in e.value.problems] == ["--gemm_swiglu_plugin",
                                                  "--low_latency_gemm_plugin"]  # fmt: skip
    assert "not implemented on SM 100 (b200) — fix: drop --gemm_swiglu_plugin" in _problems(e)
    # The same flags are fine on Hopper.
    _plan(FP8_KV, H100, DeploySpec(max_seq_len=4096), tmp_path, extra_args=extra)


def test_max_input_len_above_max_seq_len_is_refused(tmp_path):
    with pytest.raises(BuildPlanError) as e:
        _plan(AWQ, L40S, DeploySpec(max_seq_len=2048), tmp_path,
              extra_args={"--max_input_len": "4096"})  # fmt: skip
    assert "--max_input_len: 4096 > max_seq_len 2048 — fix: max_input_len ≤ 2048" in _problems(e)


def test_short_token_budget_needs_chunked_context_which_fp8_kv_under_awq_loses(tmp_path):
    deploy = DeploySpec(max_seq_len=8192, max_num_tokens=2048)
    with pytest.raises(BuildPlanError) as e:
        _plan(AWQ_FP8_KV, H100, deploy, tmp_path)
    assert ("--max_num_tokens: 2048 < max_input_len 8191 without chunked context"
            in _problems(e))  # fmt: skip
    assert "max_num_tokens ≥ 8191" in _problems(e)
    # With paged context FMHA kept (FP8 weights + FP8 KV) chunked context covers it.
    assert "--use_paged_context_fmha" in _plan(FP8_KV, H100, deploy, tmp_path).argv


def test_a_scheme_the_engine_path_does_not_run_is_refused_with_alternatives(tmp_path):
    with pytest.raises(BuildPlanError) as e:
        _plan(FP8_KV, get_profile("a100-80gb"), DeploySpec(max_seq_len=4096), tmp_path)
    text = _problems(e)
    assert "quantization.method: FP8 does not run on a100-80gb on the engine path" in text
    assert "W4A16 AWQ (method: awq)" in text


def test_int4_weight_only_on_blackwell_is_refused_as_trtllm_builder_does(tmp_path):
    with pytest.raises(BuildPlanError) as e:
        _plan(AWQ, get_profile("b200"), DeploySpec(max_seq_len=4096), tmp_path)
    assert "W4A16_AWQ does not run on b200 on the engine path" in _problems(e)
    assert "FP8 (method: fp8)" in _problems(e)


def test_tp_that_cannot_split_the_mlp_is_refused(tmp_path):
    odd = replace(LLAMA_32_1B, intermediate_size=8191)
    with pytest.raises(BuildPlanError) as e:
        _plan(AWQ, L40S, DeploySpec(max_seq_len=4096, tp_size=2), tmp_path, info=odd)
    assert (
        "deploy.tp_size: 2 does not split 32 heads, 8 KV heads and 8191 MLP columns"
        " — fix: 1" in _problems(e)
    )


def test_a_checkpoint_exported_for_another_tp_or_scheme_is_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    config = {
        "mapping": {"world_size": 1, "tp_size": 1, "pp_size": 1},
        "quantization": {"quant_algo": "W4A16_AWQ", "kv_cache_quant_algo": None},
    }
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(BuildPlanError) as e:
        _plan(FP8_KV, H100, DeploySpec(max_seq_len=4096, tp_size=2), tmp_path)
    text = _problems(e)
    assert f"{ckpt / 'config.json'} was exported for world_size 1; the plan needs 2" in text
    assert "holds W4A16_AWQ (KV None); the recipe resolves to FP8 (KV FP8)" in text


# ---- running -----------------------------------------------------------------------------

STAND_IN = """\
#!{python}
import json, pathlib, sys
args = sys.argv[1:]
expected = json.loads({expected!r})
assert args in expected, ("unexpected arguments", args, expected)
out = pathlib.Path(args[args.index("--output_dir") + 1])
out.mkdir(parents=True, exist_ok=True)
world = {world}
if world:
    (out / "config.json").write_text(json.dumps({{"version": "1.2.1"}}))
    for rank in range(world):
        (out / f"rank{{rank}}.engine").write_bytes(b"plan")
print("warning: something", file=sys.stderr)
sys.exit({code})
"""


def _stand_in(tmp_path, monkeypatch, bp, world=1, code=0) -> Path:
    """A `trtllm-build` first on PATH that accepts only the argvs of `bp` (and its draft's)
    and writes `world` engines, then exits with `code`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    exe = bin_dir / "trtllm-build"
    expected = json.dumps([p.argv[1:] for p in bp.plans()])
    exe.write_text(STAND_IN.format(python=sys.executable, expected=expected, world=world,
                                   code=code))  # fmt: skip
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return exe


def _h100_plan(tmp_path, **kw):
    return _plan(FP8_KV, H100, DeploySpec(max_seq_len=4096, max_batch_size=8), tmp_path, **kw)


def test_stand_in_build_is_built_and_stamped(tmp_path, monkeypatch):
    bp = _h100_plan(tmp_path)
    _stand_in(tmp_path, monkeypatch, bp)
    record = run_build(bp, detect=lambda: TRTLLM_12)
    assert record.status == "built", record.to_dict()
    stamp = json.loads((tmp_path / "engine" / ENGINE_STAMP).read_text())
    assert stamp["gpu_name"] == "NVIDIA H100 80GB HBM3"
    assert stamp["compute_capability"] == "9.0" and stamp["sm"] == "sm90"
    assert stamp["tensorrt_version"] == "10.13.3.9"
    assert stamp["tensorrt_llm_version"] == stamp["engine_config_version"] == "1.2.1"
    assert stamp["cuda_version"] == "12.9"
    assert stamp["command"] == bp.command and stamp["built_at"]
    assert {"config.json", "rank0.engine"} <= set(stamp["engine_files"])
    assert record.stamps == [tmp_path / "engine" / ENGINE_STAMP]


def test_stand_in_builds_target_and_draft_and_stamps_both(tmp_path, monkeypatch):
    draft = DraftBuild(3, tmp_path / "d-ckpt", tmp_path / "d-engine", info=DRAFT)
    bp = _h100_plan(tmp_path, draft=draft)
    _stand_in(tmp_path, monkeypatch, bp)
    record = run_build(bp, detect=lambda: TRTLLM_12)
    assert record.status == "built", record.to_dict()
    assert record.stamps == [
        tmp_path / "engine" / ENGINE_STAMP,
        tmp_path / "d-engine" / ENGINE_STAMP,
    ]
    assert json.loads(record.stamps[1].read_text())["role"] == "draft"


def test_failed_build_is_failed_with_its_stderr_and_no_stamp(tmp_path, monkeypatch):
    bp = _h100_plan(tmp_path)
    _stand_in(tmp_path, monkeypatch, bp, world=0, code=3)
    record = run_build(bp, detect=lambda: TRTLLM_12)
    assert record.status == "failed" and record.reason == "target build exited 3"
    assert "warning: something" in record.stderr_tail
    assert not (tmp_path / "engine" / ENGINE_STAMP).exists()


def test_exit_0_without_engines_is_not_built(tmp_path, monkeypatch):
    bp = _h100_plan(tmp_path)
    _stand_in(tmp_path, monkeypatch, bp, world=0, code=0)
    record = run_build(bp, detect=lambda: TRTLLM_12)
    assert record.status == "failed"
    assert record.reason.endswith("lacks config.json, rank0.engine")


def test_without_tensorrt_llm_the_build_is_planned_with_a_build_script(tmp_path):
    bp = _h100_plan(tmp_path)
    if detect_environment().tensorrt_llm is not None:  # this machine, as it is
        pytest.skip("TensorRT-LLM is installed here: the build would run")
    record = run_build(bp)
    assert record.status == "planned" and record.reason == "tensorrt_llm not installed"
    assert record.commands == [bp.command]
    script = (tmp_path / "engine" / "build.sh").read_text()
    assert script.startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in script
    assert "nvidia-smi --query-gpu=compute_cap --format=csv,noheader" in script
    assert 'grep -cx "9.0"' in script
    assert script.rstrip().endswith(bp.command)
    assert os.access(tmp_path / "engine" / "build.sh", os.X_OK)
    assert not (tmp_path / "engine" / ENGINE_STAMP).exists()


@pytest.mark.parametrize(
    ("env", "reason"),
    [
        (BuildEnvironment("1.2.1", "10.13", "12.9"), "no GPU with sm90 here (found: none)"),
        (BuildEnvironment("1.2.1", "10.13", "12.9", (GpuInfo("NVIDIA A100-SXM4-80GB", (8, 0)),)),
         "no GPU with sm90 here (found: NVIDIA A100-SXM4-80GB (sm80))"),
        (BuildEnvironment("1.3.0", "10.14", "13.0", (H100_HERE,)),
         "tensorrt_llm 1.3.0 installed; engines need 1.2.x (trtllm-build was removed after it)"),
    ],
)  # fmt: skip
def test_wrong_gpu_or_version_is_planned_with_the_reason(tmp_path, env, reason):
    record = run_build(_h100_plan(tmp_path), detect=lambda: env)
    assert (record.status, record.reason) == ("planned", reason)


def test_a_tp2_plan_needs_two_gpus_of_the_target_kind(tmp_path):
    deploy = DeploySpec(max_seq_len=4096, max_batch_size=8, tp_size=2)
    record = run_build(_plan(FP8_KV, H100, deploy, tmp_path), detect=lambda: TRTLLM_12)
    assert record.reason == "no 2 GPUs with sm90 here (found: NVIDIA H100 80GB HBM3 (sm90))"
    assert 'grep -cx "9.0" <<<"$found" || true)" -lt 2 ]' in record.script.read_text()


def _trtllm_python(exe: Path, monkeypatch, installed: str) -> None:
    """$KILN_TRTLLM_PYTHON: a Python in which tensorrt_llm `installed` is what build.sh reads."""
    python = exe.parent / "trtllm-python"
    python.write_text(f"#!/bin/sh\necho {installed}\n")
    python.chmod(0o755)
    monkeypatch.setenv("KILN_TRTLLM_PYTHON", str(python))


def test_build_script_refuses_another_gpu_and_runs_on_the_right_one(tmp_path, monkeypatch):
    bp = _h100_plan(tmp_path)
    exe = _stand_in(tmp_path, monkeypatch, bp)
    _trtllm_python(exe, monkeypatch, "1.2.1")
    script = bp.write_script(tmp_path / "build.sh")
    smi = exe.parent / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 8.0\n")
    smi.chmod(0o755)
    refused = subprocess.run([str(script)], capture_output=True, text=True, check=False)
    assert refused.returncode == 1
    assert "needs 1 GPU(s) of compute capability 9.0 (sm90); found: 8.0" in refused.stderr
    assert not (tmp_path / "engine" / "rank0.engine").exists()
    smi.write_text("#!/bin/sh\necho 9.0\n")
    done = subprocess.run([str(script)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "engine" / "rank0.engine").is_file()


def test_build_script_refuses_a_tensorrt_llm_without_engines_naming_the_pytorch_path(
    tmp_path, monkeypatch
):
    bp = _h100_plan(tmp_path)
    exe = _stand_in(tmp_path, monkeypatch, bp)
    smi = exe.parent / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 9.0\n")
    smi.chmod(0o755)
    serve = "trtllm-serve trtllm/hf --backend pytorch --config engines/h100-sxm/trtllm-serve.yaml"
    script = bp.write_script(tmp_path / "build.sh", pytorch_command=serve)
    _trtllm_python(exe, monkeypatch, "1.3.0rc24")
    refused = subprocess.run([str(script)], capture_output=True, text=True, check=False)
    assert refused.returncode == 2
    assert "TensorRT-LLM 1.3.0rc24: this plan builds engines with 1.2.x" in refused.stderr
    assert serve in refused.stderr
    assert not (tmp_path / "engine" / "rank0.engine").exists()
    monkeypatch.setenv("KILN_TRTLLM_PYTHON", str(exe.parent / "no-such-python"))
    missing = subprocess.run([str(script)], capture_output=True, text=True, check=False)
    assert missing.returncode == 2 and "TensorRT-LLM not installed: this plan" in missing.stderr


def test_engine_compatibility_names_both_sides_and_the_rebuild_command(tmp_path, monkeypatch):
    bp = _h100_plan(tmp_path)
    _stand_in(tmp_path, monkeypatch, bp)
    assert run_build(bp, detect=lambda: TRTLLM_12).status == "built"
    engine = tmp_path / "engine"
    assert check_engine_compatible(engine, (9, 0), "10.13.3.9") == []
    assert check_engine_compatible(engine, "sm90", "10.13.3") == []
    assert check_engine_compatible(engine, (8, 0), "10.13.3.9") == [
        f"engine built for sm90 with TensorRT 10.13.3.9; this GPU is sm80 — rebuild with "
        f"`{bp.command}`"
    ]
    [trt] = check_engine_compatible(engine, "9.0", "10.11.0.33")
    assert "this machine has TensorRT 10.11.0.33 — install TensorRT 10.13.3.9" in trt
    assert "no kiln-engine.json" in check_engine_compatible(tmp_path, (9, 0), "10.13")[0]


# ---- trtllm-serve options ------------------------------------------------------------------


def test_serve_yaml_for_fp8_kv_parses_back_with_llm_api_keys(tmp_path):
    deploy = DeploySpec(max_seq_len=8192, max_batch_size=64, kv_free_fraction=0.85)
    p = plan(LLAMA_32_1B, resolve(FP8_KV), H100, deploy)
    path = write_serve_config(
        tmp_path / "serve" / "options.yaml", serve_options(resolve(FP8_KV), deploy, p)
    )
    assert yaml.safe_load(path.read_text()) == {
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "max_batch_size": 64,
        "max_input_len": 8191,
        "max_seq_len": 8192,
        "max_num_tokens": 8192,
        "kv_cache_config": {"free_gpu_memory_fraction": 0.85, "enable_block_reuse": True,
                            "tokens_per_block": 32, "dtype": "fp8"},
    }  # fmt: skip


def test_serve_yaml_with_a_draft_has_a_draft_target_speculative_config(tmp_path):
    deploy = DeploySpec(max_seq_len=16384, max_batch_size=8, max_num_tokens=4096)
    p = plan(LLAMA_32_1B, resolve(AWQ), L40S, deploy)
    options = serve_options(resolve(AWQ), deploy, p, draft_dir=tmp_path / "draft", max_draft_len=5)
    loaded = yaml.safe_load(write_serve_config(tmp_path / "o.yaml", options).read_text())
    assert loaded["speculative_config"] == {
        "decoding_type": "DraftTarget",
        "max_draft_len": 5,
        "speculative_model_dir": str(tmp_path / "draft"),
    }
    assert loaded["disable_overlap_scheduler"] is True
    assert loaded["enable_chunked_prefill"] is True  # 16383-token prompts, 4096-token steps
    assert "dtype" not in loaded["kv_cache_config"]


def test_serve_options_refuse_an_int8_kv_cache_the_pytorch_backend_lacks():
    spec = QuantSpec(method="smoothquant", weight_bits=8, activations="int8_dynamic",
                     kv_cache="int8")  # fmt: skip
    deploy = DeploySpec(max_seq_len=4096)
    p = plan(LLAMA_32_1B, resolve(spec), H100, deploy)
    with pytest.raises(PreflightError) as e:
        serve_options(resolve(spec), deploy, p)
    assert "INT8 KV cache does not run on h100-sxm on the PyTorch path" in e.value.message
    assert "SmoothQuant only in TensorRT engines" in e.value.message
