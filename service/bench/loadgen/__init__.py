"""The load generator: open- and closed-loop load against any OpenAI-compatible server, its statistics and reports."""
