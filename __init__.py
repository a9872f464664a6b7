"""gasloc: peer-to-peer LLM pre-training with GASLoC.

The repository root is this package: each folder is `gasloc.<folder>` (see the README's layout table).
"""
__version__ = "0.1.0"
