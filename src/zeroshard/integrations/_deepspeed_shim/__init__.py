"""The directory `zeroshard run` puts on its workers' PYTHONPATH so that `import deepspeed` loads
`deepspeed.py` here (see ../deepspeed_alias.py). Nothing imports this package itself."""
