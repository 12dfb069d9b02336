"""What a load run yields: latency statistics, the summary, reports, the results store, plots, comparisons."""
