"""Integrations with training frameworks; import a submodule, e.g. zeroshard.integrations.hf."""
