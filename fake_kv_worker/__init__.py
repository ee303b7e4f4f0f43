"""A GPU-free LLM engine for tests and demos.

It serves OpenAI-style and SGLang-native requests, simulates a paged prefix cache per data
parallel rank, and publishes that cache's KV events over ZeroMQ in the exact wire formats of
vLLM and SGLang (see `wire.py`), so a router can be tested end to end without a GPU.

Modules, one concern each: `hashing` (engine block hashes), `wire` (mirror structs and
encoders), `cache` (the LRU paged cache, no I/O), `publisher` (ZMQ PUB and replay), `engine`
(one rank: cache + queue + events), `protocol` (request parsing, response bodies), `metrics`
(/v1/loads, /metrics), `app` (HTTP routes), `server` (lifecycle), `__main__` (command line).
"""
