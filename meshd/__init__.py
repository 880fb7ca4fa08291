"""meshd: pool the machines you own into one LLM inference cluster, with no master."""

__version__ = "0.1.0"
