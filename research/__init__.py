"""Research tooling: sweeps and their runner, results, reports, verdicts, measures, inspection."""
