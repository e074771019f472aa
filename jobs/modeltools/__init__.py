"""Tools on models, outside any job: prepare, quantize, KV planning, the quality gate."""
