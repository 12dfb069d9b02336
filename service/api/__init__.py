"""HTTP API: OpenAI-compatible and native routes over the async engine."""
