"""mini-infer: a continuous-batching LLM inference engine in pure Python and PyTorch."""

__version__ = "0.1.0"
