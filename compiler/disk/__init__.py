"""The disk a compile needs, known before it is spent: the bytes each stage and the artifact
write (sizes.py: from the model's shapes and the resolved scheme), what the output's disk holds
already (stage_cache.py), and the peak against the free space there (estimate.py)."""

from kiln.compiler.disk.estimate import (
    MARGIN,
    SKIP_VARIABLE,
    DiskEstimate,
    DiskPart,
    estimate_disk,
    human,
    needed,
)

__all__ = [
    "MARGIN",
    "SKIP_VARIABLE",
    "DiskEstimate",
    "DiskPart",
    "estimate_disk",
    "human",
    "needed",
]
