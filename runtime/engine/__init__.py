"""The serving engine: requests in, tokens out, one scheduler step at a time over a paged KV
cache (core, scheduler, kv_cache, model, layers per weight format, sampling, spec_decode,
native CPU kernels).
"""
