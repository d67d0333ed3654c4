"""`failfast serve`: the speculative engine behind an OpenAI-compatible HTTP API (docs/design.md, "Server")."""
