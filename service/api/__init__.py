"""HTTP API: OpenAI-compatible and native routes in front-end processes, over the engine process."""
