"""appliance: a local-LLM appliance for edge boxes."""

__version__ = "0.1.0"
