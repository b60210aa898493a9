# The documentation site (MkDocs + Material): `make docs` builds it into site/ with warnings as
# errors, `make serve` serves it on http://127.0.0.1:8000 while you edit docs/,
# `make config-reference` regenerates docs/reference/config-keys.md from the config schema.
PYTHON ?= python

.PHONY: docs serve config-reference

docs:
	NO_MKDOCS_2_WARNING=1 $(PYTHON) -m mkdocs build --strict

serve:
	NO_MKDOCS_2_WARNING=1 $(PYTHON) -m mkdocs serve

config-reference:
	$(PYTHON) docs/gen_config_reference.py
