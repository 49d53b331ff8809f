"""Command-line entry points; each one parses flags and calls the `transformer` library."""
