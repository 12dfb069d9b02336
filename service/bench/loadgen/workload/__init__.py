"""The load schedule's inputs: when requests arrive (arrivals) and what they ask (datasets, prompts)."""
