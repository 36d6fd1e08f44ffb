"""Workflows: thin ``run(config) -> output path`` functions that wire library components together."""
