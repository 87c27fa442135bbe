"""Model sources: a recipe's `model.source` string → a local float Hugging Face checkpoint.

Four kinds of source:

    hf_dir     a local Hugging Face directory (config.json, weights, tokenizer)
    gguf       a local .gguf file, dequantised to float32 through transformers + gguf
    builtin    a GGUF that a Python package ships: builtin:smollm2-135m-instruct
    hub_cache  hf:org/name, taken from the local Hugging Face hub cache only (kiln runs offline)

`parse_source` (reference.py) and `inspect_source` (metadata.py) read paths and metadata, never
weights, so a recipe is checked before anything heavy runs. `source_digest` (digest.py) names the
source's content. `float_checkpoint` (materialize.py) is the one step that loads weights: it
converts a source into a directory it is given (a compile stage's own); `materialize` keeps
such conversions in a content-addressed cache of their own, for tools outside a compile. File
hashes and GGUF metadata are remembered per user in $XDG_CACHE_HOME/kiln/ (sidecar.py).
"""

from kiln.compiler.sources.digest import (
    CHECKPOINT_FILES,
    checkpoint_files,
    digest_known,
    source_digest,
)
from kiln.compiler.sources.materialize import (
    PROVENANCE_FILE,
    float_checkpoint,
    materialize,
    used_in_place,
)
from kiln.compiler.sources.metadata import (
    CAUSAL_LM_CLASSES,
    check_architecture,
    inspect_source,
    weight_problems,
)
from kiln.compiler.sources.reference import (
    BUILTIN,
    BUILTIN_MODELS,
    GGUF,
    HF_DIR,
    HUB_CACHE,
    BuiltinModel,
    SourceRef,
    hub_cache_dir,
    parse_source,
)

__all__ = [
    "BUILTIN",
    "BUILTIN_MODELS",
    "CAUSAL_LM_CLASSES",
    "CHECKPOINT_FILES",
    "GGUF",
    "HF_DIR",
    "HUB_CACHE",
    "PROVENANCE_FILE",
    "BuiltinModel",
    "SourceRef",
    "check_architecture",
    "checkpoint_files",
    "digest_known",
    "float_checkpoint",
    "hub_cache_dir",
    "inspect_source",
    "materialize",
    "parse_source",
    "source_digest",
    "used_in_place",
    "weight_problems",
]
