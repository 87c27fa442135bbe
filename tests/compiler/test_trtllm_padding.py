"""Where the padding of a group-wise int4 linear sits in each rank's shard at tp > 1.

TensorRT-LLM 1.2's group-wise layers (quantization/layers.py
`WeightOnlyGroupwiseQuantLinear` / `...RowLinear`) pad the whole in and out features to a
multiple of max(64, group) × tp (max(128, group) for W4A8) and split that by tp. Its GEMM
plugin (cpp/tensorrt_llm/plugins/weightOnlyGroupwiseQuantMatmulPlugin, `enqueue`) takes K
from the activation and N from the weight, so a rank reads the leading K rows of its shard:
each rank's own slice must come first and the zeros after it, on the split dimension of both
column- (output rows) and row-parallel (input columns) layers. (TensorRT-LLM's own HF loader,
`postprocess_weight_only_groupwise`, instead pads the whole tensor at its end and splits it
evenly; that places rank r > 0's rows off their activations whenever a dimension is padded.)
"""

from __future__ import annotations

import pytest
import torch

from kiln.compiler.trtllm.export.decode import decode_checkpoint, read_checkpoint
from kiln.compiler.trtllm.export.writer import export_checkpoint
from kiln.compiler.trtllm.rules.checkpoint import check_checkpoint
from kiln.compiler.trtllm.rules.exclusions import padded_features
from kiln.runtime.formats.checkpoint.modelopt import unpack_int4_rows
from tests.compiler.test_trtllm_conformance import awq_576  # noqa: F401


@pytest.mark.parametrize("tp", [2, 4])
def test_each_ranks_own_slice_leads_its_padded_shard(awq_576, tp, tmp_path):  # noqa: F811
    export_checkpoint(awq_576, tmp_path / "one")
    export_checkpoint(awq_576, tmp_path / "many", tp_size=tp)
    assert check_checkpoint(tmp_path / "many") == []
    _, (whole,) = read_checkpoint(tmp_path / "one")
    _, ranks = read_checkpoint(tmp_path / "many")
    hidden, padded = 576, padded_features(576, 64, tp)
    # column-parallel mlp.fc: 768 outputs split by rank, hidden inputs padded at their end
    fc = unpack_int4_rows(whole["transformer.layers.0.mlp.fc.weight"])
    # row-parallel attention.dense: 512 inputs split by rank, hidden outputs padded at the end
    dense = unpack_int4_rows(whole["transformer.layers.0.attention.dense.weight"])
    rows, cols = 768 // tp, 512 // tp
    for r, rank in enumerate(ranks):
        got_fc = unpack_int4_rows(rank["transformer.layers.0.mlp.fc.weight"])
        assert torch.equal(got_fc[:, :hidden], fc[r * rows : (r + 1) * rows])
        assert not got_fc[:, hidden:].any()
        got_dense = unpack_int4_rows(rank["transformer.layers.0.attention.dense.weight"])
        assert got_dense.shape == (padded, cols)
        assert torch.equal(got_dense[:hidden], dense[:, r * cols : (r + 1) * cols])
        assert not got_dense[hidden:].any()
    one, many = decode_checkpoint(tmp_path / "one"), decode_checkpoint(tmp_path / "many")
    assert all(torch.equal(one[k], many[k]) for k in one)
