"""The formats every package reads and writes: the artifact (layout, manifest, verification),
Hugging Face checkpoint readers, the stored weight encodings and their numerics, the model's
shape record, recorded traffic and mirror logs. The contract between compiler, gates and
runtime; nothing here runs a model.
"""
