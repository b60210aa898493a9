"""`zeroshard.integrations.lightning`, an old import path kept working: re-exports
`zeroshard.compat.lightning`, the Lightning strategy's home."""

from ..compat.lightning import ZeroShardStrategy  # noqa: F401

__all__ = ["ZeroShardStrategy"]
