"""contrail: continual reinforcement learning for LLM agents across environments."""

__version__ = "0.1.0"
