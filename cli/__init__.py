"""gasloc: peer-to-peer LLM pre-training with GASLoC."""
__version__ = "0.1.0"
