"""The directory `zeroshard run` puts on its workers' PYTHONPATH so that `import deepspeed` loads
`deepspeed.py` here (see ../alias.py). Nothing imports this package itself."""
