"""Operator tools: `kvrouter demo` (a local cluster) and `kvrouter view` (compare replicas)."""
