"""lucedesk: a terminal workstation for local LLMs on one continuous-batching engine."""

__version__ = "0.1.0"
